"""Putting again what a storage unit's death refused: the Driver's side of ``StorageUnavailable``.

A put (or ``open_groups``) that fails with ``StorageUnavailable`` stored nothing
(``docs/transfer_queue.md``, Errors): the unit it was placed on died, restarted empty or did not
answer, and its supervisor brings it back within moments. The Driver is ``TEMPORARY``: one such
error escaping it failed the whole run (a storage unit killed mid-run, issue #27 §5's soak). So
it puts again, with a growing pause, for up to ``PUT_AGAIN_S`` seconds; past that the queue is
really gone and the error goes on.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import trio

from ..transfer_queue import StorageUnavailable

T = TypeVar("T")

PUT_AGAIN_S = 60.0  # a unit's restart takes seconds; a queue down this long is not coming back
log = logging.getLogger("asyncflow_actors.roles")


async def put_again(call: Callable[[], Awaitable[T]], what: str) -> T:
    """``await call()``, again after each ``StorageUnavailable`` (nothing was stored), for up
    to ``PUT_AGAIN_S`` seconds; ``what`` names it in the log."""
    deadline = trio.current_time() + PUT_AGAIN_S
    pause = 0.05
    while True:
        try:
            return await call()
        except StorageUnavailable as exc:
            if trio.current_time() + pause > deadline:
                raise
            log.warning("%s failed (%s); putting it again in %.2f s", what, exc, pause)
        await trio.sleep(pause)
        pause = min(2 * pause, 1.0)
