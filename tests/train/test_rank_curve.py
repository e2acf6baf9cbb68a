"""A trainer's ranks in a CURVE mesh (issue #31): they present the key of the process that
started them (``roles/_rank_keys``), handed in their environment, so under CURVE, in both key
models, every rank sends its own buckets of a weight sync to a receiver on another node (from a
trainer here, and from one on a node process of its own) and fetches its own rows from the
TransferQueue (no fallback to rank 0), as a forward station's ranks do; the key is on no
rank's command line, and a connection without it is refused as before. Real processes and
sockets.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import torch
import trio

import asyncflow_actors as afa
from asyncflow_actors.actors.remote import CurveClient, CurveServer, curve_keypair
from asyncflow_actors.actors.remote import _protocol as P
from asyncflow_actors.checkpoint import CheckpointConfig
from asyncflow_actors.roles._distributed import DistributedLearner
from asyncflow_actors.roles._forward_ranks import ForwardGroup
from asyncflow_actors.roles._rank_fetch import _addresses
from asyncflow_actors.roles._rank_keys import RANK_KEYS_ENV, rank_key_env
from asyncflow_actors.roles._rank_send import RankTransport
from asyncflow_actors.roles._rank_settings import ParallelSettings
from asyncflow_actors.roles._rank_sync import ShardedSyncEngine
from tests.checkpoint.doubles import GetWeights
from tests.remote.curve_actors import speak
from tests.train.curve_trainer import OpenRanks, SyncTo

from .conftest import global_batch, run_spec
from .test_forward_fetch import leased as forward_leased
from .test_rank_fetch import leased, queue_of, relative
from .test_rank_sync import FAST, NODE, specs_of

TWO = ParallelSettings(ranks=2)
FORWARD = run_spec(forward_ranks=2, collective_timeout=60)


@asynccontextmanager
async def open_curve_system(model: str) -> AsyncIterator[afa.NodeSystem]:
    """The trainer's system, listening with CURVE in ``model`` (its nodes get their keys)."""
    key = curve_keypair()
    async with afa.open_actor_system() as system:
        if model == "node":
            await system.listen("tcp://127.0.0.1:*", curve=CurveServer(key), key_model="node")
        else:
            await system.listen(
                "tcp://127.0.0.1:*", curve=CurveServer(key), authorized_keys=[key.public]
            )
        yield system


def _cmdline(pid: int) -> bytes:
    return Path(f"/proc/{pid}/cmdline").read_bytes()


@pytest.mark.parametrize("model", ["node", "cluster"])
async def test_ranks_sync_and_fetch_themselves_under_curve(model: str) -> None:
    async with open_curve_system(model) as system:
        assert system.mesh.keys is not None
        own = system.mesh.keys.keypair
        handed = rank_key_env()[RANK_KEYS_ENV]
        assert handed == f"{model} {own.public.decode()} {own.secret.decode()}"
        learner = await trio.to_thread.run_sync(lambda: DistributedLearner.open(run_spec(), TWO))
        try:
            for child in learner.group.children:  # the key is on no command line
                line = _cmdline(child.pid)
                assert own.secret not in line and own.public not in line
            await _sync_to_a_node(system, learner, model)
            await _fetch_own_rows(system, learner, "local")
            await _fetch_own_rows(system, learner, "process")
        finally:
            await trio.to_thread.run_sync(learner.close)


async def _sync_to_a_node(system: afa.NodeSystem, learner: DistributedLearner, model: str) -> None:
    """Both ranks send their buckets to a receiver on a node process (a key of its own in the
    node model): bit-exact; a connection without the key, or with another, is refused."""
    learner.step(global_batch())
    full = await trio.to_thread.run_sync(learner.full_state_dict)
    node = await system.start_node("rx", allow=["tests.checkpoint"], options=NODE)
    kwargs = {"index": 1, "specs": specs_of(full), "tick": 0, "load": "eager"}
    rx = await node.spawn("tests.checkpoint.doubles:DoubleActor", name="rx", kwargs=kwargs)
    engine = ShardedSyncEngine(learner, [rx], CheckpointConfig(deadlines=FAST, bucket_bytes=4096))
    result = await engine.sync(3)
    assert isinstance(engine.transport, RankTransport)
    shards = engine._shards
    assert shards is not None and shards[1] is not None, "rank 0 gathered: a CURVE fallback"
    assert set(shards[1].senders) == {0, 1} and result.buckets == len(shards[1].senders)
    held = await rx.ask(GetWeights())
    assert all(torch.equal(held[k], v) for k, v in full.items())
    # another key, or none, gets no answer from the node nor the trainer's system (as before)
    keys = system.mesh.keys
    assert keys is not None and node.key  # the cluster model: the one key; else its own
    own = keys.keypair.public.decode()
    assert (node.key == own) == (model == "cluster")
    here = next(e for e in system.mesh.endpoints if e.startswith("tcp://"))
    hello = P.Hello("stranger", 1, (), "s")
    for address, key in [(node.address, node.key), (here, own)]:
        for curve in (CurveClient(key, curve_keypair()), None):
            with pytest.raises(trio.TooSlowError):
                await speak(address, curve, [(P.HELLO, hello)], within=0.5)


