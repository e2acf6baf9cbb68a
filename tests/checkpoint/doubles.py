"""Engine doubles for weight-sync tests (importable by node processes: plain-data kwargs).

``EngineDouble`` is a tiny generation engine: a decode loop (a helper task) emits one token per
``tick`` in batches of ``batch_tokens``, each token *encodes the weight version it was produced
with* (every weight tensor is filled with its version, and a token reads them all), and it
records anything that breaks the protocol's promises: a token from weights of two versions (or a
torn tensor), a token while paused. Its pause honours the four modes the way a real engine would
(drain or wait for the batch end, abort between tokens, keep: freeze between tokens and continue
under the new weights), and its ``load_weights`` copies tensor by tensor with checkpoints in
between, so a load racing the decode loop would be caught.

``DoubleActor`` hosts one, embedding a ``WeightReceiver`` exactly as a rollout actor would, and
applies pending weights at the engine's batch boundaries. Fault hooks (``World``) let in-process
tests cancel the sender at any phase, crash the receiver at a bucket, corrupt a bucket, slow a
pause down.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import torch
import trio

import asyncflow_actors as afa
from asyncflow_actors.checkpoint import (
    SYNC_MESSAGES,
    PauseAck,
    PauseMode,
    PutBucket,
    SyncFused,
    SyncMessage,
    WeightReceiver,
)

#: name -> (dtype, shape) of the double's weights: a mix of dtypes, one split across buckets
SPECS: dict[str, tuple[str, list[int]]] = {
    "embed.weight": ("float32", [16, 8]),
    "layers.0.attn.weight": ("bfloat16", [12, 8]),
    "layers.0.lora_A.default.weight": ("float32", [2, 8]),
    "layers.0.lora_B.default.weight": ("float32", [8, 2]),
    "layers.0.scale": ("float64", []),
    "layers.0.bias": ("int64", [5]),
    "norm.weight": ("float16", [8]),
    "empty": ("float32", [0, 4]),
}


def weights_of(
    version: int, specs: Mapping[str, tuple[str, list[int]]] = SPECS
) -> dict[str, torch.Tensor]:
    """Weights whose every element encodes ``version``."""
    return {
        name: torch.full(shape, version, dtype=getattr(torch, dtype))
        for name, (dtype, shape) in specs.items()
    }


def random_weights(
    seed: int, specs: Mapping[str, tuple[str, list[int]]] = SPECS
) -> dict[str, torch.Tensor]:
    """Random bytes of every dtype (bools valid: 0 or 1)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, (dtype_name, shape) in specs.items():
        dtype = getattr(torch, dtype_name)
        n = torch.Size(shape).numel() * dtype.itemsize
        raw = torch.randint(
            0, 2 if dtype is torch.bool else 256, (n,), dtype=torch.uint8, generator=gen
        )
        out[name] = raw.view(dtype).reshape(shape)
    return out


@attrs.define
class World:
    """In-process tests share this with their doubles: fault injection, engines, a log."""

    cancel_on: str | None = None  # a message class name: cancel ``scope`` when it arrives
    scope: trio.CancelScope | None = None
    crash_on_bucket: int | None = None
    crash_engine: int | None = None
    corrupt_bucket: int | None = None
    corrupt_engine: int | None = None
    slow_pause: float = 0.0
    slow_engine: int | None = None
    silent_on: str | None = None  # a message class name: never answer it (the handler hangs)
    log: list[tuple[str, int]] = attrs.Factory(list)  # ("acked" | "bucket", engine)
    engines: dict[int, EngineDouble] = attrs.Factory(dict)  # the live incarnation of each
    receivers: dict[int, WeightReceiver] = attrs.Factory(dict)


