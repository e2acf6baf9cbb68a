"""A rank group: N processes in one ``torch.distributed`` process group, rank 0 leading.

Rank 0 (the trainer's own process) creates the rendezvous store on a free port of the address
it hands out, starts ranks 1..N-1 as child processes (``python -m
asyncflow_actors.roles._rank_main``) pointed at it, and joins; no hand-set ``MASTER_ADDR``.
torchrun / SLURM users instead start every rank themselves: ``Rendezvous.from_env`` reads
``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, rank 0 leads and the others
``serve`` (docs/training.md).

The leader drives the others over a control channel on the same group: each command is a
msgpack header plus tensors, broadcast from rank 0 (no pickle on any wire). Every collective has
the group's timeout, so a rank that dies never hangs the others: the leader's command fails
with ``RankFailed`` naming the rank whose process exited (or none, when it only timed out).
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import attrs
import msgspec
import torch
import torch.distributed as dist
from torch.distributed import TCPStore  # type: ignore[attr-defined]

BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


class RankProcess(Protocol):
    """A rank > 0 as the leader sees it: a child process (``subprocess.Popen``) or a Ray
    actor (``_ray_ranks.RayRank``)."""

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def kill(self) -> None: ...


class RankFailed(RuntimeError):
    """A rank group's command failed: ``rank`` died (its exit status in the message), or a
    collective ran past the group's timeout (``rank`` None). The group is unusable after it."""

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


def backend_for(device: str) -> str:
    """The collective backend for a device: gloo on CPU, nccl on CUDA, hccl on Ascend."""
    kind = torch.device(device).type
    if kind not in BACKENDS:
        raise ValueError(f"no collective backend for device {device!r}; expected cpu, cuda or npu")
    return BACKENDS[kind]


@attrs.frozen
class Rendezvous:
    """Where the ranks of a group meet: ``host:port`` of rank 0's store, the group's size, its
    backend and the timeout of every collective (seconds)."""

    host: str
    port: int
    world_size: int
    backend: str = "gloo"
    timeout_s: float = 300.0

    @classmethod
    def from_env(cls, *, backend: str = "gloo", timeout_s: float = 300.0) -> tuple[Rendezvous, int]:
        """The rendezvous and this process's rank from torchrun / SLURM-style environment
        variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``)."""
        env = os.environ
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in env]
        if missing:
            raise ValueError(f"environment rendezvous needs {', '.join(missing)}")
        rdv = cls(env["MASTER_ADDR"], int(env["MASTER_PORT"]), int(env["WORLD_SIZE"]), backend,
                  timeout_s)  # fmt: skip
        return rdv, int(env["RANK"])

    def join_env(self, rank: int) -> None:
        """Join as ``rank`` through ``env://`` (rank 0, or torchrun's agent, hosts the store)."""
        timeout = datetime.timedelta(seconds=self.timeout_s)
        dist.init_process_group(self.backend, init_method="env://", rank=rank,
                                world_size=self.world_size, timeout=timeout)  # fmt: skip
        _joined(self.backend, timeout)

    def join(self, rank: int, store: Any = None) -> None:
        """Join the default process group as ``rank`` (through ``store`` when given)."""
        timeout = datetime.timedelta(seconds=self.timeout_s)
        if store is None:
            store = TCPStore(self.host, self.port, self.world_size, is_master=False,
                                  timeout=timeout)  # fmt: skip
        dist.init_process_group(self.backend, store=store, rank=rank,
                                world_size=self.world_size, timeout=timeout)  # fmt: skip
        _joined(self.backend, timeout)


_CONTROL: list[Any] = []  # the host-memory (gloo) group of this process's rank group


def _joined(backend: str, timeout: datetime.timedelta) -> None:
    """After joining: a gloo group for the commands and host-memory figures (the default
    group is the device's: nccl and hccl move device tensors only); the rank's device."""
    _CONTROL.clear()
    _CONTROL.append(None if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout))
    if backend == "nccl":
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    elif backend == "hccl":  # pragma: no cover - Ascend
        torch.npu.set_device(dist.get_rank() % torch.npu.device_count())  # type: ignore[attr-defined]


