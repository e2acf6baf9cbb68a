"""Each rank of a trainer fetches its own rows of a step's leases from the TransferQueue.

Rank 0 (the Trainer) claims the lease(s) of a step as before but fetches only the small
columns it needs itself (``SMALL``: token versions, rewards, the prompts' group-shared
columns...): it checks staleness, estimates the advantages when the trainer does, and sends the
``step_rows`` command: the rows' sizes and response lengths, the leases as plain data
(``LeaseView``s: placement, incarnations, located parts; the units' addresses as the wire codec
names refs, no pickle) and, when rank 0 estimated them, the advantages. Every rank then draws
the step's updates (``RankLearner.plan``: the same on every rank), fetches the rows its passes
read (``needed``) with ``fetch_rows`` (located parts mapped, the unit asked otherwise, each
request bounded as the client bounds its requests to units: the queue's ``io_timeout``), and
all ranks all-reduce a status: 0, or 1 + the number of a unit that failed. If one did, every
rank returns before any forward (no rank is left in a collective, the group stays usable) and
rank 0 raises ``StorageUnavailable`` naming the unit (the Trainer nacks the leases and fetches
again). Else the ranks train on their
rows with the global normaliser, as with the broadcast, and rank 0 acks the leases.

A rank > 0 reaches the units from its own actor system (``_rank_mesh``; under CURVE with its
trainer node's key, ``_rank_keys``); rank 0 from the Trainer's event loop, with the Trainer's
client. Where the ranks cannot reach the units (ranks started by Ray or torchrun: maybe on
other hosts; units of a system without a mesh), rank 0 fetches every column and broadcasts the
rows, as before (``plain_reason`` says why; logged once).
"""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch
import torch.distributed as dist
import trio
from torch import Tensor

from ..transfer_queue import StorageUnavailable
from ..transfer_queue._unit_messages import ShmBody
from ..transfer_queue.client import LeaseView, UnitIO, fetch_rows
from . import _schema as S
from ._compute import MiniBatches, PaddedRows

log = logging.getLogger("asyncflow_actors.roles.ranks")

RANK_FETCH = "_rank_fetch"  # the key of a step's ``RankLeases`` in the Trainer's data
# what rank 0 fetches of each row itself (the ranks fetch the rest)
SMALL = (S.PROMPT_IDS, S.PROMPT_KEY, S.TOKEN_VERSIONS, S.REWARDS, S.REWARD_PARTS, S.RESUMES)


async def rank_columns(
    client: Any, learner: Any, columns: Sequence[str], *, text: bool
) -> list[str] | None:
    """The columns of ``columns`` rank 0 fetches itself (``text``: the responses too, to show
    some), or None (all) when the ranks cannot reach the queue's units (then never again:
    ``learner.broadcast_rows``)."""
    if await _addresses(client) is None:
        learner.broadcast_rows("the queue's units cannot be reached from another process (no mesh)")
        return None
    return [c for c in columns if c in SMALL or (text and c == S.RESPONSE_IDS)]


async def _addresses(client: Any) -> dict[str, list[Any]] | None:
    """The queue's units' addresses as the ranks resolve them (None: unreachable from them)."""
    from ._rank_send import addresses_of

    names = sorted(client.units)
    addresses = await addresses_of([client.units[u] for u in names])
    return None if addresses is None else dict(zip(names, addresses, strict=True))


# -- the leases as plain data -------------------------------------------------------------------


def _body(body: ShmBody) -> list[Any]:
    return [body.offset, body.dtype, list(body.shape), body.segment]


def _located_to_wire(located: Mapping[str, Mapping[str, list[Any]]]) -> dict[str, Any]:
    return {
        unit: {
            column: [
                ["r", [_body(b) for b in part]] if isinstance(part, list) else ["b", _body(part)]
                for part in parts
            ]
            for column, parts in columns.items()
        }
        for unit, columns in located.items()
    }


def _located_from_wire(data: Mapping[str, Any]) -> dict[str, dict[str, list[Any]]]:
    def body(b: list[Any]) -> ShmBody:
        return ShmBody(b[0], b[1], tuple(b[2]), b[3])

    return {
        unit: {
            column: [
                [body(b) for b in value] if kind == "r" else body(value) for kind, value in parts
            ]
            for column, parts in columns.items()
        }
        for unit, columns in data.items()
    }


def view_to_wire(batch: Any) -> dict[str, Any]:
    """A TQ ``Batch``'s lease as plain data (its rows are fetched elsewhere)."""
    lease = batch.lease
    return {
        "topic": lease.topic, "indexes": list(lease.indexes), "group_ids": list(lease.group_ids),
        "placement": {u: list(ix) for u, ix in lease.placement.items()},
        "shared": {u: list(g) for u, g in lease.shared.items()},
        "incarnations": dict(batch.incarnations), "located": _located_to_wire(batch.located),
    }  # fmt: skip


