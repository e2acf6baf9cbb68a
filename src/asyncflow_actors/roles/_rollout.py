"""Rollout: prompts in, whole scored groups out; and the Reward actor for expensive rewards.

A Rollout worker serves one or more ``GenerationEngine``s (built-in engines here). It takes
prompts from the ``prompts`` topic as it has room (every prompt ready that fits, in one lease),
generates ``group_size`` samples per prompt concurrently (``rollout.generate_samples``, aborted
partial rollouts resumed from their prefix), scores them inline or through a ``Reward`` actor, and writes the group once into the group the
Driver opened (the prompt is stored once, by the Driver). Every token carries the version of
the weights that produced it; the sample's version is its *oldest* token's.

A group whose oldest token fell out of the staleness window before it was written
(``StaleVersionError``) is generated again with the current weights; a group the TQ no longer
knows (its storage unit was lost) is dropped: the Driver re-injects its prompt.

Weights arrive through the CheckpointEngine (``WeightReceiver``, lazy): they load at the next
group boundary, between two decode steps of the engines.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import trio

from ..actors import Actor, ActorContext, ActorRef, RemoteError
from ..checkpoint import SYNC_MESSAGES, PauseAck, PauseMode, SyncMessage, WeightReceiver
from ..observe import clock_ns, get_registry
from ..transfer_queue import StorageUnavailable, UnknownSample
from . import _schema as S
from ._messages import AdoptVersion, GetRoleStats, Score, Scored
from ._settings import RunSpec
from ._shared import load_policy
from ._worker import Station, column, in_thread, load_compute

if TYPE_CHECKING:
    import torch

    from ..rollout import Completion, GenerationEngine

log = logging.getLogger("asyncflow_actors.roles")


class MultiEngine:
    """Several engines of one worker as one ``SyncTarget``: paused, loaded and resumed together."""

    def __init__(self, engines: list[GenerationEngine]) -> None:
        self.engines = engines

    @property
    def version(self) -> int:
        return min(e.version for e in self.engines)

    async def _all(self, fn: Any) -> list[Any]:
        results: list[Any] = [None] * len(self.engines)

        async def one(i: int) -> None:
            results[i] = await fn(self.engines[i])

        async with trio.open_nursery() as nursery:
            for i in range(len(self.engines)):
                nursery.start_soon(one, i)
        return results

    async def pause(self, mode: PauseMode) -> PauseAck:
        acks: list[PauseAck] = await self._all(lambda e: e.pause(mode))
        return PauseAck(
            mode, self.version, sum(a.in_flight for a in acks), sum(a.aborted for a in acks)
        )

    async def resume(self) -> None:
        await self._all(lambda e: e.resume())

    async def load_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        await self._all(lambda e: e.load_weights(weights, version))


class _Slot:
    """A prompt's hold on one of the worker's generation slots. It is given back as soon as the
    group is generated (scoring and writing it do not occupy the engines, and slots freed in
    the same decode step go back together, so the next prompts come in one lease), and taken
    again to generate the group anew."""

    def __init__(self, free: trio.Semaphore) -> None:
        self.free = free
        self.held = True  # the caller acquired it

    async def acquire(self) -> None:
        if not self.held:
            await self.free.acquire()
            self.held = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self.free.release()


def sample_seed(seed: int, prompt_index: int, attempt: int) -> int:
    """A request's seed: reproducible per (run seed, prompt, attempt)."""
    return ((seed * 1_000_003 + prompt_index) * 131 + attempt) % (1 << 62)


