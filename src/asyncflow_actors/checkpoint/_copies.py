"""How a sync's bytes are copied and where the work runs (inline or in a worker thread): the
leaf the bucket, transport and assembly modules share."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final, TypeVar

import torch
import trio

T = TypeVar("T")

#: CPU copies of fewer bytes go through numpy (one thread, a memcpy): torch splits copies of
#: 32 Ki elements and more across its intra-op threads, and on a busy machine each such copy then
#: waits for a thread to be scheduled: a millisecond apiece for the pieces of a small bucket.
SMALL_COPY: Final = 1 << 20


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for flat uint8 tensors of the same size (numpy when small, on CPU)."""
    if dst.numel() < SMALL_COPY and dst.device.type == "cpu" and src.device.type == "cpu":
        dst.numpy()[:] = src.numpy()
    else:
        dst.copy_(src)


# Copies and checksums of fewer bytes run inline even with ``offload``: they take well under a
# millisecond, while a hop to a worker thread and back waits for the GIL, up to a switch
# interval (5 ms) each way when a compute thread of the process holds it (a rollout generating).
INLINE_BYTES = 1 << 20


def offloads(offload: bool, nbytes: int) -> bool:
    """Whether work on ``nbytes`` goes to a worker thread (``offload`` and not small)."""
    return offload and nbytes >= INLINE_BYTES


async def run_sync(
    offload: bool, fn: Callable[..., T], *args: Any, limiter: trio.CapacityLimiter | None = None
) -> T:
    """Run ``fn(*args)`` in a worker thread (``offload``) or inline; a checkpoint either way."""
    if offload:
        return await trio.to_thread.run_sync(fn, *args, limiter=limiter)
    await trio.lowlevel.checkpoint()
    return fn(*args)