def control_group() -> Any:
    """The group for host-memory collectives (None: the default group, gloo itself)."""
    return _CONTROL[0] if _CONTROL else None


def open_store(host: str, world_size: int, timeout_s: float) -> Any:
    """Rank 0's rendezvous store on a free port of ``host`` (``store.port`` says which)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    return TCPStore(host, 0, world_size, is_master=True, timeout=timeout,
                         wait_for_workers=False)  # fmt: skip


# -- the control channel ------------------------------------------------------------------------

_DTYPES = {str(t).removeprefix("torch."): t for t in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.uint8, torch.bool, torch.int8, torch.int16,
)}  # fmt: skip


def broadcast_command(header: Mapping[str, Any], tensors: Sequence[torch.Tensor] = ()) -> None:
    """Rank 0: send ``header`` (msgpack-able) and ``tensors`` to every rank."""
    specs = [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in tensors]
    raw = msgspec.msgpack.encode({"header": dict(header), "tensors": specs})
    size = torch.tensor([len(raw)], dtype=torch.int64)
    group = control_group()
    dist.broadcast(size, 0, group=group)
    dist.broadcast(torch.frombuffer(bytearray(raw), dtype=torch.uint8), 0, group=group)
    for tensor in tensors:
        dist.broadcast(tensor.contiguous().cpu(), 0, group=group)


def receive_command() -> tuple[dict[str, Any], list[torch.Tensor]]:
    """Ranks > 0: the next ``broadcast_command``'s header and tensors."""
    size = torch.zeros(1, dtype=torch.int64)
    group = control_group()
    dist.broadcast(size, 0, group=group)
    raw = torch.empty(int(size), dtype=torch.uint8)
    dist.broadcast(raw, 0, group=group)
    message = msgspec.msgpack.decode(raw.numpy().tobytes())
    tensors = []
    for dtype, shape in message["tensors"]:
        tensor = torch.empty(shape, dtype=_DTYPES[dtype])
        dist.broadcast(tensor, 0, group=group)
        tensors.append(tensor)
    return dict(message["header"]), tensors


# -- the group, from the leader's side ----------------------------------------------------------


# starts ranks 1..N-1 pointed at a rendezvous, with extra environment and torch threads: the
# ranks, and what frees their placement (or None)
SpawnRanks = Callable[
    [Rendezvous, Mapping[str, str], int],
    tuple[Sequence[RankProcess], Callable[[], None] | None],
]