class EngineDouble:
    """A ``SyncTarget`` with a decode loop (see the module docstring)."""

    def __init__(
        self,
        specs: Mapping[str, tuple[str, list[int]]] = SPECS,
        *,
        tick: float = 1.0,
        batch_tokens: int = 4,
        pause_delay: float = 0.0,
    ) -> None:
        self.weights = weights_of(-1, specs)
        self._version = -1
        self.tick = tick
        self.batch_tokens = batch_tokens
        self.pause_delay = pause_delay
        self.request: PauseMode | None = None
        self.paused = False
        self.acked = trio.Event()
        self.resumed = trio.Event()
        self.tokens: list[int] = []
        self.violations: list[str] = []
        self.aborted = 0
        self.loads: list[int] = []
        self.pauses: list[PauseMode] = []
        self.looping = False  # run() drives the pause; without it, pause at once
        # ("paused",) ("resumed",) ("boundary",) ("load", v) ("token", v), in order
        self.events: list[tuple[Any, ...]] = []

    @property
    def version(self) -> int:
        return self._version

    def token(self) -> int:
        seen = set()
        for name, tensor in self.weights.items():
            if tensor.numel() == 0:
                continue
            values = set(tensor.flatten().to(torch.float64).tolist())
            if len(values) != 1:
                self.violations.append(f"tensor {name} is torn: {sorted(values)}")
            seen |= values
        if len(seen) != 1:
            self.violations.append(f"token from weights of versions {sorted(seen)}")
        if self.paused:
            self.violations.append("token while paused")
        value = int(next(iter(seen)))
        self.tokens.append(value)
        self.events.append(("token", value))
        return value

    async def pause(self, mode: PauseMode) -> PauseAck:
        self.pauses.append(mode)
        if not self.paused and self.looping:
            self.request = mode
            await self.acked.wait()  # the decode loop got to a safe point and stopped
        if not self.paused:
            self.events.append(("paused",))
        self.paused = True
        if self.pause_delay:
            await trio.sleep(self.pause_delay)
        return PauseAck(mode, self._version, aborted=self.aborted)

    async def resume(self) -> None:
        await trio.lowlevel.checkpoint()
        self.request = None
        if self.paused:
            self.events.append(("resumed",))
            self.paused = False
            self.acked = trio.Event()
            self.resumed.set()  # wakes the decode loop (if any)

    async def load_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        for name, tensor in weights.items():
            mine = self.weights.get(name)
            if mine is None or mine.dtype != tensor.dtype or mine.shape != tensor.shape:
                raise ValueError(f"cannot load {name!r}: {tensor.dtype} {tuple(tensor.shape)}")
        for name, tensor in weights.items():
            self.weights[name].copy_(tensor)
            await trio.lowlevel.checkpoint()  # a load takes time: nothing may decode meanwhile
        self._version = version
        self.loads.append(version)
        self.events.append(("load", version))

    async def _stop(self) -> None:
        """Acknowledge the pause and wait for the resume."""
        self.events.append(("paused",))
        self.paused = True
        self.resumed = trio.Event()
        self.acked.set()
        await self.resumed.wait()

    async def run(self, receiver: WeightReceiver) -> None:
        """The decode loop: batches of tokens, pending weights applied at batch boundaries."""
        self.looping = True
        while True:
            if self.request is not None:
                await self._stop()
            self.events.append(("boundary",))
            await receiver.apply_pending()  # the batch boundary
            for _ in range(self.batch_tokens):
                if self.request is PauseMode.ABORT:
                    self.aborted += 1
                    break
                if self.request is PauseMode.KEEP:
                    await self._stop()  # frozen between two tokens ...
                    self.events.append(("boundary",))
                    await receiver.apply_pending()  # ... continued under the new weights
                self.token()
                await trio.sleep(self.tick)


@attrs.frozen
class DoubleState:
    version: int
    pending: int | None
    paused: bool
    tokens: int
    violations: tuple[str, ...]
    loads: tuple[int, ...]
    pauses: tuple[str, ...]


@attrs.frozen
class GetState(afa.Request[DoubleState]):
    pass


@attrs.frozen
class GetWeights(afa.Request[dict[str, torch.Tensor]]):
    pass


DoubleMsg = SyncMessage | GetState | GetWeights


