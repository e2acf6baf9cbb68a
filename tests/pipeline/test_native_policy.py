"""``model.impl="native"``: a Hugging Face Llama folder trained as the built-in tiny policy (the
built-in engine, tiny weight names), in a process per role, and handed back as a folder that
transformers loads with the trained weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncflow_actors.models import (
    CharTokenizer,
    TinyConfig,
    TinyDecoder,
    load_model,
)
from asyncflow_actors.pipeline import PipelineConfigError, run_pipeline
from asyncflow_actors.pipeline._preflight import check_contents

from .kit import tiny

transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")


def _folder(path: Path, *, tied: bool = False) -> Path:
    from asyncflow_actors.rollout import export_hf

    tokenizer = CharTokenizer("0123456789+=")
    torch.manual_seed(0)
    model = TinyDecoder(
        TinyConfig(vocab_size=tokenizer.vocab_size, d_model=32, n_heads=2, n_layers=1,
                   max_seq_len=32)
    )  # fmt: skip
    export_hf(path, model, tokenizer)
    if tied:  # transformers ties the head on load: the folder's head is the embedding
        config = json.loads((path / "config.json").read_text())
        config["tie_word_embeddings"] = True
        (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("tied", [False, True])
async def test_a_native_policy_trains_in_a_process_per_role(tmp_path: Path, tied: bool) -> None:
    folder = _folder(tmp_path / "hf", tied=tied)
    config = tiny(
        "sync",  # on-policy: the engine's and the trainer's log-probs compare at one version
        run_dir=str(tmp_path / "run"),
        model={"hf": str(folder), "impl": "native"},
        # differs between the samples of the untrained policy: the first steps move the weights
        task={"reward": "tests.tasks.rewards:digits"},
        train={"steps": 3, "checkpoint_every": 3, "lr": 1e-2},
        placement={"default": "process"},
    )
    result = await run_pipeline(config)
    assert [r.version for r in result.records] == [1, 2, 3]
    assert all(r.metrics["grad_norm"] > 0 for r in result.records)
    assert result.records[-1].sync["sync_bytes"] > 0
    # the built-in engine and the trainer agree on the log-probs of the same tokens
    assert abs(result.records[-1].metrics["mismatch_kl_k1"]) < 1e-3
    final = tmp_path / "run" / "final"
    trained = load_model(final / "policy.safetensors")  # what a resume loads
    exported = final / "policy"
    assert json.loads((exported / "config.json").read_text()) == json.loads(
        (folder / "config.json").read_text()
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(exported, local_files_only=True)
    start = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    tok = transformers.AutoTokenizer.from_pretrained(exported, local_files_only=True)
    ids = torch.tensor([tok("12+34=")["input_ids"]])
    with torch.no_grad():
        theirs, before, ours = hf(ids).logits, start(ids).logits, trained(ids)
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=0)
    assert not torch.allclose(theirs, before, atol=1e-4)  # the trained weights, not the start


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"rollout": {"engine": "hf"}}, "rollout.engine"),
        ({"model": {"lora": {"r": 4}}}, "model.lora"),
        ({"train": {"gradient_checkpointing": True}}, "train.gradient_checkpointing"),
    ],
)
def test_what_native_cannot_do_is_refused(
    tmp_path: Path, overrides: dict[str, dict[str, object]], field: str
) -> None:
    model = {"hf": str(tmp_path), "impl": "native", **overrides.pop("model", {})}
    with pytest.raises(PipelineConfigError, match=rf"{field}: model.impl='native'"):
        tiny("async", model=model, **overrides)


def test_preflight_names_an_unrepresentable_field(tmp_path: Path) -> None:
    folder = _folder(tmp_path / "hf")
    config = json.loads((folder / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(PipelineConfigError, match=r"model.impl='native': rope_scaling="):
        check_contents(tiny("async", model={"hf": str(folder), "impl": "native"}), None)


async def test_a_native_run_resumes_from_its_tiny_checkpoint(tmp_path: Path) -> None:
    folder = _folder(tmp_path / "hf")
    config = tiny(
        "sync", run_dir=str(tmp_path / "run"),
        model={"hf": str(folder), "impl": "native"},
        task={"reward": "tests.tasks.rewards:digits"},
        train={"steps": 3, "checkpoint_every": 1, "lr": 1e-2},
    )  # fmt: skip
    first = await run_pipeline(config)
    step1 = tmp_path / "run" / "checkpoints" / "step-000001"
    assert (step1 / "policy.safetensors").exists() and (step1 / "policy" / "config.json").exists()
    # the weights come from the checkpoint: the folder's own are not read again
    (folder / "model.safetensors").unlink()
    resumed = await run_pipeline(config, resume=str(step1))
    assert [(r.step, r.version) for r in first.records] == [(1, 1), (2, 2), (3, 3)]
    assert [(r.step, r.version) for r in resumed.records] == [(2, 2), (3, 3)]


def test_the_engine_cache_is_sized_by_the_run_not_by_the_folder_context() -> None:
    from types import SimpleNamespace

    from asyncflow_actors.roles._native_policy import native_kv_capacity

    model = TinyDecoder(TinyConfig(vocab_size=8, d_model=8, n_heads=2, max_seq_len=1000))
    dataset = SimpleNamespace(max_prompt_length=10)
    spec: Any = SimpleNamespace(task=SimpleNamespace(dataset=dataset),
                                rollout=SimpleNamespace(max_new_tokens=6))  # fmt: skip
    assert native_kv_capacity(spec, model) == 2 * (10 + 6)
    dataset.max_prompt_length = 5000  # past the context: the context bounds it
    assert native_kv_capacity(spec, model) == 2 * 1000
    dataset.max_prompt_length = None  # unknown: the engine's default
    assert native_kv_capacity(spec, model) is None


def test_a_native_run_in_one_process_never_imports_transformers(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    folder = _folder(tmp_path / "hf")
    code = f"""