async def _fetch_own_rows(
    system: afa.NodeSystem, learner: DistributedLearner, placement: str
) -> None:
    """Each rank fetches its own rows from the queue's units (``local``: on the trainer's CURVE
    system, which lets its ranks in with its own key; ``process``: on node processes, keys of
    their own in the node model): the update the broadcast of every row makes."""
    data = global_batch(8)
    learner.setup(run_spec(), TWO)
    expected = await trio.to_thread.run_sync(learner.step, data)
    grads = learner.gradients()
    state = learner.full_state_dict()
    learner.setup(run_spec(), TWO)  # the same initial state again
    async with queue_of(data, system=system, placement=placement) as client:
        addresses = await _addresses(client)  # reachable from the ranks, keys with them
        assert addresses is not None and all(entry[4] for entry in addresses.values())
        batch, step = await leased(client, 8)
        metrics = await trio.to_thread.run_sync(learner.step_leased, step)
        await client.ack(batch)
    assert metrics["normaliser"] == expected["normaliser"]
    assert 0 < metrics["rows_fetched"] <= 4  # its share, fetched by rank 0 itself
    got, after = learner.gradients(), learner.full_state_dict()
    for name, grad in grads.items():
        assert relative(got[name], grad) <= 1e-5, name
        assert relative(after[name], state[name]) <= 1e-5, name


@pytest.mark.parametrize("model", ["node", "cluster"])
async def test_a_trainer_node_s_ranks_sync_to_another_node_under_curve(model: str) -> None:
    """The deployed shape: the trainer on a node process of its own (its own key in the node
    model, bound by the driver), its ranks children of that process, the receiver on another
    node: both ranks send, bit-exact, and the key is on no rank's command line."""
    async with open_curve_system(model) as system:
        allow = ["tests.train", "tests.checkpoint"]
        trainer = await system.start_node("trainer", allow=allow, options=NODE)
        rx_node = await system.start_node("rx", allow=allow, options=NODE)
        ranks = await trainer.spawn("tests.train.curve_trainer:RankTrainer", name="ranks")
        specs, exposed = await ranks.ask(OpenRanks())
        assert not exposed
        kwargs = {"index": 1, "specs": specs, "tick": 0, "load": "eager"}
        rx = await rx_node.spawn("tests.checkpoint.doubles:DoubleActor", name="rx", kwargs=kwargs)
        senders, full = await ranks.ask(SyncTo(rx))
        assert senders == [0, 1], "rank 0 gathered: a CURVE fallback"
        held = await rx.ask(GetWeights())
        assert set(held) == set(full) and all(torch.equal(held[k], v) for k, v in full.items())
        await ranks.stop()


async def test_a_forward_station_s_ranks_fetch_their_rows_under_curve() -> None:
    """A forward station's 2 ranks (node key model) fetch their own rows from units on node
    processes: the log-probs the broadcast gives."""
    async with open_curve_system("node") as system:
        group = await trio.to_thread.run_sync(lambda: ForwardGroup.open(FORWARD))
        try:
            assert group.rank_fetch
            data = global_batch(8)
            expected = await trio.to_thread.run_sync(
                lambda: group.logprobs(
                    data["prompt_ids"], data["response_ids"], pad_id=0, temperature=1.0
                )
            )
            async with queue_of(data, system=system, placement="process") as client:
                _, got, fetched = await forward_leased(client, group, 8)
            assert group.rank_fetch and fetched > 0  # no fallback to the broadcast
            for g, e in zip(got, expected, strict=True):
                assert float((g - e).abs().max()) <= 1e-6
        finally:
            await trio.to_thread.run_sync(group.close)