class Rollout(Station, Actor[GetRoleStats | AdoptVersion | SyncMessage]):
    """A rollout worker (see the module docstring)."""

    role = "rollout"
    consumer = "rollout"

    def __init__(
        self,
        spec: RunSpec,
        controller: ActorRef[Any],
        worker: str,
        reward: ActorRef[Score] | None = None,
    ) -> None:
        super().__init__(spec, controller, worker)
        self.reward = reward
        self.engines: list[GenerationEngine] = []
        self._active = 0
        self._busy_since = 0
        self._paused = get_registry().gauge("afa_rollout_paused", worker=worker)

    async def setup(self, ctx: ActorContext[Any]) -> None:
        spec = self.spec
        self.task = await in_thread(spec.task.build)
        count = 1 if spec.colocated else spec.rollout.engines
        await ctx.start(self._serve, count)
        self.target = MultiEngine(self.engines)
        self.receiver = WeightReceiver(
            self.target, load="lazy", name=self.worker, pause=spec.rollout.pauses
        )
        self.meter.set_version(spec.start_version)

    async def _serve(self, count: int, task_status: trio.TaskStatus[None]) -> None:
        """Own the engines (their decode tasks) for the life of this incarnation."""
        async with contextlib.AsyncExitStack() as stack:
            for i in range(count):
                engine = await stack.enter_async_context(await self._open_engine(i))
                self.engines.append(engine)
            task_status.started()
            await trio.sleep_forever()

    async def _open_engine(self, i: int) -> contextlib.AbstractAsyncContextManager[Any]:
        from .. import rollout

        spec = self.spec
        kind = spec.rollout.engine
        if kind == "vllm":
            from ._hf_policy import HFTokenizer

            folder = spec.model.hf
            if spec.resume_from:
                folder = os.path.join(spec.resume_from, "policy")
            self.tokenizer = HFTokenizer(await in_thread(_auto_tokenizer, folder))
            args = {"model": folder, **dict(spec.rollout.vllm_args)}
            return rollout.open_vllm_engine(args, version=spec.start_version)
        model, self.tokenizer = await self._model()
        config = rollout.EngineConfig(
            max_batch=spec.engine_rows,
            eos_id=self.tokenizer.eos_id,
            pad_id=self.tokenizer.pad_id,
            max_run_seconds=spec.rollout.max_run_seconds,
            seed=spec.train.seed + i,
            version=spec.start_version,
        )
        if kind == "hf":
            return rollout.open_hf_engine(model, config)
        return rollout.open_torch_engine(model, config)

    async def _model(self) -> tuple[Any, Any]:
        return await load_policy(self.spec, self.compute, self.task)

    async def run(self) -> None:
        spec = self.spec
        slots = max(1, spec.engine_rows * len(self.engines) // spec.rollout.group_size)
        free = trio.Semaphore(slots)
        columns = (S.PROMPT_TEXT, S.ANSWER, S.GROUP, S.PROMPT_INDEX)
        async with trio.open_nursery() as nursery:
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
                extra = self.meter.extra
                extra["prompt_leases"] = extra.get("prompt_leases", 0) + 1
                nursery.start_soon(self._prompts, batch, free)

    async def _prompts(self, batch: Any, free: trio.Semaphore) -> None:
        """Generate and write the group of every prompt of ``batch`` concurrently, each freeing
        its slot once generated; then ack the prompts (never before)."""
        assert self.client is not None
        async with trio.open_nursery() as nursery:
            for k in range(len(batch)):
                nursery.start_soon(self._prompt, batch, k, free)
        await self.client.ack(batch)

    async def _prompt(self, batch: Any, k: int, free: trio.Semaphore) -> None:
        """Generate and write the group of the ``k``-th prompt of ``batch``."""
        slot = _Slot(free)
        try:
            prompt, answer = batch[S.PROMPT_TEXT][k], batch[S.ANSWER][k]
            gid = int(column(batch, S.GROUP)[k])
            index = int(column(batch, S.PROMPT_INDEX)[k])
            attempt = 0
            while not await self._generate_and_write(prompt, answer, gid, index, attempt, slot):
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
        self, prompt: str, answer: str, gid: int, index: int, attempt: int, slot: _Slot
    ) -> bool:
        """One attempt at a group; False: its tokens went stale before it was written."""
        import torch

        from ..rollout import GenerationRequest, SamplingConfig, generate_samples

        assert self.client is not None
        spec, tok = self.spec, self.tokenizer
        # The group boundary. A group starting while another loads the pending weights waits
        # for that load (``apply_pending`` does): it would otherwise start on the old weights,
        # a version older than the Driver admitted it for, and be evicted before training.
        version = await self.receiver.apply_pending()
        if version is not None:
            self.meter.set_version(version)
        engines = self.engines
        engine = engines[0] if len(engines) == 1 else min(engines, key=_running)
        sampling = SamplingConfig(
            max_new_tokens=spec.rollout.max_new_tokens,
            temperature=spec.rollout.temperature,
            top_p=spec.rollout.top_p,
            n=spec.rollout.group_size,
            seed=sample_seed(spec.train.seed, index, attempt),
        )
        request = GenerationRequest(tok.encode(prompt, add_bos=True), sampling)
        with self.meter.track.span("rollout", group=gid, version=engine.version) as span:
            self._generating(+1)
            try:
                completions = await generate_samples(engine, request)
                slot.release()  # the engines are done with it: the next prompt may start
                rewards = await self._score(prompt, answer, completions)
            finally:
                self._generating(-1)
            oldest = min(
                engine.version if c.oldest_version is None else c.oldest_version
                for c in completions
            )
            data = {
                S.RESPONSE_IDS: [torch.tensor(c.token_ids, dtype=torch.int64) for c in completions],
                S.BEHAVIOUR: [torch.tensor(c.logprobs, dtype=torch.float32) for c in completions],
                S.TOKEN_VERSIONS: [
                    torch.tensor(c.versions, dtype=torch.int64) for c in completions
                ],
                S.REWARDS: torch.tensor(rewards, dtype=torch.float32),
                S.RESUMES: torch.tensor([c.resumes for c in completions], dtype=torch.int64),
            }
            start = clock_ns()
            try:
                indexes = await self.client.put(S.ROLLOUT, data, version=oldest, group=gid)
            except Exception as exc:
                outcome = _put_outcome(exc)
                if outcome is None:
                    raise
                key = "regenerated_groups" if outcome == "stale" else "dropped_groups"
                self.meter.extra[key] = self.meter.extra.get(key, 0) + 1
                return outcome == "gone"
            self.meter.waited("put", start, samples=indexes)
            span.set(samples=indexes, version=oldest)
        tokens = sum(len(c.token_ids) for c in completions)
        partial = sum(1 for c in completions if c.resumes > 0)
        extra = self.meter.extra
        extra["partial_samples"] = extra.get("partial_samples", 0) + partial
        self.meter.done(len(completions), tokens)
        return True

    def _generating(self, delta: int) -> None:
        """Busy time = time with at least one group generating (groups overlap)."""
        if self._active == 0 and delta > 0:
            self._busy_since = clock_ns()
        self._active += delta
        if self._active == 0:
            self.meter.busy(self._busy_since)

    async def _score(
        self, prompt: str, answer: str, completions: tuple[Completion, ...]
    ) -> list[float]:
        texts = tuple(self.tokenizer.decode(list(c.token_ids)) for c in completions)
        if self.reward is not None:
            scored = await self.reward.ask(Score(prompt, answer, texts))
            return list(scored.rewards)
        rewards: list[float] = await in_thread(_score_texts, self.task, prompt, answer, texts)
        return rewards

    async def receive(self, msg: Any, ctx: ActorContext[Any]) -> Any:
        if isinstance(msg, GetRoleStats):
            # decode steps of the engines: generated tokens / steps is the batching they
            # achieved (asked here, not per group: an engine's statistics are not free)
            self.meter.extra["engine_steps"] = sum(e.statistics().steps for e in self.engines)
        return await super().receive(msg, ctx)

    async def handle(self, msg: Any, ctx: ActorContext[Any]) -> Any:
        if isinstance(msg, SYNC_MESSAGES):
            try:
                return await self.receiver.handle(msg, ctx)
            finally:
                self._paused.set(int(self.receiver.statistics().paused))
        if isinstance(msg, AdoptVersion):
            await self.target.load_weights({}, msg.version)
            self.meter.set_version(msg.version)
            return msg.version
        return await super().handle(msg, ctx)