def view_from_wire(data: Mapping[str, Any]) -> LeaseView:
    return LeaseView(
        data["topic"], tuple(data["indexes"]), tuple(data["group_ids"]),
        data["placement"], data["shared"], data["incarnations"],
        _located_from_wire(data["located"]),
    )  # fmt: skip


FetchViews = Callable[[Sequence[LeaseView], Sequence[int], Sequence[str], Sequence[str]], Any]


@attrs.frozen
class RankLeases:
    """A step's leases as the ranks fetch their rows: ``wire`` (the leases, the units'
    addresses, the client's settings: plain data for the ``step_rows`` command), and rank 0's
    way to its rows (``fetch_views``: ``fetch_step`` on the Trainer's loop) and to tell the
    controller that a unit failed (``on_failure``); both called from a compute thread."""

    wire: dict[str, Any]
    fetch_views: FetchViews
    on_failure: Callable[[], None]

    def fetch(
        self, positions: Sequence[int], columns: Sequence[str], shared: Sequence[str]
    ) -> dict[str, Any]:
        """Rank 0's rows (``fetch_step``), from a compute thread."""
        views = [view_from_wire(lease) for lease in self.wire["leases"]]
        rows: dict[str, Any] = self.fetch_views(views, positions, columns, shared)
        return rows

    @staticmethod
    def join(pieces: Sequence[RankLeases]) -> RankLeases:
        """The leases of a streamed step's pieces as one (their rows one after the other)."""
        wire = dict(pieces[0].wire)
        wire["leases"] = [lease for p in pieces for lease in p.wire["leases"]]
        return RankLeases(wire, pieces[0].fetch_views, pieces[0].on_failure)


async def rank_leases(client: Any, topic: Any, batch: Any) -> RankLeases | None:
    """``batch``'s lease as the ranks fetch it (on the Trainer's loop, with its ``client``;
    ``topic``: the rollout topic's spec); None if the ranks cannot reach the queue's units (no
    mesh)."""
    addresses = await _addresses(client)
    if addresses is None:
        return None
    wire = {
        "units": addresses,
        "shm_min_bytes": client.io.shm_min_bytes, "timeout": client.io.timeout,
        "leases": [view_to_wire(batch)],
    }  # fmt: skip
    token = trio.lowlevel.current_trio_token()

    def fetch_views(
        views: Sequence[LeaseView], positions: Sequence[int], columns: Sequence[str],
        shared: Sequence[str],
    ) -> Any:  # fmt: skip
        return trio.from_thread.run(
            fetch_step, client.io, topic, views, positions, columns, shared, trio_token=token
        )

    def on_failure() -> None:
        trio.from_thread.run_sync(client.io.on_failure, trio_token=token)

    return RankLeases(wire, fetch_views, on_failure)


async def leased_data(
    client: Any, batch: Any, data: dict[str, Any], columns: Sequence[str], learner: Any
) -> None:
    """Rank 0, after fetching ``batch``'s small columns into ``data``: the lease for the ranks
    (``data[RANK_FETCH]``), or, where they cannot reach the units, the rest of ``columns``
    fetched here (the rows are then broadcast, from now on: ``learner.broadcast_rows``)."""
    topic = client.specs[batch.lease.topic]
    leases = await rank_leases(client, topic, batch)
    if leases is not None:
        data[RANK_FETCH] = leases
        return
    learner.broadcast_rows("the queue's units became unreachable from the ranks")
    rest = [c for c in columns if c not in data]
    per_sample = [c for c in rest if not topic.columns[c].shared]
    shared = [c for c in rest if topic.columns[c].shared]
    view = view_from_wire(view_to_wire(batch))
    rows = await fetch_step(client.io, topic, [view], range(len(batch)), per_sample, shared)
    data.update(rows)


async def fetch_step(
    io: UnitIO,
    topic: Any,
    views: Sequence[LeaseView],
    positions: Sequence[int],
    columns: Sequence[str],
    shared_columns: Sequence[str],
) -> dict[str, list[Any]]:
    """The rows at ``positions`` (ascending places in the step's leases, one after the other)
    of ``columns``, a list of rows each, and the ``shared_columns`` expanded per row."""
    out: dict[str, list[Any]] = {c: [] for c in (*columns, *shared_columns)}
    start = 0
    for view in views:
        n = len(view.indexes)
        mine = [p - start for p in positions if start <= p < start + n]
        start += n
        if not mine:
            continue
        data, shared = await fetch_rows(io, topic, view, mine, columns, shared_columns)
        for c in columns:
            value = data[c]
            out[c] += list(value.unbind(0)) if isinstance(value, Tensor) else list(value)
        for c in shared_columns:
            out[c] += [shared[c][view.group_ids[p]] for p in mine]
    return out


