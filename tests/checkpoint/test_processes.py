"""Weight sync to receivers in node processes, over real sockets and process groups."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

import asyncflow_actors as afa
from asyncflow_actors.checkpoint import (
    CheckpointConfig,
    CheckpointEngine,
    ChecksumMismatch,
    CollectiveTransport,
    ManifestError,
    PhaseDeadlines,
    SyncFailed,
    read_weights,
)
from asyncflow_actors.checkpoint._manifest import tensor_bytes
from tests.checkpoint.doubles import (
    SPECS,
    DoubleState,
    GetState,
    GetWeights,
    random_weights,
    weights_of,
)

ALLOW = ["tests.checkpoint"]
# A node imports torch when it spawns its first engine: seconds on a loaded machine, during
# which it answers no heartbeat (the import runs on its loop).
FAST = afa.NodeOptions(heartbeat_interval=0.2, heartbeat_timeout=20.0, shutdown_grace=2.0)
SPECS_BIG = {
    **SPECS,
    "mask": ("bool", [33]),
    "lm_head.weight": ("float32", [400, 640]),  # 1 MB: zero-copy frames, split across buckets
}
DEADLINES = PhaseDeadlines(pause=30, prepare=30, topology=60, broadcast=60, finalize=30, resume=30)


async def spawn_all(nodes: list[afa.Node], kwargs: list[dict[str, Any]]) -> list[Any]:
    """Spawn a double on each node concurrently (each node imports torch: seconds)."""
    refs: list[Any] = [None] * len(nodes)

    async def one(i: int) -> None:
        refs[i] = await nodes[i].spawn(
            "tests.checkpoint.doubles:DoubleActor", name="engine", kwargs=kwargs[i]
        )

    async with trio.open_nursery() as nursery:
        for i in range(len(nodes)):
            nursery.start_soon(one, i)
    return refs


def exact(got: dict[str, torch.Tensor], sent: dict[str, torch.Tensor]) -> bool:
    return set(got) == set(sent) and all(
        got[k].dtype == v.dtype
        and got[k].shape == v.shape
        and torch.equal(tensor_bytes(got[k]), tensor_bytes(v))
        for k, v in sent.items()
    )


async def test_bit_exact_to_node_processes_over_zmq_ipc_and_tcp_gloo_and_files(
    tmp_path: Path,
) -> None:
    async with afa.open_actor_system() as system:
        nodes = [
            await system.start_node("ipc", allow=ALLOW, options=FAST),
            await system.start_node("tcp", allow=ALLOW, transport="tcp", options=FAST),
        ]
        kwargs = {"specs": SPECS_BIG, "tick": 0, "load": "eager"}
        refs = await spawn_all(nodes, [kwargs, kwargs])
        assert all(node.pid not in (None, os.getpid()) for node in nodes)
        configs = [
            CheckpointConfig(bucket_bytes=256 << 10, deadlines=DEADLINES),
            CheckpointConfig(bucket_bytes=256 << 10, deadlines=DEADLINES, transport="gloo"),
            CheckpointConfig(
                bucket_bytes=256 << 10,
                deadlines=DEADLINES,
                transport="file",
                directory=str(tmp_path),
            ),
        ]
        for version, config in enumerate(configs):
            sent = random_weights(version, SPECS_BIG)
            result = await CheckpointEngine(refs, config).sync(version, sent)
            assert result.transport == config.transport and result.buckets >= 2
            for ref in refs:
                assert exact(await ref.ask(GetWeights()), sent), config.transport
                state: DoubleState = await ref.ask(GetState())
                assert (state.version, state.paused, state.loads[-1]) == (version, False, version)
        assert exact(read_weights(tmp_path)[1], sent)  # the published files hold the last version
        assert read_weights(tmp_path)[0] == 2
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no partial left
        # a bit flipped in a bucket a remote receiver acknowledged on arrival: caught at finalize
        corrupter = await nodes[0].spawn(
            "tests.checkpoint.doubles:DoubleActor",
            name="corrupter",
            kwargs={**kwargs, "corrupt_bucket": 2},
        )
        with pytest.raises(SyncFailed) as info:
            await CheckpointEngine([*refs, corrupter], configs[0]).sync(
                3, random_weights(3, SPECS_BIG)
            )
        assert info.value.phase == "finalize" and info.value.receiver == "ipc/corrupter"
        assert isinstance(info.value.__cause__, ChecksumMismatch)
        for ref in refs:
            assert exact(await ref.ask(GetWeights()), sent)  # still version 2 everywhere
            assert (await ref.ask(GetState())).version == 2


async def test_a_receiver_node_killed_mid_broadcast(tmp_path: Path) -> None:
    stall = tmp_path / "stall"
    async with afa.open_actor_system() as system:
        nodes = [await system.start_node(f"n{i}", allow=ALLOW, options=FAST) for i in range(2)]
        lazy: dict[str, Any] = {"tick": 0.005, "load": "lazy"}
        refs = await spawn_all(nodes, [lazy, {**lazy, "stall_file": str(stall)}])
        engine = CheckpointEngine(refs, CheckpointConfig(bucket_bytes=256, deadlines=DEADLINES))
        failure: list[BaseException] = []

        async def sync() -> None:
            try:
                await engine.sync(0, weights_of(0))
            except SyncFailed as exc:
                failure.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(sync)
            with trio.fail_after(30):
                while not stall.exists() or not stall.read_text():
                    await trio.sleep(0.02)
            os.kill(int(stall.read_text()), signal.SIGKILL)  # kill -9 mid-broadcast
        (error,) = failure
        assert isinstance(error, SyncFailed) and error.phase == "broadcast"
        assert error.receiver == "n1/engine" and not error.committed
        with trio.fail_after(30):
            before: DoubleState = await refs[0].ask(GetState())
            await trio.sleep(0.2)
            after: DoubleState = await refs[0].ask(GetState())
        assert after.tokens > before.tokens  # resumed, decoding on its old weights
        assert (after.version, after.pending, after.violations) == (-1, None, ())
        with trio.fail_after(60):  # the node restarts; the next sync reaches both
            sent = weights_of(1)
            await engine.sync(1, sent)
            for ref in refs:
                while (await ref.ask(GetState())).version != 1:  # lazy: next batch boundary
                    await trio.sleep(0.01)
        for ref in refs:
            state = await ref.ask(GetState())
            assert not state.paused and not state.violations
            got = await ref.ask(GetWeights())
            assert exact(got, sent)


async def test_in_process_node_receivers_copy_before_acknowledging() -> None:
    # Over inproc:// libzmq hands the receiver the sender's own buffer (frames of 512 KiB and
    # more): a receiver that kept it without copying would see it refilled with later buckets.
    specs = {f"w{i}": ("float32", [75_000]) for i in range(21)}  # 3 per 1 MiB bucket
    async with afa.open_actor_system() as system:
        node = await system.start_node("here", allow=ALLOW, transport="inproc")
        kwargs = {"specs": specs, "tick": 0, "load": "eager"}
        ref = await node.spawn("tests.checkpoint.doubles:DoubleActor", name="engine", kwargs=kwargs)
        config = CheckpointConfig(bucket_bytes=1 << 20, deadlines=DEADLINES)
        engine = CheckpointEngine([ref], config)
        for version in range(2):
            sent = random_weights(version, specs)
            result = await engine.sync(version, sent)
            assert result.buckets == 7
            assert exact(await ref.ask(GetWeights()), sent)


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _npus() -> int:
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        return 0
    return int(torch.npu.device_count())  # type: ignore[attr-defined]


@pytest.mark.skipif(_gpus() < 3, reason="nccl needs a CUDA device per rank (3: sender + 2)")
async def test_nccl_broadcast_to_two_receivers_on_their_own_gpus() -> None:  # pragma: no cover
    await _device_sync("nccl", "cuda")


@pytest.mark.skipif(_npus() < 3, reason="hccl needs torch_npu and an Ascend NPU per rank (3)")
async def test_hccl_broadcast_to_two_receivers_on_their_own_npus() -> None:  # pragma: no cover
    await _device_sync("hccl", "npu")


async def _device_sync(backend: str, device: str) -> None:  # pragma: no cover
    async with afa.open_actor_system() as system:
        nodes = [
            await system.start_node(f"{backend}{i}", allow=ALLOW, options=FAST) for i in (1, 2)
        ]
        kwargs = [
            {"specs": SPECS_BIG, "tick": 0, "load": "eager", "device": f"{device}:{i}"}
            for i in (1, 2)
        ]
        refs = await spawn_all(nodes, kwargs)
        transport = CollectiveTransport(backend, device=f"{device}:0")  # type: ignore[arg-type]
        config = CheckpointConfig(bucket_bytes=256 << 10, deadlines=DEADLINES, transport=backend)  # type: ignore[arg-type]
        sent = {k: v.to(f"{device}:0") for k, v in random_weights(0, SPECS_BIG).items()}
        await CheckpointEngine(refs, config, transport=transport).sync(0, sent)
        for ref in refs:
            assert exact(await ref.ask(GetWeights()), {k: v.cpu() for k, v in sent.items()})


def test_the_hccl_transport_refuses_to_start_without_torch_npu() -> None:
    if _npus():
        pytest.skip("torch_npu is importable here")
    with pytest.raises(ManifestError, match="torch_npu"):
        CollectiveTransport("hccl").check(None)  # type: ignore[arg-type]


async def test_fused_syncs_to_node_processes(tmp_path: Path) -> None:
    """Small weights in one fused round over zmq ipc: bit-exact; a bit flipped on the wire
    caught before the commit; a receiver node killed in the round leaves the other on its old
    weights, resumed, and the restarted node gets the next sync whole."""
    stall = tmp_path / "stall"
    async with afa.open_actor_system() as system:
        nodes = [await system.start_node(f"f{i}", allow=ALLOW, options=FAST) for i in range(2)]
        lazy: dict[str, Any] = {"tick": 0.005, "load": "lazy"}
        refs = await spawn_all(nodes, [lazy, lazy])
        engine = CheckpointEngine(refs, CheckpointConfig(bucket_bytes=4096, deadlines=DEADLINES))

        async def converged(version: int, sent: dict[str, torch.Tensor], n: int = 2) -> None:
            with trio.fail_after(60):
                for ref in refs[:n]:
                    while (await ref.ask(GetState())).version != version:
                        await trio.sleep(0.01)  # lazy: the next batch boundary
                    assert exact(await ref.ask(GetWeights()), sent)

        sent = random_weights(0)
        result = await engine.sync(0, sent)
        assert result.fused and result.buckets == 1
        await converged(0, sent)
        corrupter = await nodes[0].spawn(
            "tests.checkpoint.doubles:DoubleActor",
            name="corrupter",
            kwargs={**lazy, "corrupt_bucket": 0},
        )
        with pytest.raises(SyncFailed) as info:
            await CheckpointEngine([*refs, corrupter], engine.config).sync(1, random_weights(1))
        assert info.value.phase == "finalize" and info.value.receiver == "f0/corrupter"
        assert isinstance(info.value.__cause__, ChecksumMismatch)
        await converged(0, sent)  # still version 0 everywhere
        stalling = await nodes[1].spawn(
            "tests.checkpoint.doubles:DoubleActor",
            name="stalling",
            kwargs={**lazy, "stall_file": str(stall)},
        )
        failure: list[BaseException] = []

        async def sync() -> None:
            try:
                await CheckpointEngine([refs[0], stalling], engine.config).sync(2, weights_of(2))
            except SyncFailed as exc:
                failure.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(sync)
            with trio.fail_after(30):
                while not stall.exists() or not stall.read_text():
                    await trio.sleep(0.02)
            os.kill(int(stall.read_text()), signal.SIGKILL)  # kill -9 in the fused round
        (error,) = failure
        assert isinstance(error, SyncFailed) and error.phase == "broadcast"
        assert error.receiver == "f1/stalling" and not error.committed
        await converged(0, sent, n=1)  # refs[0] dropped version 2, decodes on version 0
        assert not (await refs[0].ask(GetState())).paused  # (refs[1] died with node f1)
        sent = weights_of(3)
        with trio.fail_after(60):  # the node restarts; the next sync reaches every receiver
            assert (await engine.sync(3, sent)).fused
        await converged(3, sent)
