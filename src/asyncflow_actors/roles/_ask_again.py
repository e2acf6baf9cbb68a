"""Asking again an actor whose node is restarting: the rollout's side of a Reward node's death.

A rollout scores each group by asking the Reward actor (``reward.placement``). When the Reward
node's process dies, the asks in flight fail with ``ActorCrashed`` caused by ``NodeLost``, and
the node's supervisor brings it back within moments (issue #27 §1b). Scoring is a pure function
of the group, so asking again is safe; one such error escaping the rollout crashed it, and its
next incarnation met the same restart until its supervisor gave up (the soak's Reward kills). So
the ask is made again, with a growing pause, for up to ``ASK_AGAIN_S`` seconds; past that the
node is not coming back and the error goes on (the run fails loudly). Other errors (the actor
itself failed) go on at once. The same loop serves ``StorageUnavailable`` (``storage_unavailable``),
which stores and takes nothing: the Driver puts prompts and opens groups again after a storage
unit's death (it is ``TEMPORARY``: one such error failed the whole run), and the stations get
again after a unit restarted empty (the failed get returned its lease), until the controller
knows.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import trio

from ..actors import ActorCrashed, ActorRef, Request
from ..actors.remote import NodeLost
from ..transfer_queue import StorageUnavailable

T = TypeVar("T")

ASK_AGAIN_S = 60.0  # a node's restart takes seconds; one down this long is not coming back
log = logging.getLogger("asyncflow_actors.roles")


def node_restarting(exc: BaseException) -> bool:
    """Whether ``exc`` says the asked actor's node process was lost (it is restarted), rather
    than that the actor failed."""
    if isinstance(exc, NodeLost):
        return True
    return isinstance(exc, ActorCrashed) and isinstance(exc.error, NodeLost)


def driver_resuming(exc: BaseException) -> bool:
    """Whether ``exc`` is what an ask to a Driver that raised fails with: with
    ``train.auto_resume`` a new incarnation takes over in the same cell (``_driver_rebuild``)
    and answers the ask made again; a Driver gone for good fails the run meanwhile."""
    return isinstance(exc, ActorCrashed)


async def tell_driver(driver: ActorRef[Any], msg: Request[None]) -> None:
    """Deliver a rollout's report (``GroupGone``, ``GroupDropped``, ``NeedWeights``) to the
    Driver, asked rather than told: a tell queued when the Driver raised is dropped with its
    mailbox, an ask fails and is made again to the resumed Driver (which handles each once)."""
    what = f"telling the driver {type(msg).__name__}"
    await ask_again(lambda: driver.ask(msg), what, transient=driver_resuming)


def storage_unavailable(exc: BaseException) -> bool:
    """Whether ``exc`` is the queue's ``StorageUnavailable``: nothing was stored or taken."""
    return isinstance(exc, StorageUnavailable)


async def ask_again(
    call: Callable[[], Awaitable[T]],
    what: str,
    *,
    within: float = ASK_AGAIN_S,
    transient: Callable[[BaseException], bool] = node_restarting,
) -> T:
    """``await call()``, again after each ``transient`` error (default: a node restarting), for
    up to ``within`` seconds; ``what`` names it in the log."""
    deadline = trio.current_time() + within
    pause = 0.05
    while True:
        try:
            return await call()
        except Exception as exc:
            if not transient(exc) or trio.current_time() + pause > deadline:
                raise
            log.warning("%s failed (%r); asking again in %.2f s", what, exc, pause)
        await trio.sleep(pause)
        pause = min(2 * pause, 1.0)
