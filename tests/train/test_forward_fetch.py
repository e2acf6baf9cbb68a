"""Each of a forward station's 2 ranks fetches its own rows of a lease from the
TransferQueue: the log-probs the broadcast gives, fewer bytes a rank; a rank whose unit is
unreachable fails the forward naming the unit, before any forward, and the group goes on."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from asyncflow_actors.roles import _schema as S
from asyncflow_actors.roles._forward_ranks import ForwardGroup
from asyncflow_actors.roles._rank_fetch import rank_leases
from asyncflow_actors.roles._rank_host import encode_batch
from asyncflow_actors.transfer_queue import StorageUnavailable

from .conftest import global_batch, run_spec
from .test_rank_fetch import queue_of

SPEC = run_spec(forward_ranks=2, collective_timeout=60)
CLAIMED = [S.PROMPT_IDS, S.RESPONSE_IDS]


@pytest.fixture(scope="module")
def trigger(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """While this file exists, rank 1 cannot reach ``unit-1`` (a test hook; once)."""
    return tmp_path_factory.mktemp("hook") / "unreachable"


@pytest.fixture(scope="module")
def group(trigger: Path) -> Iterator[ForwardGroup]:
    env = {"AFA_RANK_UNREACHABLE": f"1:unit-1:{trigger}"}
    with ForwardGroup.open(SPEC, env=env) as forward:
        assert forward.rank_fetch  # child processes: they fetch their rows
        yield forward


async def leased(client: Any, group: ForwardGroup, n: int) -> tuple[Any, list[Any], float]:
    """A lease of ``n`` rows as the station takes it (no rows fetched) and their log-probs,
    each rank fetching its own."""
    batch = await client.get(S.ROLLOUT, "actor_fwd", CLAIMED, n, fetch=[])
    assert S.RESPONSE_IDS not in batch.data  # the ranks fetch those
    leases = await rank_leases(client, client.specs[S.ROLLOUT], batch)
    assert leases is not None
    try:
        rows, fetched = await trio.to_thread.run_sync(
            lambda: group.logprobs_leased(leases, range(n), pad_id=0, temperature=1.0)
        )
    except BaseException:
        await client.nack(batch)
        raise
    await client.ack(batch)
    return batch, rows, fetched


@pytest.mark.parametrize("n", [8, 3, 1])  # 1 row: rank 1 fetches none, runs a void forward
async def test_ranks_fetching_their_rows_give_the_log_probs_of_the_broadcast(
    group: ForwardGroup, n: int
) -> None:
    data = global_batch(n)
    expected = await trio.to_thread.run_sync(
        lambda: group.logprobs(data["prompt_ids"], data["response_ids"], pad_id=0, temperature=1.0)
    )
    async with queue_of(data) as client:
        _, got, fetched = await leased(client, group, n)
    assert [g.shape for g in got] == [e.shape for e in expected]
    for g, e in zip(got, expected, strict=True):
        assert float((g - e).abs().max()) <= 1e-6
    # the bytes a rank receives: its rows (a group's prompt counted with each of its rows),
    # against every row broadcast
    _, tensors = encode_batch({S.PROMPT_IDS: data["prompt_ids"],
                               S.RESPONSE_IDS: data["response_ids"]})  # fmt: skip
    broadcast = sum(int(t.nbytes) for t in tensors)
    assert 0 < fetched < broadcast
    print(f"forward_rank_bytes n={n}: {fetched:.0f} fetched, {broadcast} broadcast, "
          f"ratio {fetched / broadcast:.2f}")  # fmt: skip


async def test_a_rank_that_cannot_reach_a_unit_fails_the_forward_naming_it(
    group: ForwardGroup, trigger: Path
) -> None:
    """Rank 1 addresses ``unit-1`` where nobody listens (once): every rank returns before any
    forward, rank 0 raises ``StorageUnavailable`` naming the unit within the bound on a
    request to a unit; the lease goes back and the group forwards it the next time."""
    data = global_batch(8)
    async with queue_of(data, io_timeout=2.0) as client:
        trigger.touch()
        started = time.monotonic()
        with pytest.raises(StorageUnavailable, match="unit-1") as failure:
            await leased(client, group, 8)
        assert time.monotonic() - started < 2.0 + 3.0  # the timeout, and a command's cost
        assert failure.value.unit == "unit-1" and not trigger.exists()
        _, rows, _ = await leased(client, group, 8)  # the nacked rows, again
    assert [int(r.shape[0]) for r in rows] == [int(r.shape[0]) for r in data["response_ids"]]


def test_forward_ranks_that_may_run_on_other_hosts_keep_the_broadcast(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Ranks started by torchrun / SLURM (not children of rank 0) or by Ray get the rows
    broadcast by rank 0, said once."""
    from types import SimpleNamespace

    with caplog.at_level("INFO", logger="asyncflow_actors.roles.ranks"):
        torchrun = ForwardGroup(SimpleNamespace(world_size=2, children=[]))  # type: ignore[arg-type]
        ray = ForwardGroup(SimpleNamespace(world_size=2, children=[object()]))  # type: ignore[arg-type]
    assert not torchrun.rank_fetch and not ray.rank_fetch
    said = [r.getMessage() for r in caplog.records if "broadcasts its rows" in r.getMessage()]
    assert len(said) == 2 and "torchrun" in said[0] and "Ray" in said[1]


@pytest.mark.parametrize(("workers", "reason"), [(1, "no mesh"), (2, "share each lease")])
async def test_a_station_whose_ranks_cannot_fetch_switches_to_the_broadcast(
    workers: int, reason: str
) -> None:
    """Units no other process can address (no mesh), or a lease shared by the station's
    workers: the station fetches every column, from then on, and says why once."""
    from types import SimpleNamespace

    from asyncflow_actors.roles._forward import ActorForward

    reasons: list[str] = []
    model = SimpleNamespace(rank_fetch=True)

    def broadcast_rows(why: str) -> None:
        reasons.append(why)
        model.rank_fetch = False

    model.broadcast_rows = broadcast_rows
    station = SimpleNamespace(
        spec=SPEC, model=model, columns=CLAIMED, dp=SimpleNamespace(size=workers),
        client=SimpleNamespace(units={"unit-0": object()}),
    )  # fmt: skip
    assert await ActorForward.rank_columns(station) is None  # type: ignore[arg-type]
    assert await ActorForward.rank_columns(station) is None  # type: ignore[arg-type]
    assert len(reasons) == 1 and reason in reasons[0]
