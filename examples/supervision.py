"""A small supervised tree that crashes and recovers, printing what happens.

    python examples/supervision.py

A ``OneForOne`` supervisor runs two flaky workers and a ``RestForOne`` sub-tree (a source and the
sink that depends on it). Workers crash on some inputs; the supervisor restarts them with backoff,
asks in flight fail with ``ActorCrashed`` instead of hanging, and a crash loop past the restart
intensity takes the sub-tree down and lets the top supervisor restart it whole.
"""

from __future__ import annotations

import logging
from typing import Any

import attrs
import trio

import asyncflow_actors as afa


@attrs.frozen
class Square(afa.Request[int]):
    x: int


@attrs.frozen
class Emit(afa.Request[int]):
    pass


T0 = 0.0


def now() -> str:
    return f"[{trio.current_time() - T0:4.2f}s]"


class Narrating(afa.Supervisor):
    """A supervisor that says when it gives up."""

    async def on_stop(self, ctx: afa.ActorContext[Any], error: BaseException | None) -> None:
        if error is not None:
            print(f"  {now()} {ctx.name} gave up: {str(error).splitlines()[0]}")


class Flaky(afa.Actor[Square]):
    """Squares numbers; crashes on multiples of 7 (the bug we let crash)."""

    async def on_start(self, ctx: afa.ActorContext[Square]) -> None:
        print(f"  {now()} {ctx.name} started (restarts so far: {ctx.self.statistics().restarts})")

    async def receive(self, msg: Square, ctx: afa.ActorContext[Square]) -> int:
        if msg.x % 7 == 0:
            raise ValueError(f"{ctx.name} cannot square {msg.x}")
        return msg.x * msg.x

    async def on_stop(self, ctx: afa.ActorContext[Square], error: BaseException | None) -> None:
        print(f"  {now()} {ctx.name} stopped: {error!r}")


class Source(afa.Actor[Emit]):
    """Counts up; the sink restarts whenever the source does (RestForOne)."""

    def __init__(self) -> None:
        self.n = 0

    async def on_start(self, ctx: afa.ActorContext[Emit]) -> None:
        print(f"  {now()} {ctx.name} started")

    async def receive(self, msg: Emit, ctx: afa.ActorContext[Emit]) -> int:
        self.n += 1
        if self.n == 3:
            raise RuntimeError("source lost its connection")
        return self.n

    async def on_stop(self, ctx: afa.ActorContext[Emit], error: BaseException | None) -> None:
        print(f"  {now()} {ctx.name} stopped: {error!r}")


async def ask(ref: afa.ActorRef[Any], request: afa.Request[Any]) -> None:
    try:
        print(f"{ref.name} <- {request}: {await ref.ask(request)}")
    except afa.ActorCrashed as exc:
        print(f"{ref.name} <- {request}: ActorCrashed({exc.error!r})")


async def main() -> None:
    global T0
    T0 = trio.current_time()
    stages = [afa.ChildSpec(Source, "source"), afa.ChildSpec(Flaky, "sink")]
    pipeline = afa.ChildSpec(
        lambda: Narrating(stages, afa.RestForOne(max_restarts=1, within=10)), "pipeline"
    )
    tree = [afa.ChildSpec(Flaky, "worker-a"), afa.ChildSpec(Flaky, "worker-b"), pipeline]
    strategy = afa.OneForOne(max_restarts=5, within=10, backoff=afa.Backoff(initial=0.05))
    async with afa.open_actor_system() as system:
        print("starting the tree (children start in order):")
        await system.spawn(lambda: afa.Supervisor(tree, strategy), name="top")
        a, b = system.whereis("top/worker-a"), system.whereis("top/worker-b")
        assert a is not None and b is not None

        print("\nworker-a crashes on 7; worker-b is untouched (OneForOne):")
        for x in (3, 7):
            await ask(a, Square(x))
        await trio.sleep(0.1)  # the restart waits out its backoff
        await ask(a, Square(4))
        await ask(b, Square(5))

        print("\nthe source crashes; the sink restarts with it (RestForOne):")
        for _ in range(3):
            source = system.whereis("top/pipeline/source")
            assert source is not None
            await ask(source, Emit())
        await trio.sleep(0.1)

        print(
            "\nthe source crash-loops past its intensity; the top supervisor restarts the sub-tree:"
        )
        for _ in range(2):
            source = system.whereis("top/pipeline/source")
            assert source is not None
            for _ in range(3):
                await ask(source, Emit())
            await trio.sleep(0.2)
        top = system.whereis("top")
        assert top is not None
        for info in await top.ask(afa.WhichChildren()):
            print(f"  child {info.name}: {info.state.value}, restarts={info.restarts}")
        print("\nleaving the system (children stop in reverse order):")
    print("done")


if __name__ == "__main__":
    logging.basicConfig(level=logging.CRITICAL)  # the crashes are expected; keep the output short
    trio.run(main)
