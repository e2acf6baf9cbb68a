from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from asyncflow_actors.models import (
    CharTokenizer,
    SafetensorsError,
    TinyConfig,
    TinyDecoder,
    load_model,
    load_tokenizer,
    save_model,
    save_safetensors,
)


def _model() -> tuple[TinyDecoder, CharTokenizer]:
    tok = CharTokenizer("0123456789+=")
    torch.manual_seed(4)
    return TinyDecoder(TinyConfig(vocab_size=tok.vocab_size, d_model=32, n_heads=2)), tok


def test_save_load_round_trip(tmp_path: Path) -> None:
    model, tok = _model()
    path = tmp_path / "policy.safetensors"
    save_model(path, model, tokenizer=tok)
    loaded = load_model(path)
    assert loaded.config == model.config
    tokens = torch.tensor([tok.encode("12+34=", add_bos=True)])
    assert torch.equal(loaded(tokens), model(tokens))
    assert load_tokenizer(path) == tok


def test_file_is_plain_safetensors_with_config_metadata(tmp_path: Path) -> None:
    safetensors = pytest.importorskip("safetensors")
    model, _ = _model()
    path = tmp_path / "policy.safetensors"
    save_model(path, model)
    with safetensors.safe_open(str(path), framework="pt") as fh:
        meta = fh.metadata()
        assert set(fh.keys()) == set(model.state_dict())
        assert torch.equal(fh.get_tensor("embed.weight"), model.embed.weight)
    assert TinyConfig.from_dict(json.loads(meta["config"])) == model.config
    with pytest.raises(SafetensorsError, match="no tokenizer"):
        load_tokenizer(path)


def test_load_rejects_foreign_or_mismatched_files(tmp_path: Path) -> None:
    model, _ = _model()
    foreign = tmp_path / "foreign.safetensors"
    save_safetensors(foreign, {"x": torch.zeros(1)})
    with pytest.raises(SafetensorsError, match="not a TinyDecoder file"):
        load_model(foreign)
    state = dict(model.state_dict())
    state.pop("norm.weight")
    broken = tmp_path / "broken.safetensors"
    meta = {"format": "asyncflow_actors.tiny_decoder/1", "config": model.config.to_json()}
    save_safetensors(broken, state, metadata=meta)
    with pytest.raises(SafetensorsError, match=r"missing \['norm.weight'\]"):
        load_model(broken)
