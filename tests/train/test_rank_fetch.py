"""Each of 2 trainer ranks fetches its own rows of a step's lease from the TransferQueue: the
same update as rank 0 broadcasting every row (every aggregation mode, mini-batches, the
advantages fetched or estimated by rank 0); a rank whose unit is unreachable fails the step
naming the unit, within the bound on a request to a unit (``io_timeout``), and the group
trains on."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

import asyncflow_actors as afa
from asyncflow_actors.rl import AGG_MODES
from asyncflow_actors.roles import _schema as S
from asyncflow_actors.roles._compute import PaddedRows, pad_rows
from asyncflow_actors.roles._distributed import DistributedLearner
from asyncflow_actors.roles._rank_fetch import RANK_FETCH, rank_leases
from asyncflow_actors.roles._rank_settings import ParallelSettings
from asyncflow_actors.transfer_queue import (
    StorageUnavailable,
    TransferQueueConfig,
    open_transfer_queue,
)

from .conftest import global_batch, run_spec

TWO = ParallelSettings(ranks=2)
CLAIMED = [S.PROMPT_IDS, S.RESPONSE_IDS, S.BEHAVIOUR, S.TOKEN_VERSIONS, S.OLD, S.ADVANTAGES]


@pytest.fixture(scope="module")
def trigger(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """While this file exists, rank 1 cannot reach ``unit-1`` (a test hook; once)."""
    return tmp_path_factory.mktemp("hook") / "unreachable"


@pytest.fixture(scope="module")
def ranks(trigger: Path) -> Iterator[DistributedLearner]:
    env = {"AFA_RANK_UNREACHABLE": f"1:unit-1:{trigger}"}
    with DistributedLearner.open(run_spec(), TWO, env=env) as learner:
        yield learner


@asynccontextmanager
async def queue_of(
    data: dict[str, Any], io_timeout: float = 60.0, system: Any = None, **extra: Any
) -> AsyncIterator[Any]:
    """A queue (2 units in this process: on ``system``, else a system of its own; ``extra``:
    more of its config) holding ``data``'s rows, one group a row; ``io_timeout``: the bound on
    each request of a client to a unit."""
    spec = run_spec()
    config = TransferQueueConfig(topics=(S.topic_specs(spec)[1],), io_timeout=io_timeout, **extra)
    async with AsyncExitStack() as stack:
        if system is None:
            system = await stack.enter_async_context(afa.open_actor_system())
        tq = await stack.enter_async_context(open_transfer_queue(system, config))
        client = await tq.client()
        n = len(data["response_ids"])
        slots = await client.open_groups(
            S.ROLLOUT, [1] * n, [{S.PROMPT_IDS: p} for p in data["prompt_ids"]]
        )
        rows = {
            S.RESPONSE_IDS: data["response_ids"],
            S.BEHAVIOUR: data["behaviour_logprobs"],
            S.OLD: data["old_logprobs"],
            S.ADVANTAGES: data["advantages"],
            S.TOKEN_VERSIONS: [torch.zeros(len(r), dtype=torch.long) for r in data["response_ids"]],
        }
        await client.put(S.ROLLOUT, rows, version=0, group=list(slots))
        yield client


async def leased(client: Any, n: int, advantages: Any = None) -> tuple[Any, dict[str, Any]]:
    """A lease of the ``n`` rows as the Trainer takes it: rank 0 fetches its small columns."""
    batch = await client.get(
        S.ROLLOUT, "trainer", CLAIMED, n, fetch=[S.PROMPT_IDS, S.TOKEN_VERSIONS]
    )
    assert S.RESPONSE_IDS not in batch.data  # the ranks fetch those
    leases = await rank_leases(client, client.specs[S.ROLLOUT], batch)
    assert leases is not None
    data = {
        S.PROMPT_IDS: batch.expand(S.PROMPT_IDS),
        S.TOKEN_VERSIONS: batch[S.TOKEN_VERSIONS],
        RANK_FETCH: leases,
    }
    if advantages is not None:
        data[S.ADVANTAGES] = advantages
    return batch, data


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


@pytest.mark.parametrize(
    ("agg", "extra", "parallel", "advantages"),
    [(agg, {}, TWO, "fetch") for agg in AGG_MODES]
    + [("token-mean", {"mini_batches": 2}, ParallelSettings(ranks=2, micro_batch_size=2), "fetch"),
       ("seq-mean-token-sum-norm", {"mini_batches": 2, "epochs": 2}, TWO, "scalar"),
       ("token-mean", {}, ParallelSettings(ranks=2, micro_batch_size=1), "rows")],
)  # fmt: skip
async def test_ranks_fetching_their_rows_update_as_the_broadcast_does(
    ranks: DistributedLearner,
    agg: str,
    extra: dict[str, int],
    parallel: ParallelSettings,
    advantages: str,
) -> None:
    spec = run_spec(agg, **extra)
    data = global_batch(8)
    if advantages == "rows":  # per-token advantages: sent as padded rows
        data["advantages"] = [a * torch.linspace(0.5, 1.5, len(a)) for a in data["advantages"]]
    ranks.setup(spec, parallel)
    expected = await trio.to_thread.run_sync(ranks.step, data)
    grads = ranks.gradients()
    state = ranks.full_state_dict()
    async with queue_of(data) as client:
        given = None
        if advantages != "fetch":  # rank 0 estimated them (``trainer_advantage``)
            given = PaddedRows(*pad_rows(data["advantages"], torch.float32, 0))
        batch, step = await leased(client, 8, given)
        ranks.setup(spec, parallel)
        metrics = await trio.to_thread.run_sync(ranks.step_leased, step)
        await client.ack(batch)
    assert metrics["updates"] == expected["updates"]
    assert metrics["normaliser"] == expected["normaliser"]
    assert 0 < metrics["rows_fetched"] <= (8 if extra.get("epochs") else 4)  # its share
    got = ranks.gradients()
    after = ranks.full_state_dict()
    for name, grad in grads.items():
        assert relative(got[name], grad) <= 1e-5, name
        assert relative(after[name], state[name]) <= 1e-5, name


async def test_a_rank_that_cannot_reach_a_unit_fails_the_step_naming_it(
    ranks: DistributedLearner, trigger: Path
) -> None:
    """Rank 1 addresses ``unit-1`` (where its rows lie) where nobody listens (a test hook,
    one step): every rank
    returns before any forward, rank 0 raises ``StorageUnavailable`` naming the unit within
    the bound on a request to a unit (``io_timeout``); the group takes the next step together."""
    ranks.setup(run_spec(), TWO)
    before = ranks.full_state_dict()
    async with queue_of(global_batch(8), io_timeout=2.0) as client:
        batch, step = await leased(client, 8)
        trigger.touch()
        started = time.monotonic()
        with pytest.raises(StorageUnavailable, match="unit-1") as failure:
            await trio.to_thread.run_sync(ranks.step_leased, step)
        assert time.monotonic() - started < 2.0 + 3.0  # the timeout, and a command's cost
        assert failure.value.unit == "unit-1" and not trigger.exists()
        after = ranks.full_state_dict()  # nothing trained
        assert all(torch.equal(before[k], after[k]) for k in before)
        await client.nack(batch)
        batch, step = await leased(client, 8)
        metrics = await trio.to_thread.run_sync(ranks.step_leased, step)
        await client.ack(batch)
    assert metrics["updates"] == 1 and metrics["normaliser"] > 0


def test_ranks_that_may_run_on_other_hosts_keep_the_broadcast() -> None:
    """Child processes fetch their rows; ranks started by torchrun / SLURM (not children of
    rank 0) or by Ray (actors, not processes of ours) get them broadcast by rank 0."""
    from types import SimpleNamespace

    from asyncflow_actors.roles._rank_fetch import plain_reason

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert plain_reason(SimpleNamespace(world_size=2, children=[child])) is None
    assert plain_reason(SimpleNamespace(world_size=1, children=[])) is None
    assert "torchrun" in str(plain_reason(SimpleNamespace(world_size=2, children=[])))
    assert "Ray" in str(plain_reason(SimpleNamespace(world_size=2, children=[object()])))


async def test_units_the_ranks_cannot_reach_switch_the_trainer_to_the_broadcast() -> None:
    """A unit ref that names no address another process could use (no mesh): rank 0 fetches
    every column, from then on, and says why once."""
    from types import SimpleNamespace

    from asyncflow_actors.roles._rank_fetch import rank_columns

    reasons: list[str] = []
    learner = SimpleNamespace(broadcast_rows=reasons.append)
    client = SimpleNamespace(units={"unit-0": object()})
    assert await rank_columns(client, learner, CLAIMED, text=False) is None
    assert len(reasons) == 1 and "no mesh" in reasons[0]
