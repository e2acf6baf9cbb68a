"""Automatic resume: a Trainer that dies is started again from the newest checkpoint.

With ``train.auto_resume`` (the default) the run's ``Watcher`` leaves the Trainer to a
``TrainerResumer``: when the Trainer terminates (an error, or its node process died; the node's
supervisor restarts the process, not the ``TEMPORARY`` Trainer) it

1. asks the weight receivers and the queue for the newest version they hold (a sync the Driver
   never heard of may have reached them), and the Driver to roll back (``TrainerLost``: the
   steps no checkpoint holds are lost, their prompts injected again; ``roles._driver_resume``);
2. logs one line (``trainer died (<cause>); resuming from checkpoint step K, attempt 2/4``);
3. spawns a Trainer where the first one ran, on the checkpoint's weights, tagged with the
   version the rollback chose, for a run that ends as many versions later as it skipped (when
   the node died with the Trainer, once its supervisor has started a new process); its TQ
   holder name is the dead one's, so the samples it held go back to the queue at once and it
   trains them (nothing in the queue is generated again);
4. sends its weights to every receiver if versions were skipped (they hold a lost step's).

A death at any point of a resume (the new Trainer's node killed while it starts, or while it
resends its weights) counts as one more attempt and starts the next resume: the Driver's
rollback then finds only what the new Trainer reported (it trains nothing before its start
finished), and a resend the dead one owed is owed by the next. After
``train.auto_resume_retries`` resumes the next death fails the run with ``RunFailed`` naming
the root cause, as without auto-resume.
"""

from __future__ import annotations

import logging
from typing import Any

import attrs
import trio

from ..actors import (
    Actor,
    ActorContext,
    ActorCrashed,
    ActorRef,
    Restart,
    Terminated,
    root_error,
)
from ..actors.remote import NodeLost, NodeSystem
from ..roles._ask_again import ask_again, driver_resuming
from ..roles._driver_resume import TrainerLost
from ..roles._messages import ResendWeights
from ..roles._schema import ROLLOUT
from ..transfer_queue import TransferQueueClient
from ._placement import Placement, RunFailed

log = logging.getLogger("asyncflow_actors.pipeline")

ASK_S = 5.0  # a receiver or the queue that does not say its version within this is skipped
NODE_RESTART_S = 30.0  # a node that lost its process and has no new one within this: spawn
NODE_POLL_S = 0.1


@attrs.frozen
class Resume:
    """One automatic resume: the ``attempt`` (2 is the first resume), the ``cause`` of the
    death, the checkpoint's step (``checkpoint``; the run's first version without one), the
    ``version`` its weights took in the new Trainer, the optimizer steps lost since and their
    prompts (injected again), and the versions ``skipped`` (sent out, not checkpointed: the
    run ends that many versions later). ``role``: ``"trainer"``, or ``"driver"`` for a
    Driver's resume (``_driver_resumer``: nothing lost, nothing skipped)."""

    attempt: int
    cause: str
    checkpoint: int
    version: int
    lost_steps: int
    lost_prompts: int
    skipped: int
    role: str = "trainer"


class _Watch(Actor[Terminated]):
    """Watches one Trainer incarnation; its termination goes to the resumer's channel."""

    def __init__(self, ref: ActorRef[Any], send: trio.MemorySendChannel[Terminated]) -> None:
        self.ref = ref
        self.send = send

    async def on_start(self, ctx: ActorContext[Terminated]) -> None:
        ctx.watch(self.ref)

    async def receive(self, msg: Terminated, ctx: ActorContext[Terminated]) -> None:
        await trio.lowlevel.checkpoint()
        self.send.send_nowait(msg)


