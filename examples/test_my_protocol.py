"""Testing your own actor protocol with ``asyncflow_actors.testing``.

The protocol: a ``CreditServer`` rations a scarce resource (say, slots of a reward model shared by
rollout workers). A worker asks for ``n`` credits (``Acquire``), gives them back (``Release``),
and may crash while holding them; the server watches every worker it granted credits to and
takes back the credits of one that terminates, crashed or not. Otherwise the credits of crashed
workers leak and the pool dries up, slowly, in production.

The test is a hypothesis state machine over a live actor system: workers are spawned with a
``FaultPlan`` that crashes each at a random message, rules take and give credits, and a
plain-Python model (``CreditModel``, ten lines) says what the server must report after every step.
``LeakyCreditServer`` plants the bug (it reclaims only after a *clean* stop); the second test
shows the state machine finding it, and shrinking it to a three-step story.

Run it: ``pytest examples/test_my_protocol.py`` (CI does). See ``docs/testing.md``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import attrs
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule, run_state_machine_as_test

import asyncflow_actors as afa
from asyncflow_actors import testing as aft

# -- the protocol ---------------------------------------------------------------------------------


@attrs.frozen
class Acquire(afa.Request[bool]):
    """Grant ``n`` credits to ``worker`` now (``True``), or refuse (``False``): no waiting."""

    worker: afa.ActorRef[Any]
    n: int


@attrs.frozen
class Release:
    worker: afa.ActorRef[Any]
    n: int


@attrs.frozen
class Holdings(afa.Request[dict[str, int]]):
    """Credits held per worker name (only the holders)."""


ServerMsg = Acquire | Release | Holdings | afa.Terminated


class CreditServer(afa.Actor[ServerMsg]):
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.held: dict[str, int] = {}

    async def receive(self, msg: ServerMsg, ctx: afa.ActorContext[ServerMsg]) -> Any:
        if isinstance(msg, Acquire):
            if msg.n > self.capacity - sum(self.held.values()):
                return False
            if msg.worker.name not in self.held:
                ctx.watch(msg.worker)  # hear about it when it terminates
            self.held[msg.worker.name] = self.held.get(msg.worker.name, 0) + msg.n
            return True
        if isinstance(msg, Release):
            left = self.held.get(msg.worker.name, 0) - msg.n
            if left < 0:
                raise ValueError(f"{msg.worker.name} releases {msg.n} credits it does not hold")
            self.held[msg.worker.name] = left
        elif isinstance(msg, afa.Terminated):
            self.reclaim(msg)
        elif isinstance(msg, Holdings):
            return {name: n for name, n in self.held.items() if n}
        return None

    def reclaim(self, msg: afa.Terminated) -> None:
        self.held.pop(msg.ref.name, None)


class LeakyCreditServer(CreditServer):
    """The planted bug: credits come back only when a worker stopped cleanly."""

    def reclaim(self, msg: afa.Terminated) -> None:
        if msg.error is None:
            super().reclaim(msg)


@attrs.frozen
class Take(afa.Request[bool]):
    n: int


@attrs.frozen
class Give:
    n: int


class Worker(afa.Actor[Take | Give]):
    """Takes credits from the server and gives them back when asked to."""

    def __init__(self, server: afa.ActorRef[ServerMsg]) -> None:
        self.server = server

    async def receive(self, msg: Take | Give, ctx: afa.ActorContext[Take | Give]) -> Any:
        if isinstance(msg, Take):
            return await self.server.ask(Acquire(ctx.self, msg.n))
        await self.server.send(Release(ctx.self, msg.n))
        return None


# The same worker, plus a ``faults=FaultPlan(...)`` argument (and a node could import it).
FaultyWorker = aft.faulty(Worker)

# -- the model ------------------------------------------------------------------------------------

CAPACITY = 5


@attrs.define
class CreditModel:
    """What the server must report: credits held by each live worker."""

    held: dict[str, int] = attrs.Factory(dict)
    messages: dict[str, int] = attrs.Factory(dict)  # messages each live worker received
    crash_at: dict[str, int] = attrs.Factory(dict)  # the message each worker crashes at

    def free(self) -> int:
        return CAPACITY - sum(self.held.values())

    def deliver(self, name: str) -> bool:
        """A message reaches ``name``; ``False`` if it crashes there (its credits come back)."""
        self.messages[name] += 1
        if self.messages[name] == self.crash_at[name]:
            del self.messages[name], self.crash_at[name]
            self.held.pop(name, None)
            return False
        return True


# -- the state machine ----------------------------------------------------------------------------


class CreditMachine(aft.ActorMachine):
    server_class: ClassVar[type[CreditServer]] = CreditServer

    async def setup(self, stack: Any) -> None:
        await super().setup(stack)
        self.server = await self.system.spawn(lambda: self.server_class(CAPACITY), name="server")
        self.workers: dict[str, afa.ActorRef[Take | Give]] = {}
        self.spawned = 0
        self.model = CreditModel()

    def live(self) -> list[str]:
        return sorted(self.workers)

    @rule(crash_at=st.integers(1, 4))
    @aft.in_trio
    async def spawn_worker(self, crash_at: int) -> None:
        name = f"w{self.spawned}"
        self.spawned += 1
        plan = aft.FaultPlan((aft.CrashAt(message=crash_at),))
        self.workers[name] = await self.system.spawn(
            lambda: FaultyWorker(self.server, faults=plan), name=name
        )
        self.model.messages[name], self.model.crash_at[name] = 0, crash_at

    @precondition(lambda self: bool(self.workers))
    @rule(data=st.data(), n=st.integers(1, 3))
    @aft.in_trio
    async def take(self, data: st.DataObject, n: int) -> None:
        name = data.draw(st.sampled_from(self.live()))
        try:
            granted = await self.workers[name].ask(Take(n))
        except afa.ActorCrashed:
            assert not self.model.deliver(name), f"{name} crashed unplanned"
            del self.workers[name]
            return
        assert self.model.deliver(name)
        assert granted == (n <= self.model.free())
        if granted:
            self.model.held[name] = self.model.held.get(name, 0) + n

    @precondition(lambda self: bool(self.model.held))
    @rule(data=st.data())
    @aft.in_trio
    async def give(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(self.model.held)))
        n = data.draw(st.integers(1, self.model.held[name]))
        await self.workers[name].send(Give(n))
        if self.model.deliver(name):
            self.model.held[name] -= n
            if not self.model.held[name]:
                del self.model.held[name]
        else:
            del self.workers[name]

    @invariant()
    @aft.in_trio
    async def the_server_agrees_with_the_model(self) -> None:
        assert await self.server.ask(Holdings()) == self.model.held


SETTINGS = aft.protocol_settings(max_examples=40, stateful_step_count=15)
TestCreditProtocol = CreditMachine.TestCase
TestCreditProtocol.settings = SETTINGS


def test_the_planted_bug_is_found() -> None:
    class LeakyMachine(CreditMachine):
        server_class = LeakyCreditServer

    search = aft.protocol_settings(
        max_examples=40, stateful_step_count=15, derandomize=True, database=None
    )
    with pytest.raises(AssertionError):
        run_state_machine_as_test(LeakyMachine, settings=search)


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