def _running(engine: GenerationEngine) -> int:
    return engine.statistics().running


def _put_outcome(exc: BaseException) -> str | None:
    """What a failed group put means: ``"stale"`` (its oldest token left the window before it
    was allocated: generate it again), ``"gone"`` (the group was evicted or lost meanwhile —
    a version bump can evict a put between its allocation and its commit —: the Driver
    re-injects its prompt; or it is full: a crashed predecessor wrote it before its ack), or
    ``None`` (a real error). Errors of the TQ controller in another
    process may arrive as ``RemoteError``s naming their type, possibly in exception groups."""
    names = {_error_name(e) for e in _leaves(exc)}
    if names <= {"StaleVersionError"}:
        return "stale"
    if names <= {"StaleVersionError", "UnknownSample", "UnknownGroup", "GroupError"}:
        return "gone"  # GroupError: a restarted worker writing a group its predecessor wrote
    return None


def _error_name(exc: BaseException) -> str:
    if isinstance(exc, RemoteError):
        return exc.type_name.rsplit(":", 1)[-1]
    if isinstance(exc, StorageUnavailable) and isinstance(exc.__cause__, UnknownSample):
        # the client's word for a put whose samples were evicted or lost before it committed:
        # the queue reports them as events, as for a put the controller refused
        return "UnknownSample"
    return type(exc).__name__


def _leaves(exc: BaseException) -> list[BaseException]:
    inner = getattr(exc, "exceptions", None)
    if not isinstance(inner, tuple):
        return [exc]
    return [leaf for e in inner for leaf in _leaves(e)]


def _auto_tokenizer(folder: str | None) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


def _score_texts(task: Any, prompt: str, answer: str, texts: tuple[str, ...]) -> list[float]:
    from ..rl import Problem, score_responses

    problem = Problem(prompt=prompt, answer=answer)
    return [float(x) for x in score_responses(task, [problem] * len(texts), list(texts))]


class Reward(Actor[Score]):
    """Scores responses against answers with the run's task, off the event loop."""

    def __init__(self, spec: RunSpec, worker: str = "reward-0") -> None:
        self.spec = spec
        self.worker = worker

    async def on_start(self, ctx: ActorContext[Score]) -> None:
        await load_compute(self.spec.train.torch_threads)
        self.task = await in_thread(self.spec.task.build)

    async def receive(self, msg: Score, ctx: ActorContext[Score]) -> Scored:
        rewards = await in_thread(_score_texts, self.task, msg.prompt, msg.answer, msg.responses)
        return Scored(tuple(rewards))