# -- a rank's side of ``step_rows`` -------------------------------------------------------------


def plain_reason(group: Any) -> str | None:
    """Why the ranks of ``group`` (a ``RankGroup``) cannot fetch their rows (None: they can):
    ranks that are not this process's children may run on other hosts."""
    if group.world_size > 1 and len(group.children) != group.world_size - 1:
        return "its ranks were started elsewhere (torchrun, SLURM) and may run on other hosts"
    if any(not isinstance(child, subprocess.Popen) for child in group.children):
        return "its ranks are Ray actors and may run on other hosts"
    return None


class RowSource:
    """Whether each rank of a group fetches its own rows or rank 0 broadcasts them: the
    broadcast from the start where ``plain_reason`` says so (or ``plain``, not logged), and
    for good once ``broadcast`` is called (its reason logged once, ``what`` naming the role)."""

    def __init__(self, group: Any, what: str, plain: str | None = None) -> None:
        self.what = what
        self.plain = plain  # why rank 0 broadcasts the rows (None: the ranks fetch)
        reason = plain_reason(group)
        if reason is not None:
            self.broadcast(reason)

    @property
    def ranks_fetch(self) -> bool:
        return self.plain is None

    def broadcast(self, reason: str) -> None:
        """From now on rank 0 fetches every row and broadcasts them (``reason``: logged)."""
        if self.plain is None:
            self.plain = reason
            log.info("%s and broadcasts its rows: %s", self.what, reason)


def encode_advantages(advantages: Any) -> tuple[str, list[Tensor]]:
    """Rank 0's advantages for the ``step_rows`` command: one value a row where each row's
    are all equal (an outcome advantage), else the padded rows."""
    if advantages is None:
        return "fetch", []
    values, lengths = advantages.values, advantages.lengths
    first = values[:, :1]
    mask = torch.arange(values.shape[1]) < lengths.unsqueeze(1)
    if bool(((values == first) | ~mask).all()):
        return "scalar", [first.reshape(-1).contiguous()]
    return "rows", [values, lengths]


def _advantage_rows(mode: str, tensors: Sequence[Tensor], positions: Sequence[int],
                    lengths: Sequence[int]) -> list[Tensor]:  # fmt: skip
    if mode == "scalar":
        (scalars,) = tensors
        return [torch.full((int(lengths[p]),), float(scalars[p])) for p in positions]
    values, widths = tensors
    return [values[p, : int(widths[p])].clone() for p in positions]


def columns_of(learner: Any, mode: str) -> tuple[list[str], list[str]]:
    """The per-sample and group-shared columns a rank fetches for ``learner``'s step."""
    names = [S.RESPONSE_IDS, *learner.loss_columns(learner.spec.trainer_forward)]
    if mode != "fetch":
        names.remove(S.ADVANTAGES)
    return names, [S.PROMPT_IDS]


