"""ActorForward (old log-probs) and RefForward (reference log-probs): forward-only stations.

ActorForward *recomputes* the log-probs of every rollout token with the trainer's latest weights
(the proximal policy of decoupled PPO), so the trainer's ``mismatch_kl_*`` and ``ess`` compare
two different computations — the engine's incremental decode and a full forward — and are
meaningful even at staleness 0 (near 0 and 1, not 0 by construction). Its weights arrive
through the CheckpointEngine: bytes land in a host cache during the sync and are loaded
lazily, at the station's next batch boundary. RefForward holds the initial policy and never
syncs. With ``RunSpec.fused_advantage`` (``placement.roles.advantage = "actor_fwd"``)
ActorForward takes whole groups and also computes their advantages: one fetch, one write back
and one ack for both columns. With ``train.forward_ranks`` > 1 each station's model is sharded
over that many ranks (``ForwardGroup``; this process is rank 0): each rank fetches its own
rows of the batch from the TQ (``_forward_fetch``; a unit a rank cannot reach: the lease is
nacked, nothing written) and a weight load keeps each rank's shard.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import trio

from ..actors import Actor, ActorContext
from ..checkpoint import SYNC_MESSAGES, PauseAck, PauseMode, SyncMessage, WeightReceiver
from ..observe import clock_ns
from ..transfer_queue import StorageUnavailable
from . import _schema as S
from ._advantage import Advantages
from ._messages import AdoptVersion, GetRoleStats
from ._shared import load_policy
from ._worker import Station, in_thread, take

log = logging.getLogger("asyncflow_actors.roles")

if TYPE_CHECKING:
    import torch

    from ._lora import AdapterMerger
    from ._settings import LoraSettings


class PolicyCopy:
    """A forward station's copy of the policy as a ``SyncTarget``.

    Loads never overlap a forward pass (one lock): a lazy load happens at the station's batch
    boundary anyway; an eager one waits for the batch in progress. With ``lora`` (an
    adapters-only sync, ``rollout.vllm_lora``) adapters are merged into the plain weights.
    """

    def __init__(self, model: Any, version: int, lora: LoraSettings | None = None) -> None:
        self.model = model
        self.version = version
        self.lock = trio.Lock()
        self.merger: AdapterMerger | None = None
        if lora is not None and lora.enabled:
            from ._lora import AdapterMerger

            self.merger = AdapterMerger(lora)

    async def pause(self, mode: PauseMode) -> PauseAck:
        await trio.lowlevel.checkpoint()
        return PauseAck(mode, self.version)

    async def resume(self) -> None:
        await trio.lowlevel.checkpoint()

    async def load_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        async with self.lock:
            await in_thread(self._load, dict(weights))
            self.version = version

    def _load(self, weights: dict[str, torch.Tensor]) -> None:
        import torch

        with torch.no_grad():
            state = self.model.state_dict()
            if self.merger is not None:
                weights = self.merger.merged(state, weights)
            for name, tensor in weights.items():
                state[name].copy_(tensor)


class RankedCopy(PolicyCopy):
    """The copy of a station on ranks: the model is a ``ForwardGroup``; a load sends the full
    tensors to every rank, each keeping its shard."""

    def _load(self, weights: dict[str, torch.Tensor]) -> None:
        self.model.load(weights)


class _Forward(Station):
    column: str = S.OLD
    advantages: Advantages | None = None  # fused: this station computes them too

    async def setup(self, ctx: ActorContext[Any]) -> None:
        spec = self.spec
        self.task = await in_thread(spec.task.build)
        self.columns = S.station_columns(spec)[self.consumer]
        self.copy: PolicyCopy
        if spec.train.forward_ranks > 1:
            self.model, self.tokenizer = await self.load_ranks()
            self.copy = RankedCopy(self.model, spec.start_version)
        else:
            self.model, self.tokenizer = await self.load_model()
            self.copy = PolicyCopy(self.model, spec.start_version, spec.model.lora)
        self.meter.set_version(spec.start_version)

    async def load_model(self) -> tuple[Any, Any]:
        policy: tuple[Any, Any] = await in_thread(
            self.compute.build_policy, self.spec.model, self.task
        )
        return policy

    def policy_path(self) -> str | None:
        """Where this station's policy loads from (None: the run's initial policy)."""
        return None

    async def load_ranks(self) -> tuple[Any, Any]:
        """The station's ranks (``ForwardGroup``) and the policy's tokenizer."""
        from ._forward_ranks import ForwardGroup

        path = self.policy_path()
        group = await in_thread(lambda: ForwardGroup.open(self.spec, path=path))
        return group, group.tokenizer

    def logprobs(self, prompts: list[Any], responses: list[Any]) -> list[Any]:
        """The batch's log-probs (a worker thread's call), on this process or on the ranks."""
        options = {"pad_id": self.tokenizer.pad_id, "temperature": self.spec.rollout.temperature}
        ranked = self.spec.train.forward_ranks > 1
        rows: list[Any] = (
            self.model.logprobs(prompts, responses, **options) if ranked
            else self.compute.sequence_logprobs(self.model, prompts, responses, **options)
        )  # fmt: skip
        return rows

    async def on_stop(self, ctx: ActorContext[Any], error: BaseException | None) -> None:
        await super().on_stop(ctx, error)
        if self.spec.train.forward_ranks > 1 and getattr(self, "model", None) is not None:
            # stop the other ranks at once (a forward may still be in flight in its thread)
            # and leave the process group
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(self.model.terminate)

    async def boundary(self) -> None:
        """The batch boundary: where pending weights load."""

    async def run(self) -> None:
        spec = self.spec
        n = spec.rollout.group_size
        while True:
            fetched = await self.rank_columns()
            batch = await self.fetch(
                self.columns,
                spec.fetch_size,
                whole_groups=spec.stage_barrier or self.advantages is not None,
                min_count=spec.fetch_size if spec.stage_barrier else n,
                fetch=fetched,
            )
            await self.boundary()
            rows = self.dp.rows(batch)
            assert self.client is not None
            if not rows:  # whole groups: fewer groups than ranks left this rank none
                await self.client.ack(batch)
                continue
            with self.meter.track.span(self.role, samples=batch.indexes, version=self.copy.version):
                start = clock_ns()
                try:
                    async with self.copy.lock:
                        logprobs = await self.batch_logprobs(batch, rows, fetched is not None)
                except StorageUnavailable as exc:  # a forward rank could not fetch its rows
                    log.warning("%s %s: %s; its samples go out again", self.role, self.worker, exc)
                    await self.client.nack(batch)
                    continue
                lengths = [int(r.shape[0]) for r in logprobs]
                data = {self.column: logprobs}
                if self.advantages is not None:
                    data[S.ADVANTAGES] = await self.advantages(batch, rows, lengths)
                self.meter.busy(start)
                if not await self.write_back(batch, rows, data):
                    continue  # its samples left the lease: returned, not acked
            await self.client.ack(batch)
            self.meter.done(len(rows), sum(lengths))

    async def rank_columns(self) -> list[str] | None:
        """The columns this station fetches itself when its ranks fetch the prompts and
        responses (``_forward_fetch``), or None (all: this process computes, or rank 0
        broadcasts the rows: ranks the units cannot be reached from, a lease shared with the
        station's other workers)."""
        if self.spec.train.forward_ranks <= 1 or not self.model.rank_fetch:
            return None
        from ._forward_fetch import ROWS
        from ._rank_fetch import _addresses

        assert self.client is not None
        if self.dp.size > 1:
            self.model.broadcast_rows("the station's workers share each lease")
        elif await _addresses(self.client) is None:
            self.model.broadcast_rows(
                "the queue's units cannot be reached from another process (no mesh)"
            )
        return [c for c in self.columns if c not in ROWS] if self.model.rank_fetch else None

    async def batch_logprobs(self, batch: Any, rows: list[int], leased: bool) -> list[Any]:
        """The log-probs of ``batch``'s ``rows``: fetched by the ranks (``leased``), else
        computed on the rows this process fetched."""
        assert self.client is not None
        if leased:
            from ._forward_fetch import ROWS, leased_rows
            from ._rank_fetch import rank_leases

            topic = self.client.specs[batch.lease.topic]
            leases = await rank_leases(self.client, topic, batch)
            if leases is not None:
                options = {"pad_id": self.tokenizer.pad_id,
                           "temperature": self.spec.rollout.temperature}  # fmt: skip
                out, fetched = await in_thread(
                    lambda: self.model.logprobs_leased(leases, rows, **options)
                )
                self.meter.extra["fetched_bytes"] = fetched
                return list(out)
            self.model.broadcast_rows("the queue's units became unreachable from the ranks")
            prompts, responses = await leased_rows(self.client, topic, batch, rows, ROWS)
        else:
            prompts = take(batch, rows, S.PROMPT_IDS)
            responses = take(batch, rows, S.RESPONSE_IDS)
        result: list[Any] = await in_thread(self.logprobs, prompts, responses)
        return result


class ActorForward(_Forward, Actor[GetRoleStats | AdoptVersion | SyncMessage]):
    """Old log-probs with the trainer's latest weights (see the module docstring)."""

    role = "actor_fwd"
    consumer = "actor_fwd"
    column = S.OLD

    async def setup(self, ctx: ActorContext[Any]) -> None:
        await super().setup(ctx)
        if self.spec.fused_advantage:
            self.advantages = Advantages(self.spec, self.compute)
        self.receiver = WeightReceiver(
            self.copy, load="lazy", name=self.worker, pause=self.spec.rollout.pauses
        )
        resume = self.spec.resume_from
        if resume and self.spec.rollout.vllm_lora:  # the checkpoint's adapter, merged
            from ._lora import ADAPTER_DIR, read_adapter

            adapter = await in_thread(read_adapter, os.path.join(resume, ADAPTER_DIR))
            await self.copy.load_weights(adapter, self.spec.start_version)

    async def load_model(self) -> tuple[Any, Any]:
        if self.spec.rollout.vllm_lora:  # the base: adapters merge into it (AdapterMerger)
            return await super().load_model()
        return await load_policy(self.spec, self.compute, self.task)

    def policy_path(self) -> str | None:
        resume = self.spec.resume_from
        return os.path.join(resume, self.compute.POLICY_FILE) if resume else None

    async def boundary(self) -> None:
        version = await self.receiver.apply_pending()
        if version is not None:
            self.meter.set_version(version)

    async def handle(self, msg: Any, ctx: ActorContext[Any]) -> Any:
        if isinstance(msg, SYNC_MESSAGES):
            return await self.receiver.handle(msg, ctx)
        if isinstance(msg, AdoptVersion):
            await trio.lowlevel.checkpoint()
            self.copy.version = msg.version
            self.meter.set_version(msg.version)
            return msg.version
        return await super().handle(msg, ctx)


class RefForward(_Forward, Actor[GetRoleStats]):
    """Reference log-probs of the initial policy (for a KL penalty)."""

    role = "ref_fwd"
    consumer = "ref_fwd"
    column = S.REF