class TrainerResumer:
    """Restarts the Trainer of ``run`` (see the module docstring). ``kwargs``: those the first
    Trainer was spawned with; ``spawned``: the run's actors, stopped at its end (the new
    Trainer and the watches replace or join them there)."""

    def __init__(
        self,
        run: Any,
        place: Placement,
        client: TransferQueueClient,
        worker: str,
        kwargs: dict[str, Any],
        spawned: list[ActorRef[Any]],
    ) -> None:
        self.run = run
        self.place = place
        self.client = client
        self.worker = worker
        self.kwargs = kwargs
        self.spawned = spawned
        self.retries = place.config.train.auto_resume_retries
        self.resumes: list[Resume] = []
        self._send, self._receive = trio.open_memory_channel[Terminated](8)
        self._watches = 0
        self._pid: int | None = None  # the Trainer's node process (None: in this process)
        self._resend = False  # a resume skipped versions and its weights are not sent yet

    async def watch(self, ref: ActorRef[Any]) -> None:
        """Watch the Trainer ``ref`` (each incarnation)."""
        self._watches += 1
        self._pid = self._node_pid()
        system: NodeSystem = self.place.system
        watch = await system.spawn(
            lambda: _Watch(ref, self._send),
            name=f"trainer-watch-{self._watches}.{self.place.suffix}",
        )
        self.spawned.insert(0, watch)

    async def serve(self) -> None:
        """Resume each Trainer that dies, until the retries are spent; a new Trainer that dies
        while it starts is one more attempt (the next resume starts at once)."""
        async for msg in self._receive:
            error = msg.error
            while True:
                if len(self.resumes) >= self.retries:
                    self._fail(error)
                    return
                try:
                    died = await self._resume(error)
                except Exception as exc:  # the resume itself failed: the run ends, naming it
                    log.warning("resuming the trainer failed: %r", exc)
                    self._fail(exc)
                    return
                if died is None:
                    break
                error = died

    def _fail(self, error: BaseException | None) -> None:
        self.run.errors.append(RunFailed(self.worker, error))
        self.run.failed.set()

    async def _resume(self, error: BaseException | None) -> BaseException | None:
        """One attempt: roll back, start a Trainer, send its weights if due. Returns the error
        of a new Trainer that died while it started (``None``: it runs, watched)."""
        run = self.run
        floor = await self._newest_version()
        # idempotent after an interrupted resume: the Driver lost what the dead Trainer
        # reported since, nothing else (a Trainer that died while it started reported nothing)
        driver = run.refs["driver"]  # asked again while a Driver that raised is resumed
        point = await ask_again(
            lambda: driver.ask(TrainerLost(floor)), "rolling back", transient=driver_resuming
        )
        attempt = len(self.resumes) + 2
        root = root_error(error) if error is not None else None
        cause = "stopped" if root is None else f"{type(root).__name__}: {root}"
        where = (
            f"checkpoint step {point.checkpoint_version}"
            if point.directory
            else f"the run's start (step {point.checkpoint_version}: no checkpoint)"
        )
        log.warning(
            "trainer died (%s); resuming from %s, attempt %d/%d",
            cause, where, attempt, self.retries + 1,
        )  # fmt: skip
        self.resumes.append(
            Resume(
                attempt, cause, point.checkpoint_version, point.version, point.lost_steps,
                len(point.lost_prompts), point.skipped,
            )
        )  # fmt: skip
        # the receivers hold a lost step's weights, from this rollback or one whose resume
        # died before its resend: the checkpoint's weights must reach them under that tag
        self._resend = self._resend or point.skipped > 0
        old = self.kwargs["spec"]
        spec = attrs.evolve(
            old,
            start_version=point.version,
            resume_from=point.directory,
            train=attrs.evolve(old.train, steps=point.end_version),
        )
        if isinstance(root, NodeLost):
            await self._node_restarted()
        self._pid = self._node_pid()
        from ..roles._trainer import Trainer  # (torch: loaded by the run's start already)

        try:
            ref = await self.place.spawn(
                Trainer, role="trainer", worker=self.worker, kwargs={**self.kwargs, "spec": spec},
                restart=Restart.TEMPORARY,
            )  # fmt: skip
        except (ActorCrashed, NodeLost) as exc:  # it died while it started: one more attempt
            log.warning("the resumed trainer died while it started: %r", exc)
            return exc
        dead = run.refs[self.worker]
        self.spawned[:] = [ref if r is dead else r for r in self.spawned]
        run.refs[self.worker] = ref
        run.hooks.trainer = ref
        await self.watch(ref)  # a death from here on reaches serve as a Terminated
        if self._resend:
            try:
                await ref.ask(ResendWeights())
            except Exception as exc:  # its next step's sync reaches them anyway; died: the
                # next resume sends them
                log.warning("resending the resumed trainer's weights failed: %r", exc)
            else:
                self._resend = False
        return None

    def _node_pid(self) -> int | None:
        """The process of the Trainer's node (``None``: the Trainer runs in this one)."""
        node = self.place.nodes.get(self.place.config.placement_of("trainer", self.worker))
        return node.pid if node is not None else None

    async def _node_restarted(self) -> None:
        """Wait (bounded) until the node the Trainer died with runs a new process: a spawn
        before that may meet the dying one (the Trainer's death can be heard before its
        node's), which would count as one more death."""
        with trio.move_on_after(NODE_RESTART_S):
            # polled: the node's peer may still hold the dying process (no event says "new")
            pid = self._pid
            while pid is not None and self._node_pid() in (pid, None):  # noqa: ASYNC110
                await trio.sleep(NODE_POLL_S)
        await trio.lowlevel.checkpoint()

    async def _newest_version(self) -> int:
        """The newest version a weight receiver holds (or has pending) or the queue has."""
        from ..checkpoint import GetReceiverStatistics  # (torch: loaded by the run's start)

        newest = 0

        async def receiver(ref: ActorRef[Any]) -> None:
            nonlocal newest
            with trio.move_on_after(ASK_S):
                try:
                    stats = await ref.ask(GetReceiverStatistics())
                except Exception:
                    return  # restarting: it takes the weights the Trainer sends next
                pending = stats.pending_version if stats.pending_version is not None else -1
                newest = max(newest, stats.version, pending)

        async def queue() -> None:
            nonlocal newest
            with trio.move_on_after(ASK_S):
                tq = await self.client.statistics()
                for topic in tq.controller.state.topics:
                    if topic.topic == ROLLOUT:
                        newest = max(newest, topic.latest_version)

        async with trio.open_nursery() as nursery:
            for ref in self.kwargs["targets"]:
                nursery.start_soon(receiver, ref)
            nursery.start_soon(queue)
        return newest