def step_rows(
    learner: Any,
    header: Mapping[str, Any],
    tensors: Sequence[Tensor],
    fetch: Callable[[Sequence[int], Sequence[str], Sequence[str]], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """This rank's part of ``step_rows`` (module docstring): its metrics (with
    ``rows_fetched``, its rows, and ``fetched_bytes``, the most bytes of rows a rank fetched,
    a group's prompt counted with each of its rows),
    or ``{"failed": unit, "rank": r}`` on every rank when rank ``r`` could not fetch its rows.
    ``fetch``: rank 0's way to its rows; a rank > 0 fetches from its own actor system."""
    from ._rank_learner import needed, rank, world
    from ._ranks import control_group

    sizes = torch.tensor(header["sizes"], dtype=torch.long)
    lengths = torch.tensor(header["lengths"], dtype=torch.long)
    updates = learner.plan(sizes, lengths)
    me = rank()
    positions = needed(updates, me)
    mode = header["advantages"]
    columns, shared = columns_of(learner, mode)
    units = sorted(header["units"])
    size = world()
    status = torch.zeros(2 * size, dtype=torch.int64)  # each rank's status, then its bytes
    data: dict[str, Any] = {}
    try:
        if fetch is not None:
            data = fetch(positions, columns, shared)
        else:
            data = _fetch_here(learner, header, positions, columns, shared)
        status[size + me] = sum(int(t.nbytes) for rows in data.values() for t in rows)
    except StorageUnavailable as exc:
        log.warning("rank %d: fetching its rows failed: %s", me, exc)
        status[me] = 1 + (units.index(exc.unit) if exc.unit in units else len(units))
    if size > 1:
        dist.all_reduce(status, group=control_group())
    codes = status[:size].tolist()
    failed = [(r, code - 1) for r, code in enumerate(codes) if code]
    if failed:
        r, code = failed[0]
        return {"failed": units[code] if code < len(units) else "?", "rank": r}
    if mode != "fetch":
        data[S.ADVANTAGES] = _advantage_rows(mode, tensors, positions, header["lengths"])
    rows = MiniBatches(
        data, learner.loss_columns(learner.spec.trainer_forward), learner.tokenizer.pad_id
    )
    local = torch.full((len(sizes),), -1, dtype=torch.long)
    local[torch.tensor(positions, dtype=torch.long)] = torch.arange(len(positions))
    metrics: dict[str, Any] = learner.train(rows, updates, local)
    metrics["rows_fetched"] = float(len(positions))
    metrics["fetched_bytes"] = float(max(status[size:].tolist()))  # the most a rank fetched
    return metrics


def _fetch_here(
    learner: Any,
    header: Mapping[str, Any],
    positions: Sequence[int],
    columns: Sequence[str],
    shared: Sequence[str],
) -> dict[str, Any]:
    """A rank > 0's rows, fetched from its own actor system (``_rank_mesh``)."""
    from ._rank_learner import rank
    from ._rank_mesh import rank_mesh

    mesh = rank_mesh(rank())
    topic = S.topic_specs(learner.spec)[1]
    views = [view_from_wire(lease) for lease in header["leases"]]
    result: dict[str, Any] = mesh.run(
        _fetch_from, mesh, header, topic, views, positions, columns, shared
    )
    return result


async def _fetch_from(
    mesh: Any,
    header: Mapping[str, Any],
    topic: Any,
    views: Sequence[LeaseView],
    positions: Sequence[int],
    columns: Sequence[str],
    shared: Sequence[str],
) -> dict[str, Any]:
    from ..actors.remote import mesh_of
    from ._rank_keys import resolve_entry

    own = mesh_of(mesh.system)
    refs = {name: resolve_entry(own, entry) for name, entry in header["units"].items()}
    _unreachable(refs, own.resolve)
    io = UnitIO(refs, shm_min_bytes=header["shm_min_bytes"], timeout=header["timeout"],
                on_failure=lambda: None)  # fmt: skip
    return await fetch_step(io, topic, views, positions, columns, shared)


def _unreachable(refs: dict[str, Any], resolve: Any) -> None:  # pragma: no cover - a test hook
    """``AFA_RANK_UNREACHABLE=<rank>:<unit>:<file>``: while ``file`` exists, that rank
    addresses the unit at ``AFA_RANK_UNREACHABLE_AT`` (default an endpoint nobody listens on:
    its requests time out; empty: nowhere, they fail at once), once: it removes the file."""
    import os

    from ..actors.remote import ActorAddress

    me, _, rest = os.environ.get("AFA_RANK_UNREACHABLE", "").partition(":")
    unit, _, path = rest.partition(":")
    if me != str(dist.get_rank()) or unit not in refs or not os.path.exists(path):
        return
    os.unlink(path)
    at = os.environ.get("AFA_RANK_UNREACHABLE_AT", "tcp://127.0.0.1:9")
    refs[unit] = resolve(ActorAddress("afa-nobody", "nobody", (at,) if at else (), 1))


def step_data(data: Mapping[str, Any]) -> tuple[dict[str, Any], list[Tensor]]:
    """Rank 0: the ``step_rows`` header and tensors of the Trainer's ``data`` (its small
    columns, the advantages it estimated, the step's ``RankLeases``)."""
    leases: RankLeases = data[RANK_FETCH]
    prompts = [int(p.shape[0]) for p in data[S.PROMPT_IDS]]
    responses = [int(t.shape[0]) for t in data[S.TOKEN_VERSIONS]]
    advantages = data.get(S.ADVANTAGES)
    if advantages is not None and not isinstance(advantages, PaddedRows):
        raise TypeError("rank 0's advantages: expected PaddedRows (Advantages.estimate padded)")
    mode, tensors = encode_advantages(advantages)
    header = {
        "op": "step_rows", **leases.wire, "advantages": mode,
        "sizes": [p + r for p, r in zip(prompts, responses, strict=True)], "lengths": responses,
    }  # fmt: skip
    return header, tensors
