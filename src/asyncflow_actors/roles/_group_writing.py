"""Writing the rollout's scored groups, and what a refused write means.

Each group is written once, into the group the Driver opened for its prompt. The groups scored
together reach one writer call (``_Batcher``), which puts the groups of one version in one
multi-group put (three queue requests instead of three per group).

A put that meets a storage unit's death (``StorageUnavailable`` not caused by its samples
leaving the queue) stored nothing: it is put again (``ask_again``), as the Driver puts its prompts
again, until the controller knows of the loss; one such error crashed the rollout worker (the
soak's unit kills; its supervisor restarted it and the groups it held were generated again).

A put can be refused for reasons that are not errors of the run (``_put_outcome``): the
group's oldest token fell out of the staleness window (*stale*: generate it again with the
current weights), or the group is no longer in the queue or already full (*gone*: its storage
unit was lost, it was evicted, or a crashed predecessor wrote it; the Driver re-injects the
prompt of a group that vanished).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Literal

import attrs
import outcome
import trio

from ..transfer_queue import (
    GroupError,
    StaleVersionError,
    StorageUnavailable,
    TransferQueueClient,
    UnknownGroup,
    UnknownSample,
)
from . import _schema as S
from ._ask_again import ask_again, tell_driver
from ._messages import GroupDropped

log = logging.getLogger("asyncflow_actors.roles")
TELL_TIMEOUT_S = 10.0


@attrs.frozen
class _ToWrite:
    """A generated, scored group: its rows and the version of its oldest token."""

    gid: int
    data: dict[str, Any]
    version: int


async def write_groups(
    client: TransferQueueClient, groups: list[_ToWrite]
) -> list[outcome.Outcome[tuple[int, ...]]]:
    """Write the groups scored together: those of one version in one multi-group put (one
    allocation, one store per unit, one commit), concurrently with the other versions'.

    Each outcome is its group's own: stale, gone or written. A multi-group put is all or
    nothing; when it is refused for one group (stale, evicted, full) nothing changed, and
    the groups are put one by one so that each learns its own fate. Any other failure
    (a unit or the controller lost after the allocation) is every group's, as it would
    have been for one put each."""
    results: list[outcome.Outcome[tuple[int, ...]]] = [outcome.Value(())] * len(groups)
    by_version: dict[int, list[int]] = {}
    for k, group in enumerate(groups):
        by_version.setdefault(group.version, []).append(k)

    async def one(k: int) -> None:
        group = groups[k]
        try:
            indexes = await ask_again(
                lambda: client.put(S.ROLLOUT, group.data, version=group.version, group=group.gid),
                f"put of group {group.gid}",
                transient=_unit_lost,
            )
        except Exception as exc:  # this group's own: stale, gone or a real error
            results[k] = outcome.Error(exc)
        else:
            results[k] = outcome.Value(indexes)

    async def together(version: int, ks: list[int]) -> None:
        if len(ks) == 1:
            await one(ks[0])
            return
        data = _concat_rows([groups[k].data for k in ks])
        gids = [groups[k].gid for k in ks for _ in range(_rows(groups[k].data))]
        try:
            indexes = await ask_again(
                lambda: client.put(S.ROLLOUT, data, version=version, group=gids),
                f"put of {len(ks)} groups",
                transient=_unit_lost,
            )
        except Exception as exc:
            if _put_outcome(exc) is None:
                for k in ks:
                    results[k] = outcome.Error(exc)
                return
            # refused for one group (its error names it): the others are intact
            async with trio.open_nursery() as nursery:
                for k in ks:
                    nursery.start_soon(one, k)
            return
        at = 0
        for k in ks:
            n = _rows(groups[k].data)
            results[k] = outcome.Value(tuple(indexes[at : at + n]))
            at += n

    async with trio.open_nursery() as nursery:
        for version, ks in by_version.items():
            nursery.start_soon(together, version, ks)
    return results


def _rows(data: Mapping[str, Any]) -> int:
    return len(data[S.REWARDS])


def _concat_rows(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The rows of several groups' columns, in order: lists are joined, tensors concatenated."""
    import torch

    out: dict[str, Any] = {}
    for name, first in parts[0].items():
        if isinstance(first, list):
            out[name] = [row for part in parts for row in part[name]]
        else:
            out[name] = torch.cat([part[name] for part in parts])
    return out


def _put_outcome(exc: BaseException) -> Literal["stale", "gone"] | None:
    """What a failed group put means: ``"stale"`` (its oldest token left the window before it
    was allocated: generate it again), ``"gone"`` (the group was evicted or lost meanwhile —
    a version bump can evict a put between its allocation and its commit —: the Driver
    re-injects its prompt; or it is full: a crashed predecessor wrote it before its ack), or
    ``None`` (a real error). The errors are told apart by type, possibly in exception groups:
    the TQ's errors cross the wire as their own types."""
    leaves = _leaves(exc)
    if all(isinstance(e, StaleVersionError) for e in leaves):
        return "stale"
    # GroupError: a restarted worker writing a group its predecessor wrote
    if all(isinstance(e, (StaleVersionError, GroupError)) or _unknown(e) for e in leaves):
        return "gone"
    return None


def _unit_lost(exc: BaseException) -> bool:
    """Whether a put failed on a storage unit's death and stored nothing (put it again), as
    opposed to its samples having left the queue (``_unknown``: the group is gone)."""
    return isinstance(exc, StorageUnavailable) and not _unknown(exc)


def _vanished(exc: BaseException) -> bool:
    """Whether a ``"gone"`` put found its group no longer in the queue (rather than full:
    written by a crashed predecessor, and trained or about to be)."""
    return any(_unknown(e) for e in _leaves(exc))


def _unknown(exc: BaseException) -> bool:
    """Whether ``exc`` says the group or its samples are no longer in the queue."""
    if isinstance(exc, StorageUnavailable):
        # the client's word for a put whose samples were evicted or lost before it committed:
        # the queue reports them as events, as for a put the controller refused
        return isinstance(exc.__cause__, UnknownSample)
    return isinstance(exc, (UnknownGroup, UnknownSample))


def _leaves(exc: BaseException) -> list[BaseException]:
    inner = getattr(exc, "exceptions", None)
    if not isinstance(inner, tuple):
        return [exc]
    return [leaf for e in inner for leaf in _leaves(e)]


async def drop_group(
    client: TransferQueueClient,
    driver: Any,
    gid: int,
    worker: str,
    reason: str,
    *,
    fatal: bool,
    size: int,
) -> None:
    """A group whose reward failed is not written: shrink it to nothing (its slots in the
    queue are freed) and tell the Driver (``GroupDropped``), which admits another prompt in
    its place, or fails the run when ``fatal``."""
    try:
        await client.shrink_group(S.ROLLOUT, gid, size)
    except Exception as exc:  # gone already (evicted, lost): nothing to free
        log.info("%s: shrinking dropped group %d: %r", worker, gid, exc)
    if driver is None:
        return
    try:
        with trio.fail_after(TELL_TIMEOUT_S):
            await tell_driver(driver, GroupDropped(gid, worker, reason, fatal))
    except Exception as exc:
        log.warning("%s: reporting dropped group %d failed: %r", worker, gid, exc)