def _flip(data: torch.Tensor) -> torch.Tensor:
    data = data.clone()
    data[len(data) // 2] ^= 0x10
    return data


def _corrupt(msg: PutBucket) -> PutBucket:
    return PutBucket(msg.sync_id, msg.index, _flip(msg.data))


#: what a ``SyncFused`` request carries: a hook on any of these fires on it
FUSED_CARRIES = ("SyncFused", "SyncPause", "SyncPrepare", "PutBucket", "SyncFinalize")


class DoubleActor(afa.Actor[DoubleMsg]):
    """Hosts an ``EngineDouble`` and its ``WeightReceiver``.

    ``tick=0``: no decode loop (bit-exactness tests). ``strict``: the receiver refuses tensors
    the engine does not have. ``corrupt_bucket``: flip a bit of that bucket. ``device``: where collectives
    receive (``"cuda:1"`` for nccl). ``stall_file``: at the first bucket, write our pid there and hang
    (once: a restarted incarnation finds the file), so a test can kill the process mid-sync. ``index``/``world``: in-process fault injection (``world`` cannot
    cross to a node).
    """

    def __init__(
        self,
        specs: dict[str, Any] | None = None,
        load: str = "lazy",
        tick: float = 1.0,
        batch_tokens: int = 4,
        offload: bool = True,
        index: int = 0,
        strict: bool = False,
        stall_file: str | None = None,
        corrupt_bucket: int | None = None,
        device: str = "cpu",
        world: World | None = None,
        pause: bool = True,
    ) -> None:
        self.specs = {k: (v[0], list(v[1])) for k, v in (specs or SPECS).items()}
        self.pause = pause
        self.load = load
        self.tick = tick
        self.batch_tokens = batch_tokens
        self.offload = offload
        self.index = index
        self.strict = strict
        self.stall_file = stall_file
        self.corrupt_bucket = corrupt_bucket
        self.device = device
        self.world = world

    async def on_start(self, ctx: afa.ActorContext[DoubleMsg]) -> None:
        f = self.world
        delay = f.slow_pause if f is not None and f.slow_engine == self.index else 0.0
        self.engine = EngineDouble(
            self.specs, tick=self.tick, batch_tokens=self.batch_tokens, pause_delay=delay
        )
        self.receiver = WeightReceiver(
            self.engine,
            load=self.load,  # type: ignore[arg-type]
            expected=self.engine.weights if self.strict else None,
            device=self.device,
            offload=self.offload,
            name=ctx.name,
            pause=self.pause,
        )
        if f is not None:
            f.engines[self.index] = self.engine
            f.receivers[self.index] = self.receiver
        if self.tick > 0:
            ctx.start_soon(self.engine.run, self.receiver)

    def _inject(self, msg: Any) -> Any:
        if isinstance(msg, SyncFused):
            return self._inject_fused(msg)
        if isinstance(msg, PutBucket) and msg.index == self.corrupt_bucket:
            return _corrupt(msg)
        f = self.world
        if f is None:
            return msg
        if f.cancel_on == type(msg).__name__ and f.scope is not None:
            f.scope.cancel()
        if isinstance(msg, PutBucket):
            f.log.append(("bucket", self.index))
            if f.crash_engine == self.index and f.crash_on_bucket == msg.index:
                raise RuntimeError(f"engine {self.index} killed at bucket {msg.index}")
            if f.corrupt_engine == self.index and f.corrupt_bucket == msg.index:
                return _corrupt(msg)
        return msg

    def _inject_fused(self, msg: SyncFused) -> SyncFused:
        """The hooks of the messages a fused request carries (bucket hooks: its bucket 0).
        Logged as ``("fused", engine)``: its bucket is staged after this receiver's own pause,
        not after every receiver's (``docs/weight_sync.md``)."""
        f = self.world
        corrupt = self.corrupt_bucket == 0
        if f is not None:
            if f.cancel_on in FUSED_CARRIES and f.scope is not None:
                f.scope.cancel()
            f.log.append(("fused", self.index))
            if msg.data is not None and f.crash_engine == self.index and f.crash_on_bucket == 0:
                raise RuntimeError(f"engine {self.index} killed at its fused bucket")
            corrupt = corrupt or (f.corrupt_engine == self.index and f.corrupt_bucket == 0)
        if corrupt and msg.data is not None:
            return attrs.evolve(msg, data=_flip(msg.data))
        return msg

    async def receive(self, msg: DoubleMsg, ctx: afa.ActorContext[DoubleMsg]) -> Any:
        if self.world is not None and self.world.silent_on == type(msg).__name__:
            await trio.sleep_forever()
        stalls = isinstance(msg, (PutBucket, SyncFused))
        if stalls and self.stall_file and not os.path.exists(self.stall_file):
            Path(self.stall_file).write_text(str(os.getpid()))  # tell the test, once: kill us
            await trio.sleep_forever()
        if isinstance(msg, SYNC_MESSAGES):
            reply = await self.receiver.handle(self._inject(msg), ctx)
            acked = type(msg).__name__ in ("SyncPause", "SyncFused")
            if self.world is not None and acked and reply is not None:
                self.world.log.append(("acked", self.index))
            return reply
        if isinstance(msg, GetState):
            return DoubleState(
                version=self.engine.version,
                pending=self.receiver.pending_version,
                paused=self.engine.paused,
                tokens=len(self.engine.tokens),
                violations=tuple(self.engine.violations),
                loads=tuple(self.engine.loads),
                pauses=tuple(m.value for m in self.engine.pauses),
            )
        return {name: t.clone() for name, t in self.engine.weights.items()}
