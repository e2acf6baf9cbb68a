"""``rollout.vllm_lora``: the forward stations merge the adapters an adapters-only sync brings
exactly as the trainer merges them, and the settings that cannot work are refused before
anything starts. (vLLM's side: ``tests/rollout/test_vllm_lora.py``.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncflow_actors.pipeline import PipelineConfigError, preflight
from asyncflow_actors.roles import LoraSettings
from asyncflow_actors.roles._forward import PolicyCopy
from asyncflow_actors.roles._lora import PREFIX, AdapterMerger, merged_state
from tests.pipeline.kit import tiny

_LORA = LoraSettings(r=4, alpha=8, target_modules=("q_proj",))
_Q = "model.layers.0.self_attn.q_proj"


def _adapter(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        f"{PREFIX}{_Q}.lora_A.default.weight": torch.randn(4, 16, generator=gen),
        f"{PREFIX}{_Q}.lora_B.default.weight": torch.randn(16, 4, generator=gen),
    }


def test_the_merger_computes_the_trainers_merge_from_the_kept_base() -> None:
    base = torch.randn(16, 16)
    state = {f"{_Q}.weight": base.clone(), "model.norm.weight": torch.ones(16)}
    merger = AdapterMerger(_LORA)
    for seed in (1, 2):  # the second adapter merges into the base, not into the first merge
        adapter = _adapter(seed)
        got = merger.merged(state, {**adapter, "model.norm.weight": torch.zeros(16)})
        peft_state = {f"{PREFIX}{_Q}.base_layer.weight": base, **adapter}
        want = merged_state(peft_state, _LORA)
        assert sorted(got) == [f"{_Q}.weight", "model.norm.weight"]
        assert torch.equal(got[f"{_Q}.weight"], want[f"{_Q}.weight"])
        state[f"{_Q}.weight"].copy_(got[f"{_Q}.weight"])
    with pytest.raises(KeyError, match="both lora_A and lora_B"):
        merger.merged(state, {f"{PREFIX}{_Q}.lora_A.default.weight": torch.zeros(4, 16)})


async def test_a_forward_station_copy_loads_merged_adapters() -> None:
    model = torch.nn.Module()
    model.q = torch.nn.Linear(16, 16, bias=False)
    base = model.q.weight.detach().clone()
    adapter = {name.replace(_Q, "q"): t for name, t in _adapter(3).items()}
    copy = PolicyCopy(model, 0, _LORA)
    await copy.load_weights(adapter, 1)
    a, b = adapter[f"{PREFIX}q.lora_A.default.weight"], adapter[f"{PREFIX}q.lora_B.default.weight"]
    assert torch.equal(model.q.weight, base + 2.0 * (b @ a)) and copy.version == 1
    plain = PolicyCopy(torch.nn.Linear(2, 2), 0, LoraSettings())  # r 0: no merging
    assert plain.merger is None


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"rollout": {"engine": "hf", "vllm_lora": True}}, "needs rollout.engine = 'vllm'"),
        ({"model": {"lora": {"r": 0}}}, "needs model.lora"),
        (
            {"model": {"lora": {"r": 4, "target_modules": ["lm_head"]}}},
            "the sync carries .* not \\['lm_head'\\]",
        ),
        (
            {"train": {"forward_ranks": 2}, "placement": {"roles": {"actor_fwd": "fwd"}}},
            "forward stations on ranks",
        ),
    ],
)
def test_vllm_lora_refuses_what_cannot_work(
    hf_folder: Path, change: dict[str, dict[str, object]], message: str
) -> None:
    table: dict[str, dict[str, object]] = {
        "model": {"hf": str(hf_folder), "lora": {"r": 4, "alpha": 8}},
        "rollout": {"engine": "vllm", "vllm_lora": True},
    }
    for key, value in change.items():
        table[key] = {**table.get(key, {}), **value}
    with pytest.raises(PipelineConfigError, match=f"rollout.vllm_lora: {message}"):
        preflight(tiny("async", **table))


async def test_a_lora_checkpoint_keeps_the_adapter_a_vllm_lora_resume_serves(
    tmp_path: Path, hf_folder: Path
) -> None:
    """A LoRA checkpoint holds the adapter alone (``adapter/``) beside the merged policy: read
    back under the trainer's names and merged into the base as a forward station does on
    resume, it gives the checkpoint's merged policy to the bit; the preflight lets a
    ``rollout.vllm_lora`` run resume from it, and refuses a checkpoint without it."""
    from safetensors.torch import load_file

    from asyncflow_actors.pipeline import run_pipeline
    from asyncflow_actors.pipeline._preflight import _check_vllm_lora
    from asyncflow_actors.roles._hf_policy import load_hf_policy
    from asyncflow_actors.roles._lora import ADAPTER_DIR, adapter_config, read_adapter

    lora = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    config = tiny(
        "sync",
        run_dir=str(tmp_path / "run"),
        model={"hf": str(hf_folder), "lora": lora},
        task={"reward": ["tests.tasks.rewards:digits"]},
        rollout={"engine": "hf"},
        train={"steps": 1, "checkpoint_every": 1, "lr": 1e-2},
    )
    result = await run_pipeline(config)
    saved = Path(result.checkpoints[-1])
    adapter = read_adapter(str(saved / ADAPTER_DIR))
    assert len(adapter) == 2 * 2 * 2  # 2 layers, q and v, A and B
    assert all(name.startswith(PREFIX) and ".default.weight" in name for name in adapter)
    assert any(t.abs().max() > 0 for n, t in adapter.items() if ".lora_B." in n)  # trained
    assert adapter_config(str(saved / ADAPTER_DIR))["r"] == 4
    base, _ = load_hf_policy(str(hf_folder), "cpu")
    copy = PolicyCopy(base, 0, LoraSettings(r=4, alpha=8, target_modules=("q_proj", "v_proj")))
    await copy.load_weights(adapter, 1)
    merged = load_file(str(saved / "policy" / "model.safetensors"))
    state = base.state_dict()
    assert all(torch.equal(state[name], tensor) for name, tensor in merged.items())
    served = tiny(
        "sync",
        model={"hf": str(hf_folder), "lora": lora},
        rollout={"engine": "vllm", "vllm_lora": True},
    )
    _check_vllm_lora(served, str(saved))
    (saved / ADAPTER_DIR / "adapter_model.safetensors").unlink()
    with pytest.raises(PipelineConfigError, match=r"rollout\.vllm_lora: the checkpoint holds no"):
        _check_vllm_lora(served, str(saved))
