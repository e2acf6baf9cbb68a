"""``model.impl="native"``: a Hugging Face Llama folder read without transformers gives the same
logits and token ids as transformers does, and every field it cannot represent is refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncflow_actors.models import (
    CharTokenizer,
    NativeConfigError,
    NativeTokenizer,
    NativeTokenizerError,
    load_native_model,
)

transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")


def _llama_folder(path: Path, *, seed: int = 0, **overrides: Any) -> Path:
    """A randomly initialised ``LlamaForCausalLM`` saved by transformers itself."""
    fields: dict[str, Any] = dict(
        vocab_size=41, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
        rms_norm_eps=1e-6, tie_word_embeddings=False,
    )  # fmt: skip
    fields.update(overrides)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields))
    with torch.no_grad():  # norms away from 1, so a swapped or missing norm shows
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return path


def _hf_logits(folder: Path, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask.long(), position_ids=positions)
    logits: torch.Tensor = out.logits
    return logits


def _compare(folder: Path, seed: int, batch: int = 3, width: int = 12) -> None:
    gen = torch.Generator().manual_seed(seed)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    ids = torch.randint(0, vocab, (batch, width), generator=gen)
    mask = torch.ones(batch, width, dtype=torch.bool)
    mask[1, :4] = False  # a left-padded row
    native = load_native_model(folder)
    with torch.no_grad():
        ours = native(ids, attention_mask=mask)
    theirs = _hf_logits(folder, ids, mask)
    torch.testing.assert_close(ours[mask], theirs[mask], atol=1e-5, rtol=0)


@pytest.mark.parametrize(("tied", "kv_heads"), [(False, 4), (True, 4), (False, 2), (True, 1)])
def test_native_logits_equal_transformers(tmp_path: Path, tied: bool, kv_heads: int) -> None:
    folder = _llama_folder(
        tmp_path / "m", tie_word_embeddings=tied, rope_theta=500.0, num_key_value_heads=kv_heads
    )
    _compare(folder, 1)
    model = load_native_model(folder)
    assert (model.lm_head.weight is model.embed.weight) == tied


@settings(
    max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    heads=st.sampled_from([1, 2, 4]),
    groups=st.sampled_from([1, 2, 4]),
    head_dim=st.sampled_from([4, 8, 16]),
    layers=st.integers(1, 3),
    ff=st.integers(8, 48),
    tied=st.booleans(),
    theta=st.sampled_from([100.0, 10000.0, 1e6]),
    eps=st.sampled_from([1e-6, 1e-5]),
    seed=st.integers(0, 2**16),
)
def test_native_logits_equal_transformers_over_configs(
    tmp_path_factory: pytest.TempPathFactory, heads: int, groups: int, head_dim: int,
    layers: int, ff: int, tied: bool, theta: float, eps: float, seed: int,
) -> None:  # fmt: skip
    hidden = heads * head_dim
    kv_heads = max(1, heads // groups)  # grouped-query attention where groups > 1
    folder = _llama_folder(
        tmp_path_factory.mktemp("m"), seed=seed, hidden_size=hidden, num_attention_heads=heads,
        num_key_value_heads=kv_heads, num_hidden_layers=layers, intermediate_size=ff,
        tie_word_embeddings=tied, rope_theta=theta, rms_norm_eps=eps,
    )  # fmt: skip
    _compare(folder, seed, width=20)


@pytest.mark.parametrize("kv_heads", [None, 1])
def test_an_export_of_the_tiny_model_loads_natively_to_the_same_model(
    tmp_path: Path, kv_heads: int | None
) -> None:
    from asyncflow_actors.models import TinyConfig, TinyDecoder
    from asyncflow_actors.rollout import export_hf

    tok = CharTokenizer("0123456789+=")
    torch.manual_seed(3)
    config = TinyConfig(
        vocab_size=tok.vocab_size, d_model=32, n_heads=2, max_seq_len=48, n_kv_heads=kv_heads
    )
    tiny = TinyDecoder(config)
    export_hf(tmp_path / "m", tiny, tok)
    native = load_native_model(tmp_path / "m")
    assert native.config == tiny.config
    for name, value in tiny.state_dict().items():
        assert torch.equal(native.state_dict()[name], value), name


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("rope_scaling", {"rope_type": "linear", "factor": 2.0}),
        ("num_key_value_heads", 3),
        ("hidden_act", "gelu"),
        ("attention_bias", True),
        ("mlp_bias", True),
        ("head_dim", 16),
        ("architectures", ["MistralForCausalLM"]),
        ("model_type", "qwen2"),
        ("attention_dropout", 0.1),
        ("dtype", "float8"),
        ("rope_parameters", {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0}),
    ],
)
def test_each_unrepresentable_field_is_refused_by_name(
    tmp_path: Path, field: str, value: Any
) -> None:
    folder = _llama_folder(tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config[field] = value
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(NativeConfigError, match=rf"model.impl='native': {field}.*model.impl='hf'"):
        load_native_model(folder)


def _bpe_folder(path: Path, **config: Any) -> Path:
    """A byte-level BPE trained here, saved as transformers' generic fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    backend = Tokenizer(models.BPE(unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    texts = ["the quick brown fox jumps over the lazy dog", "12 + 34 = 46", "héllo wörld ✓"]
    backend.train_from_iterator(texts * 20, trainer)
    bos = backend.token_to_id("<s>")
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", bos)]
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>", **config
    )
    fast.save_pretrained(path)
    return path


