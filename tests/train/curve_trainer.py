"""A trainer's rank group on a node process, for the CURVE tests (``test_rank_curve``): the node
starts the ranks (children of its process: they get the node's key), and syncs from them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import trio

import asyncflow_actors as afa
from asyncflow_actors.actors.remote._curve import process_keys
from asyncflow_actors.checkpoint import CheckpointConfig, PhaseDeadlines
from asyncflow_actors.roles._distributed import DistributedLearner
from asyncflow_actors.roles._rank_settings import ParallelSettings
from asyncflow_actors.roles._rank_sync import ShardedSyncEngine

from .conftest import global_batch, run_spec

FAST = PhaseDeadlines(pause=30, prepare=30, topology=30, broadcast=30, finalize=30, resume=30)


@attrs.frozen
class OpenRanks(afa.Request[list[Any]]):
    """Start 2 ranks and take a step; reply [the tensors' specs, whether this node's key (public
    or secret) is on a rank's command line]."""


@attrs.frozen
class SyncTo(afa.Request[list[Any]]):
    """Sync the ranks' weights into ``target``; reply [the ranks that sent, the full state]."""

    target: afa.ActorRef[Any]


class RankTrainer(afa.Actor[OpenRanks | SyncTo]):
    def __init__(self) -> None:
        self.learner: DistributedLearner | None = None

    async def receive(self, msg: OpenRanks | SyncTo, ctx: afa.ActorContext[Any]) -> list[Any]:
        if isinstance(msg, OpenRanks):
            learner = await trio.to_thread.run_sync(
                lambda: DistributedLearner.open(run_spec(), ParallelSettings(ranks=2))
            )
            self.learner = learner
            await trio.to_thread.run_sync(learner.step, global_batch())
            full = learner.full_state_dict()
            specs = {
                k: [str(v.dtype).removeprefix("torch."), list(v.shape)] for k, v in full.items()
            }
            keys = process_keys()
            assert keys is not None
            pair = keys.keypair
            lines = [Path(f"/proc/{c.pid}/cmdline").read_bytes() for c in learner.group.children]
            exposed = any(pair.secret in line or pair.public in line for line in lines)
            return [specs, exposed]
        assert self.learner is not None
        config = CheckpointConfig(deadlines=FAST, bucket_bytes=4096)
        engine = ShardedSyncEngine(self.learner, [msg.target], config)
        await engine.sync(1)
        shards = engine._shards
        senders = sorted(set(shards[1].senders)) if shards is not None and shards[1] else []
        return [senders, self.learner.full_state_dict()]

    async def on_stop(self, ctx: afa.ActorContext[Any], error: BaseException | None) -> None:
        if self.learner is not None:
            await trio.to_thread.run_sync(self.learner.close)
