from __future__ import annotations

import pytest

from asyncflow_actors.models import (
    DEFAULT_ALPHABET,
    CharTokenizer,
    ModelConfigError,
    TinyConfig,
    TokenizerError,
)


def test_config_defaults_and_derived_fields() -> None:
    cfg = TinyConfig(vocab_size=20, d_model=64, n_heads=4)
    assert cfg.d_ff == 192
    assert cfg.head_dim == 16
    assert cfg.n_layers == 2


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"vocab_size": 0}, "vocab_size"),
        ({"vocab_size": 10, "d_model": 30, "n_heads": 4}, "divisible"),
        ({"vocab_size": 10, "d_model": 12, "n_heads": 4}, "even"),
        ({"vocab_size": 10, "rope_theta": -1.0}, "rope_theta"),
        ({"vocab_size": 10, "n_layers": True}, "n_layers"),
    ],
)
def test_config_rejects_invalid_fields(kwargs: dict[str, object], needle: str) -> None:
    with pytest.raises(ModelConfigError, match=needle):
        TinyConfig(**kwargs)  # type: ignore[arg-type]


def test_config_json_round_trip_and_unknown_keys() -> None:
    cfg = TinyConfig(vocab_size=17, d_model=32, n_layers=3, n_heads=2, d_ff=40, max_seq_len=50)
    assert TinyConfig.from_json(cfg.to_json()) == cfg
    with pytest.raises(ModelConfigError, match="unknown TinyConfig keys"):
        TinyConfig.from_dict({"vocab_size": 3, "width": 9})
    with pytest.raises(ModelConfigError, match="malformed"):
        TinyConfig.from_json("{not json")


def test_tokenizer_ids_and_round_trip() -> None:
    tok = CharTokenizer("ab+=")
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert tok.vocab_size == 7
    ids = tok.encode("ab+ba=", add_bos=True, add_eos=True)
    assert ids == [1, 3, 4, 5, 4, 3, 6, 2]
    assert tok.decode(ids) == "ab+ba="
    assert tok.token_text(2) == "<eos>"
    assert tok.token_text(5) == "+"


def test_tokenizer_decode_stops_at_eos_and_drops_specials() -> None:
    tok = CharTokenizer("xy")
    assert tok.decode([1, 3, 0, 4, 2, 3]) == "xy"
    assert tok.decode([3, 2, 4], stop_at_eos=False) == "xy"


def test_tokenizer_rejects_unknown_characters_and_ids() -> None:
    tok = CharTokenizer("0123456789")
    with pytest.raises(TokenizerError, match=r"'a' at position 2"):
        tok.encode("12a")
    with pytest.raises(TokenizerError, match="outside"):
        tok.decode([99])
    with pytest.raises(TokenizerError, match="duplicate"):
        CharTokenizer("aba")


def test_tokenizer_from_texts_and_json() -> None:
    tok = CharTokenizer.from_texts(["ba", "c"], extra="=")
    assert tok.alphabet == "=abc"
    assert CharTokenizer.from_json(tok.to_json()) == tok
    assert CharTokenizer().alphabet == DEFAULT_ALPHABET
    with pytest.raises(TokenizerError, match="char tokenizer"):
        CharTokenizer.from_json('{"type": "bpe"}')