TEXTS = ["", "12+34=", "the lazy dog, isn't it ?", "héllo wörld ✓ 😀", "  spaces  \n tabs\t."]


@pytest.mark.parametrize(
    "config", [{}, {"add_bos_token": False}, {"add_eos_token": True, "add_bos_token": True}]
)
def test_native_tokenizer_gives_transformers_ids(tmp_path: Path, config: dict[str, Any]) -> None:
    from asyncflow_actors.roles._hf_policy import HFTokenizer

    folder = _bpe_folder(tmp_path / "t", **config)
    ours = NativeTokenizer(folder)
    theirs = HFTokenizer(transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True))
    assert (ours.eos_id, ours.pad_id, ours.vocab_size) == (
        theirs.eos_id, theirs.pad_id, theirs.vocab_size,
    )  # fmt: skip
    for text in TEXTS:
        for bos in (False, True):
            assert ours.encode(text, add_bos=bos) == theirs.encode(text, add_bos=bos), (text, bos)
        ids = [*ours.encode(text, add_bos=True), ours.eos_id, 5, 6]
        assert ours.decode(ids) == theirs.decode(ids)


def test_native_tokenizer_of_a_char_export(tmp_path: Path) -> None:
    from asyncflow_actors.roles._hf_policy import HFTokenizer
    from asyncflow_actors.rollout._hf_export import hf_char_tokenizer

    tok = CharTokenizer("0123456789+= abc")
    hf_char_tokenizer(tok).save_pretrained(tmp_path / "t")
    ours = NativeTokenizer(tmp_path / "t")
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "t", local_files_only=True)
    theirs = HFTokenizer(auto)
    for text in ["12+3=", "a b c", ""]:
        assert ours.encode(text, add_bos=True) == theirs.encode(text, add_bos=True)
        assert ours.encode(text) == tok.encode(text)
        assert ours.decode([*ours.encode(text), 2, 4]) == theirs.decode([*tok.encode(text), 2, 4])


def test_a_model_specific_tokenizer_class_is_not_native(tmp_path: Path) -> None:
    folder = _bpe_folder(tmp_path / "t")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "LlamaTokenizer"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(NativeTokenizerError, match="tokenizer_class='LlamaTokenizer'"):
        NativeTokenizer(folder)
    # a run falls back to transformers' tokenizer for it (the model stays native)
    from asyncflow_actors.roles._hf_policy import HFTokenizer
    from asyncflow_actors.roles._native_policy import native_tokenizer

    assert isinstance(native_tokenizer(str(folder)), HFTokenizer)


def test_the_native_path_never_imports_transformers_or_dynamo(tmp_path: Path) -> None:
    folder = _llama_folder(tmp_path / "m", vocab_size=300)
    _bpe_folder(folder)
    code = (
        "import sys, torch\n"
        "from asyncflow_actors.roles._native_policy import load_native_policy\n"
        f"model, tok = load_native_policy({str(folder)!r}, 'cpu')\n"
        "ids = torch.tensor([tok.encode('the dog', add_bos=True)])\n"
        "model(ids)\n"
        "print(type(tok).__name__, 'transformers' in sys.modules, 'torch._dynamo' in sys.modules)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    # neither transformers nor torch's compiler stack (2.5 s of imports a build on ``meta`` cost)
    assert out.stdout.split() == ["NativeTokenizer", "False", "False"]
