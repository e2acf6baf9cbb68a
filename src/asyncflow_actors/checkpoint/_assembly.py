"""Tensors whose pieces arrived in several buckets, put together after the commit.

A sync from a sharded trainer (``plan_segments``: each rank sends its rows of every tensor)
hands a receiver each tensor in N pieces, one a sender's bucket. A whole tensor lying in one
received bucket is viewed in place; a split one needs one allocation of its own and a copy of
each piece into it. ``HostCache`` checksums every bucket on arrival (the receiver's vote needs
nothing more) and, for buckets it owns, leaves that copy to an ``Assembly``: the receiver runs
it in a worker thread once the sender has committed, while its host goes on running, and its
``apply_pending()`` waits for it before loading. The copy is then off the sync's critical
path (the sender and every paused target wait for the vote, not for the copy), and a dropped
sync never pays it. Each piece is copied once, from the frame it arrived in straight into its
place in the tensor the target is given.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

import attrs
import trio

from ._copies import copy_bytes, offloads, run_sync
from ._manifest import TensorSpec, dtype_of

if TYPE_CHECKING:
    import torch


@attrs.define(eq=False)
class Part:
    """One split tensor: its spec, the memory some of its pieces were copied into already
    (``dest``, or None), and the pieces still to copy: ``(bytes, offset in the tensor)``."""

    spec: TensorSpec
    dest: torch.Tensor | None
    copies: list[tuple[torch.Tensor, int]]


class Assembly:
    """The copies that put a sync's split tensors together (module docstring).

    Synchronous; ``run`` is meant for a worker thread. It keeps the received buckets alive
    until it has run, then drops them."""

    def __init__(self, parts: Sequence[Part]) -> None:
        self.parts = list(parts)
        self.names = {part.spec.name for part in self.parts}  # those still wanted
        self.nbytes = sum(part.spec.nbytes for part in self.parts if part.copies)

    def discard(self, names: Collection[str]) -> None:
        """Skip ``names`` (a newer sync brought them); their pieces are never copied."""
        self.names.difference_update(names)
        self.parts = [part for part in self.parts if part.spec.name in self.names]

    def run(self) -> dict[str, torch.Tensor]:
        """Copy every piece into its tensor; the tensors by name (manifest order)."""
        import torch

        out: dict[str, torch.Tensor] = {}
        parts, self.parts = self.parts, []
        for part in parts:
            spec, dest = part.spec, part.dest
            if dest is None:
                dest = torch.empty(spec.nbytes, dtype=torch.uint8)
            for data, offset in part.copies:
                copy_bytes(dest[offset : offset + data.numel()], data)
            out[spec.name] = dest.view(dtype_of(spec.dtype)).reshape(spec.shape)
        return out


@attrs.define(eq=False)
class Assembling:
    """An ``Assembly`` a receiver runs (``start``) and waits for (``result``), once."""

    assembly: Assembly
    offload: bool
    started: bool = False
    done: trio.Event = attrs.Factory(trio.Event)
    tensors: dict[str, torch.Tensor] | None = None
    error: BaseException | None = None

    async def start(self) -> None:
        """Run the assembly (in a worker thread with ``offload``); a second call returns at
        once. Errors are kept for ``result``. Shielded: a bounded copy, and its waiters must
        never wait for one abandoned halfway."""
        if self.started:
            await trio.lowlevel.checkpoint()
            return
        self.started = True
        try:
            offload = offloads(self.offload, self.assembly.nbytes)
            with trio.CancelScope(shield=True):
                self.tensors = await run_sync(offload, self.assembly.run)
        except Exception as exc:
            self.error = exc
        finally:
            self.done.set()

    async def result(self) -> dict[str, torch.Tensor]:
        """The assembled tensors still wanted (runs the assembly here if nobody started it);
        raises what it raised."""
        if not self.started:
            await self.start()
        await self.done.wait()
        if self.error is not None:
            raise self.error
        assert self.tensors is not None
        wanted = self.assembly.names
        return {name: t for name, t in self.tensors.items() if name in wanted}
