"""Each rank of a forward station (``train.forward_ranks`` > 1) fetches its own rows of a
batch's lease from the TransferQueue, as a trainer's ranks do (``_rank_fetch``).

The station (rank 0) claims the lease but fetches only the columns it reads itself (the
rewards of a fused advantage), not the prompts and responses, and sends ``forward_rows``: the
lease as plain data (``LeaseView``, the units' addresses, the client's io timeout) and the
station's rows of it. Every rank takes every ``size``-th of those rows (a padded forward costs
rows x longest: equal counts balance it without knowing the lengths first), fetches them
(``fetch_step``: located parts mapped, the unit asked otherwise, each request bounded by the
io timeout), and one all-reduce carries every rank's status, its bytes and its rows' lengths.
If a rank could not fetch, every rank returns before any forward and the station raises
``StorageUnavailable`` naming the unit (nothing written; it nacks the lease, which goes out
again). Else each rank forwards its rows and the log-probs are gathered to rank 0, which
writes them as before.

Where the ranks cannot reach the units (ranks started by Ray or torchrun, units of a system
without a mesh; under CURVE they can: ``_rank_keys``) or the lease is shared with other workers
of the station, rank 0 fetches the rows and broadcasts them, as before (logged once).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..transfer_queue import StorageUnavailable
from . import _schema as S
from ._rank_fetch import RankLeases, _fetch_from, fetch_step, view_from_wire, view_to_wire
from ._rank_forward import RankForward
from ._rank_learner import rank, world
from ._ranks import control_group

log = logging.getLogger("asyncflow_actors.roles.ranks")

ROWS = (S.PROMPT_IDS, S.RESPONSE_IDS)  # what the ranks fetch (the station: the rest)

Fetch = Callable[[Sequence[int], Sequence[str], Sequence[str]], dict[str, Any]]


def header_of(
    leases: RankLeases, positions: Sequence[int], *, pad_id: int, temperature: float
) -> dict[str, Any]:
    """The ``forward_rows`` command for the station's rows ``positions`` of the lease."""
    return {
        "op": "forward_rows", **leases.wire, "positions": [int(p) for p in positions],
        "pad_id": pad_id, "temperature": temperature,
    }  # fmt: skip


def forward_rows(
    forward: RankForward, header: Mapping[str, Any], fetch: Fetch | None
) -> dict[str, Any]:
    """This rank's part of ``forward_rows`` (module docstring): on rank 0 ``{"rows": the
    log-probs in the order of the positions, "fetched_bytes": the most bytes a rank fetched}``,
    or ``{"failed": unit, "rank": r}`` on every rank when rank ``r`` could not fetch.
    ``fetch``: rank 0's way to its rows; a rank > 0 fetches from its own actor system."""
    size, me = world(), rank()
    positions = header["positions"]
    n = len(positions)
    order = sorted(range(n), key=positions.__getitem__)  # fetch_step reads ascending places
    parts = [order[r::size] for r in range(size)]
    mine = [positions[k] for k in parts[me]]
    units = sorted(header["units"])
    status = torch.zeros(2 * size + n, dtype=torch.int64)  # statuses, bytes, every row's length
    data: dict[str, Any] = {S.PROMPT_IDS: [], S.RESPONSE_IDS: []}
    try:
        if fetch is not None:
            data = fetch(mine, [S.RESPONSE_IDS], [S.PROMPT_IDS])
        elif mine:
            data = _fetch_here(forward, header, mine)
        status[size + me] = sum(int(t.nbytes) for rows in data.values() for t in rows)
        for k, row in zip(parts[me], data[S.RESPONSE_IDS], strict=True):
            status[2 * size + k] = int(row.shape[0])
    except StorageUnavailable as exc:
        log.warning("forward rank %d: fetching its rows failed: %s", me, exc)
        status[me] = 1 + (units.index(exc.unit) if exc.unit in units else len(units))
    if size > 1:
        dist.all_reduce(status, group=control_group())
    failed = [(r, code - 1) for r, code in enumerate(status[:size].tolist()) if code]
    if failed:
        r, code = failed[0]
        return {"failed": units[code] if code < len(units) else "?", "rank": r}
    lengths = status[2 * size :].tolist()
    rows = forward.part_logprobs(
        parts, lengths, data[S.PROMPT_IDS], data[S.RESPONSE_IDS],
        pad_id=header["pad_id"], temperature=header["temperature"],
    )  # fmt: skip
    return {"rows": rows, "fetched_bytes": float(max(status[size : 2 * size].tolist()))}


def _fetch_here(
    forward: RankForward, header: Mapping[str, Any], positions: Sequence[int]
) -> dict[str, Any]:
    """A rank > 0's rows, fetched from its own actor system (``_rank_mesh``)."""
    from ._rank_mesh import rank_mesh

    mesh = rank_mesh(rank())
    topic = S.topic_specs(forward.spec)[1]
    views = [view_from_wire(lease) for lease in header["leases"]]
    result: dict[str, Any] = mesh.run(
        _fetch_from, mesh, header, topic, views, positions, [S.RESPONSE_IDS], [S.PROMPT_IDS]
    )
    return result


def failure(result: Mapping[str, Any]) -> StorageUnavailable:
    """The station's error for a ``forward_rows`` a rank could not fetch, naming the unit."""
    error = StorageUnavailable(
        f"storage unit {result['failed']!r}: forward rank {result['rank']} could not fetch "
        "its rows (its log says why)"
    )
    error.unit = result["failed"]
    return error


async def leased_rows(
    client: Any, topic: Any, batch: Any, rows: Sequence[int], columns: Sequence[str]
) -> tuple[list[Tensor], list[Tensor]]:
    """Rank 0's fallback: the prompts and responses of ``batch``'s ``rows`` it did not fetch
    with the lease (the ranks became unable to), fetched here, in the order of ``rows``."""
    order = sorted(range(len(rows)), key=rows.__getitem__)
    view = view_from_wire(view_to_wire(batch))
    data = await fetch_step(
        client.io, topic, [view], [rows[k] for k in order], [S.RESPONSE_IDS], [S.PROMPT_IDS]
    )
    prompts: list[Tensor] = [torch.empty(0)] * len(rows)
    responses: list[Tensor] = [torch.empty(0)] * len(rows)
    for i, k in enumerate(order):
        prompts[k] = data[S.PROMPT_IDS][i]
        responses[k] = data[S.RESPONSE_IDS][i]
    return prompts, responses