import sys, trio
from asyncflow_actors.pipeline import run_pipeline
from tests.pipeline.kit import tiny
config = tiny("async", run_dir={str(tmp_path / "run")!r}, train={{"steps": 2, "checkpoint_every": 2}},
              model={{"hf": {str(folder)!r}, "impl": "native"}})
result = trio.run(run_pipeline, config)
print(len(result.records), "transformers" in sys.modules, "torch._dynamo" in sys.modules)
"""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env=env, cwd=root)  # fmt: skip
    # neither transformers nor torch's compiler (torch.optim's wrappers import it: ``_adamw``)
    assert out.stdout.split() == ["2", "False", "False"]
    assert (tmp_path / "run" / "final" / "policy" / "model.safetensors").exists()


async def test_a_native_run_with_two_trainer_ranks_exports_the_folder(tmp_path: Path) -> None:
    """FSDP2 over the tied TinyDecoder on 2 gloo ranks: it trains, and the export gathered on
    rank 0 is the folder again, loadable by transformers."""
    folder = _folder(tmp_path / "hf", tied=True)
    config = tiny(
        "sync", run_dir=str(tmp_path / "run"),
        model={"hf": str(folder), "impl": "native"},
        task={"reward": "tests.tasks.rewards:digits"},
        train={"steps": 2, "ranks": 2, "checkpoint_every": 2, "lr": 1e-2},
    )  # fmt: skip
    result = await run_pipeline(config)
    assert [r.version for r in result.records] == [1, 2]
    assert all(r.sync["sync_bytes"] > 0 for r in result.records)
    exported = Path(result.checkpoints[-1]) / "policy"
    hf = transformers.AutoModelForCausalLM.from_pretrained(exported, local_files_only=True)
    trained = load_model(Path(result.checkpoints[-1]) / "policy.safetensors")
    ids = torch.tensor([[1, 4, 5, 13, 6]])
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, trained(ids), atol=1e-5, rtol=0)