class RankGroup:
    """Rank 0 of a group: ``command`` runs a command on every rank (this one included, through
    ``local``); ``close`` stops the others and leaves the group. Use ``open`` (children started
    here) or ``attach`` (ranks started by torchrun / SLURM)."""

    def __init__(
        self,
        rendezvous: Rendezvous,
        children: Sequence[RankProcess] = (),
        release: Callable[[], None] | None = None,
    ) -> None:
        self.rendezvous = rendezvous
        self.children = list(children)
        self.release = release  # frees what placed the children (a Ray placement group)
        self.closed = False
        self.left = False

    @property
    def world_size(self) -> int:
        return self.rendezvous.world_size

    @classmethod
    def open(
        cls,
        world_size: int,
        *,
        host: str = "127.0.0.1",
        backend: str = "gloo",
        timeout_s: float = 300.0,
        env: Mapping[str, str] | None = None,
        threads: int = 1,
        spawn: SpawnRanks | None = None,
    ) -> RankGroup:
        """Start ranks 1..``world_size``-1 as child processes of this one (or with ``spawn``,
        e.g. as Ray actors in a placement group) and join them as rank 0. ``env``: extra
        environment of the others."""
        release: Callable[[], None] | None = None
        children: list[RankProcess] = []
        store = open_store(host, world_size, timeout_s)
        rdv = Rendezvous(host, int(store.port), world_size, backend, timeout_s)
        if spawn is not None and world_size > 1:
            placed, release = spawn(rdv, env or {}, threads)
            children.extend(placed)
        else:
            child_env = {**os.environ, **(env or {})}
            for rank in range(1, world_size):
                args = [sys.executable, "-m", "asyncflow_actors.roles._rank_main", rdv.host,
                        str(rdv.port), str(rank), str(world_size), backend, str(timeout_s),
                        str(threads)]  # fmt: skip
                children.append(subprocess.Popen(args, env=child_env))
        group = cls(rdv, children, release)
        try:
            rdv.join(0, store)
        except BaseException:
            group._kill()
            if release is not None:
                release()
            raise
        return group

    @classmethod
    def attach(cls, rendezvous: Rendezvous) -> RankGroup:
        """Join, through the environment, a group whose other ranks were started elsewhere
        (torchrun, SLURM; they call ``serve``)."""
        rendezvous.join_env(0)
        return cls(rendezvous)

    def command(
        self,
        header: Mapping[str, Any],
        tensors: Sequence[torch.Tensor],
        local: Callable[[], Any],
    ) -> Any:
        """Broadcast a command, then run this rank's part of it (``local``); its result.
        Raises ``RankFailed`` if a rank died or a collective timed out meanwhile."""

        def run() -> Any:
            if self.world_size > 1:
                broadcast_command(header, tensors)
            return local()

        return self.collective(run)

    def collective(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` (collectives on the group, in step with the other ranks) as ``command``
        runs its parts: a rank that died or a collective that timed out raises ``RankFailed``
        and leaves the group closed."""
        if self.closed:
            raise RankFailed("the rank group is closed")
        try:
            return fn()
        except Exception as exc:
            failure = self._failure(exc)
            self.terminate()  # no rank trains alone: this process may join a new group
            if failure is None:
                raise
            raise failure from exc

    def terminate(self) -> None:
        """Kill the other ranks and leave the process group, at once (after a failure, or a
        stop that must not wait for a command in flight: its collectives fail with them)."""
        self.closed = True
        self._kill()
        self._leave()

    def _leave(self) -> None:
        """Leave the process group, once (another group may use the process after)."""
        if self.left:
            return
        self.left = True
        if dist.is_initialized():
            dist.destroy_process_group()
        _CONTROL.clear()
        if self.release is not None:
            self.release()

    def _failure(self, exc: BaseException) -> RankFailed | None:
        """Which rank failed: a child that exited (waited for briefly: its death is what broke
        the collective), else none known for a collective's error, else None (a local error:
        the caller's to raise as it is; the group is then unusable too)."""
        self.closed = True
        deadline = time.monotonic() + (5.0 if self.children else 0.0)
        while time.monotonic() < deadline:
            for rank, child in enumerate(self.children, start=1):
                code = child.poll()
                if code is not None:
                    return RankFailed(f"rank {rank} exited with status {code}: {exc}", rank)
            if not self.children:
                break
            time.sleep(0.05)
        if isinstance(exc, dist.DistError) or "gloo" in str(exc).lower():
            return RankFailed(f"a collective failed or timed out: {exc}")
        return None

    def close(self) -> None:
        """Stop the other ranks (a stop command, then a kill past a grace) and leave the group."""
        if not self.closed and self.world_size > 1:
            try:
                broadcast_command({"op": "stop"})
            except (RuntimeError, dist.DistError):
                pass
        self.closed = True
        deadline = time.monotonic() + 10.0
        for child in self.children:
            try:
                child.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait(5.0)
        for child in self.children:  # a Ray actor lives on after its rank loop: remove it
            if not isinstance(child, subprocess.Popen):
                child.kill()
        self._leave()

    def _kill(self) -> None:
        for child in self.children:
            child.kill()
            try:
                child.wait(5.0)
            except subprocess.TimeoutExpired:
                pass

    def __enter__(self) -> RankGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None:
            self.closed = True
            self._kill()
        self.close()
