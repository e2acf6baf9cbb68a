"""Rollout: prompts in, whole scored groups out.

A Rollout worker serves one or more ``GenerationEngine``s (built-in engines here). It takes
prompts from the ``prompts`` topic as it has room (every prompt ready that fits, in one lease),
generates ``group_size`` samples per prompt concurrently (``rollout.generate_samples``, aborted
partial rollouts resumed from their prefix; ``_generation.py``), scores them inline or through
a ``Reward`` actor (``_reward.py``), and writes the group once into the group the Driver opened
(the prompt is stored once, by the Driver; ``_group_writing.py``). Every token carries the
version of the weights that produced it; the sample's version is its *oldest* token's.

A group whose oldest token fell out of the staleness window before it was written
(``StaleVersionError``) is generated again with the current weights; a group the TQ no longer
knows (its storage unit was lost) is dropped: the Driver re-injects its prompt.

Weights arrive through the CheckpointEngine (``WeightReceiver``, lazy) and load at the next
group boundary; a group starts only once this worker's weights reach the version its prompt
was admitted for (``_weight_waits.py``).

The groups a decode step completes together are scored in one worker-thread call and handed to
one writer (``_Batcher``): a thread hop per group cost more than scoring a short group.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import TYPE_CHECKING, Any

import outcome
import trio

from ..actors import Actor, ActorContext, ActorRef
from ..checkpoint import SYNC_MESSAGES, SyncMessage, SyncResume, WeightReceiver
from ..observe import clock_ns, get_registry
from . import _schema as S
from ._ask_again import ask_again, storage_unavailable, tell_driver
from ._batcher import _Batcher
from ._evaluation import evaluate
from ._generation import _Slot, group_request, group_rows, least_busy, oldest_version
from ._group_writing import _put_outcome, _ToWrite, _vanished, drop_group, write_groups
from ._lora import ADAPTER_DIR, open_serving_adapter
from ._messages import AdoptVersion, Evaluate, GetRoleStats, GroupGone, Score, Scored
from ._multi_engine import MultiEngine
from ._reward import reward_runner, score_groups, to_score
from ._settings import RunSpec
from ._shared import load_policy
from ._weight_waits import TELL_TIMEOUT_S, WeightWaits
from ._worker import Station, column, in_thread

if TYPE_CHECKING:
    from ..rollout import Completion, GenerationEngine

log = logging.getLogger("asyncflow_actors.roles")
# how long the engines wait, at a stop, for the work still using them (a weight load) to end
ENGINE_DRAIN_S = 10.0
# a vLLM rollout's stop grace besides its engines' close (the system's default)
STOP_GRACE_S = 5.0


class Rollout(Station, Actor[GetRoleStats | AdoptVersion | SyncMessage | Evaluate]):
    """A rollout worker (see the module docstring)."""

    role = "rollout"
    consumer = "rollout"

    def __init__(
        self,
        spec: RunSpec,
        controller: ActorRef[Any],
        worker: str,
        reward: ActorRef[Score] | None = None,
        driver: ActorRef[Any] | None = None,
    ) -> None:
        super().__init__(spec, controller, worker)
        self.driver = driver
        self.reward = reward
        self.engines: list[GenerationEngine] = []
        self._work_done = trio.Event()  # set: no work is using the engines (none started yet)
        self._work_done.set()
        self._active = 0
        self._busy_since = 0
        self._paused = get_registry().gauge("afa_rollout_paused", worker=worker)
        settle = spec.rollout.group_size  # a checkpoint per sample (``_Batcher``)
        self._scorer: _Batcher[Any, Any] = _Batcher(self._score_many, settle)
        # the groups scored together reach the writer together; a slow put (a storage unit
        # restarting) holds up no other group's
        self._writer: _Batcher[_ToWrite, tuple[int, ...]] = _Batcher(self._write_many, overlap=True)

    def default_shutdown(self) -> float | None:
        """With vLLM, a stop's grace covers closing its engines: the work still using them (a
        weight load: at most ``ENGINE_DRAIN_S``), then vLLM's own shutdown (at most
        ``VLLM_SHUTDOWN_S``; ~10 s on CPU): within the system's 5 s a vLLM rollout was
        killed at every run's end. The built-in and HF engines close at once: the default."""
        if self.spec.rollout.engine != "vllm":
            return None
        from ..rollout._vllm_open import VLLM_SHUTDOWN_S

        return STOP_GRACE_S + ENGINE_DRAIN_S + VLLM_SHUTDOWN_S

    async def setup(self, ctx: ActorContext[Any]) -> None:
        spec = self.spec
        self.task = await in_thread(spec.task.build)
        # the reward functions (imported here, in this process) score inline and evaluations
        self.runner = await in_thread(reward_runner, spec, self.task)
        count = 1 if spec.colocated else spec.rollout.engines
        await ctx.start(self._serve, count)
        self.target = MultiEngine(self.engines)
        self.receiver = WeightReceiver(
            self.target, load="lazy", name=self.worker, pause=spec.rollout.pauses
        )
        self.weights = WeightWaits(
            self.receiver, self.target, self.meter,
            driver=self.driver, worker=self.worker, role=self.role,
        )  # fmt: skip
        self.meter.set_version(spec.start_version)

    async def _serve(self, count: int, task_status: trio.TaskStatus[None]) -> None:
        """Own the engines (their decode tasks) for the life of this incarnation."""
        async with contextlib.AsyncExitStack() as stack:
            stack.callback(self.runner.close)
            for i in range(count):
                engine = await stack.enter_async_context(await self._open_engine(i))
                self.engines.append(engine)
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                # The engines close after the work using them has ended, never under it: a
                # weight load is atomic (shielded until its engine answers), and an engine
                # closed beneath it failed it, and the stop with it. Bounded: past the bound
                # they close anyway (what still waits on them fails).
                with trio.CancelScope(shield=True), trio.move_on_after(ENGINE_DRAIN_S):
                    await self._work_done.wait()

    async def _open_engine(self, i: int) -> contextlib.AbstractAsyncContextManager[Any]:
        from .. import rollout

        spec = self.spec
        kind = spec.rollout.engine
        if kind == "vllm":
            from ._hf_policy import HFTokenizer

            folder = spec.model.hf
            resumed = None  # vllm_lora: the base, serving the checkpoint's adapter
            if spec.resume_from and spec.rollout.vllm_lora:
                resumed = os.path.join(spec.resume_from, ADAPTER_DIR)
            elif spec.resume_from:
                folder = os.path.join(spec.resume_from, "policy")
            self.tokenizer = HFTokenizer(await in_thread(_auto_tokenizer, folder))
            args = {"model": folder, **dict(spec.rollout.vllm_args)}
            lora = spec.model.lora
            adapter = (
                rollout.VLLMLora(lora.r, lora.alpha, lora.target_modules)
                if spec.rollout.vllm_lora
                else None
            )
            opened = rollout.open_vllm_engine(args, version=spec.start_version, lora=adapter)
            if resumed is not None:
                return open_serving_adapter(opened, resumed, spec.start_version)
            return opened
        from ._native_policy import native_kv_capacity

        model, self.tokenizer = await self._model()
        config = rollout.EngineConfig(
            max_batch=spec.engine_rows,
            eos_id=self.tokenizer.eos_id,
            pad_id=self.tokenizer.pad_id,
            max_run_seconds=spec.rollout.max_run_seconds,
            seed=spec.train.seed + i,
            version=spec.start_version,
            kv_capacity=native_kv_capacity(spec, model) if spec.model.native else None,
        )
        if kind == "hf":
            return rollout.open_hf_engine(model, config)
        return rollout.open_torch_engine(model, config)

    async def _model(self) -> tuple[Any, Any]:
        return await load_policy(self.spec, self.compute, self.task)

    async def run(self) -> None:
        self._work_done = trio.Event()
        try:
            await self._generate()
        finally:
            self._work_done.set()

    async def _generate(self) -> None:
        spec = self.spec
        slots = max(1, spec.engine_rows * len(self.engines) // spec.rollout.group_size)
        free = trio.Semaphore(slots)
        columns = (S.PROMPT_TEXT, S.PROMPT_IDS, S.ANSWER, S.GROUP, S.PROMPT_INDEX,
                   S.MIN_VERSION, S.RECORD)  # fmt: skip
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._scorer.serve)
            nursery.start_soon(self._writer.serve)
            while True:
                await free.acquire()
                room = 1
                while room < slots and free.value > 0:
                    free.acquire_nowait()
                    room += 1
                # Every prompt ready that fits, in one lease (a queue round trip per prompt
                # costs more than the generation of a short group). The lease is acked once all
                # its groups are written; after a crash the groups already written are refused
                # as full (``_put_outcome``), the others generated by the next incarnation.
                batch = await self.fetch(columns, room, whole_groups=False, min_count=1,
                                         topic=S.PROMPTS)  # fmt: skip
                for _ in range(room - len(batch)):
                    free.release()
                batches = [batch]
                if len(batch) == room:
                    batches += await self._top_up(columns, free)
                extra = self.meter.extra
                extra["prompt_leases"] = extra.get("prompt_leases", 0) + len(batches)
                nursery.start_soon(self._prompts, batches, free)

    async def _top_up(self, columns: tuple[str, ...], free: trio.Semaphore) -> list[Any]:
        """The prompts that fit the slots freed while a fetch waited (the groups of one wave
        free theirs a decode step or two apart), taken without waiting, so that they start
        with the fetched ones: a static-batching engine (``hf``) would otherwise generate them
        in a wave of their own after the first one, a step's generation twice over."""
        assert self.client is not None
        room = 0
        while free.value > 0:
            free.acquire_nowait()
            room += 1
        if room == 0:
            return []
        client = self.client
        more = await ask_again(  # as ``fetch`` does: a unit that restarted empty, again
            lambda: client.get(S.PROMPTS, self.consumer, columns, room, min_count=1, wait=False),
            f"{self.role} {self.worker}: get",
            transient=storage_unavailable,
        )
        for _ in range(room - (len(more) if more is not None else 0)):
            free.release()
        return [more] if more is not None else []

    async def _prompts(self, batches: list[Any], free: trio.Semaphore) -> None:
        """Generate and write the group of every prompt of ``batches`` concurrently, each
        freeing its slot once generated; then ack each batch (never before). The weights the
        oldest prompt was admitted for are loaded first, once: the groups then reach the
        engines together (one wave), where a load taken by one group's task would let that
        group start alone while the others still wait for it."""
        assert self.client is not None
        least = min(int(column(b, S.MIN_VERSION).min()) for b in batches)
        await self.weights.wait_for(least)
        async with trio.open_nursery() as nursery:
            for batch in batches:
                for k in range(len(batch)):
                    nursery.start_soon(self._prompt, batch, k, free)
        async with trio.open_nursery() as nursery:
            for batch in batches:
                nursery.start_soon(self.client.ack, batch)

    async def _prompt(self, batch: Any, k: int, free: trio.Semaphore) -> None:
        """Generate and write the group of the ``k``-th prompt of ``batch``."""
        slot = _Slot(free)
        try:
            prompt, answer = batch[S.PROMPT_TEXT][k], batch[S.ANSWER][k]
            record = batch[S.RECORD][k]
            ids = tuple(batch[S.PROMPT_IDS][k].tolist())  # tokenized by the Driver
            gid = int(column(batch, S.GROUP)[k])
            index = int(column(batch, S.PROMPT_INDEX)[k])
            least = int(column(batch, S.MIN_VERSION)[k])
            attempt = 0
            while not await self._generate_and_write(
                (prompt, answer, record), ids, gid, index, least, attempt, slot
            ):
                attempt += 1
                # Stale again: this worker's weights are behind the window (a sync is on its
                # way, or the trainer is gone). Back off instead of spinning.
                if attempt % 10 == 0:
                    log.warning("%s: group %d went stale %d times", self.worker, gid, attempt)
                await trio.sleep(min(0.05 * attempt, 2.0))
                await slot.acquire()
        finally:
            slot.release()

    async def _generate_and_write(
        self,
        source: tuple[str, str, str],
        prompt_ids: tuple[int, ...],
        gid: int,
        index: int,
        least: int,
        attempt: int,
        slot: _Slot,
    ) -> bool:
        """One attempt at a group (on weights of version ``least`` or newer); False: its tokens
        went stale before it was written."""
        from ..rollout import generate_samples

        assert self.client is not None
        prompt, answer, record = source
        await self.weights.wait_for(least)
        engine = least_busy(self.engines)
        request = group_request(self.spec, prompt_ids, index, attempt)
        with self.meter.track.span("rollout", group=gid, version=engine.version) as span:
            self._generating(+1)
            try:
                completions = await generate_samples(engine, request)
                slot.release()  # the engines are done with it: the next prompt may start
                scored = await self._score(prompt, answer, record, completions)
            finally:
                self._generating(-1)
            if scored.failed is not None or scored.dropped is not None:
                # the reward failed (``reward.on_error``): the group is not trained; the
                # Driver admits another prompt, or fails the run (``"raise"``)
                reason = scored.failed if scored.failed is not None else scored.dropped
                assert reason is not None
                await drop_group(self.client, self.driver, gid, self.worker, reason,
                                 fatal=scored.failed is not None,
                                 size=len(completions))  # fmt: skip
                extra = self.meter.extra
                extra["dropped_groups"] = extra.get("dropped_groups", 0) + 1
                return True
            oldest = oldest_version(completions, engine.version)
            parts = scored.parts if self.spec.task.reward else None
            data = group_rows(completions, list(scored.rewards), parts)
            start = clock_ns()
            try:
                indexes = await self._writer.submit(_ToWrite(gid, data, oldest))
            except Exception as exc:
                fate = _put_outcome(exc)
                if fate is None:
                    raise
                key = "regenerated_groups" if fate == "stale" else "dropped_groups"
                self.meter.extra[key] = self.meter.extra.get(key, 0) + 1
                log.info("%s: group %d not written (%s): %r", self.worker, gid, fate, exc)
                if fate == "gone" and _vanished(exc):
                    await self._report_gone(gid)
                return fate == "gone"
            self.meter.waited("put", start, samples=indexes)
            span.set(samples=indexes, version=oldest)
        tokens = sum(len(c.token_ids) for c in completions)
        partial = sum(1 for c in completions if c.resumes > 0)
        extra = self.meter.extra
        extra["partial_samples"] = extra.get("partial_samples", 0) + partial
        self.meter.done(len(completions), tokens)
        return True

    async def _evaluate(self, msg: Evaluate, reply: Any) -> None:
        """Answer an ``Evaluate`` (generated on this worker's engines, scored by its runner)."""
        try:
            result = await evaluate(self.spec, self.engines, self.tokenizer, self.runner, msg)
        except Exception as exc:  # the Driver logs it; the run goes on
            reply.fail(exc)
        else:
            reply.send(result)

    async def _report_gone(self, gid: int) -> None:
        """Tell the Driver that group ``gid`` vanished before it was written: its prompt is
        injected again (once, however many report it)."""
        if self.driver is None:
            return
        try:
            with trio.fail_after(TELL_TIMEOUT_S):
                await tell_driver(self.driver, GroupGone(gid, self.worker))
        except Exception as exc:  # the queue's event (if any) still reaches the Driver
            log.warning("%s: reporting group %d gone failed: %r", self.worker, gid, exc)

    def _generating(self, delta: int) -> None:
        """Busy time = time with at least one group generating (groups overlap)."""
        if self._active == 0 and delta > 0:
            self._busy_since = clock_ns()
        self._active += delta
        if self._active == 0:
            self.meter.busy(self._busy_since)

    async def _score(
        self, prompt: str, answer: str, record: str, completions: tuple[Completion, ...]
    ) -> Scored:
        from ..tasks import RewardFailed

        texts = tuple(self.tokenizer.decode(list(c.token_ids)) for c in completions)
        if self.reward is not None:
            reward, score = self.reward, Score(prompt, answer, texts, record)
            # the Reward node restarting is transient: ask again (``_ask_again``)
            scored: Scored = await ask_again(lambda: reward.ask(score), f"{self.worker}: score")
            return scored
        try:
            score = await self._scorer.submit(to_score(prompt, answer, record, texts))
        except RewardFailed as exc:
            return Scored((), failed=str(exc))
        return Scored(score.rewards, score.parts, dropped=score.dropped)

    async def _score_many(self, groups: list[Any]) -> list[outcome.Outcome[Any]]:
        """Score the groups that completed together: one call of each reward function."""
        return await score_groups(self.runner, groups)

    async def _write_many(self, groups: list[_ToWrite]) -> list[outcome.Outcome[tuple[int, ...]]]:
        """Write the groups scored together (``write_groups``)."""
        assert self.client is not None
        return await write_groups(self.client, groups)

    async def receive(self, msg: Any, ctx: ActorContext[Any]) -> Any:
        if isinstance(msg, GetRoleStats):
            # decode steps of the engines: generated tokens / steps is the batching they
            # achieved (asked here, not per group: an engine's statistics are not free)
            self.meter.extra["engine_steps"] = sum(e.statistics().steps for e in self.engines)
            # inline scoring: worker-thread calls (groups completing together share one)
            self.meter.extra["score_calls"] = self._scorer.calls
        return await super().receive(msg, ctx)

    async def handle(self, msg: Any, ctx: ActorContext[Any]) -> Any:
        if isinstance(msg, SYNC_MESSAGES):
            try:
                return await self.receiver.handle(msg, ctx)
            finally:
                self._paused.set(int(self.receiver.statistics().paused))
                if isinstance(msg, SyncResume):  # a commit (pending, or loaded if eager)
                    self.weights.arrived()
        if isinstance(msg, Evaluate):
            # off the mailbox: a weight sync must not wait for an evaluation
            reply = ctx.defer_reply()
            ctx.start_soon(self._evaluate, msg, reply)
            return None
        if isinstance(msg, AdoptVersion):
            try:
                await self.target.load_weights({}, msg.version)
            finally:
                self.weights.arrived()
            self.meter.set_version(msg.version)
            return msg.version
        return await super().handle(msg, ctx)


def _auto_tokenizer(folder: str | None) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, local_files_only=True)
