"""Colocated mode: the roles of one process share one policy model.

In ``colocated`` mode the rollout engine, ActorForward and the Trainer live in one process and
hold the *same* ``TinyDecoder``: the trainer's updates are the engine's weights, so a "sync" only
moves the version (``AdoptVersion``), no bytes. The stages run one after another (the
FlowControl window is one batch), so the engine is idle while the trainer updates.
"""

from __future__ import annotations

import os
from typing import Any

import trio

from ._settings import RunSpec
from ._worker import in_thread

_policies: dict[str, tuple[Any, Any]] = {}
_lock = trio.Lock()


def _key(spec: RunSpec) -> str:
    return f"{spec.run_id}:{spec.resume_from}"


async def shared_policy(spec: RunSpec, compute: Any, task: Any) -> tuple[Any, Any]:
    """The process's policy for ``spec`` (built once, from the resume point or the initial one)."""
    async with _lock:
        key = _key(spec)
        if key not in _policies:
            path = os.path.join(spec.resume_from, compute.POLICY_FILE) if spec.resume_from else None
            _policies[key] = await trio.to_thread.run_sync(
                lambda: compute.build_policy(spec.model, task, path=path)
            )
        return _policies[key]


async def load_policy(spec: RunSpec, compute: Any, task: Any) -> tuple[Any, Any]:
    """The policy a station computes with: the process's shared one when colocated, else its
    own copy, from the resume point or the initial policy (built in a worker thread)."""
    if spec.colocated:
        return await shared_policy(spec, compute, task)
    path = os.path.join(spec.resume_from, compute.POLICY_FILE) if spec.resume_from else None
    policy: tuple[Any, Any] = await in_thread(
        lambda: compute.build_policy(spec.model, task, path=path)
    )
    return policy


def forget_shared_policy(spec: RunSpec) -> None:
    """Drop the shared policy of a finished run."""
    _policies.pop(_key(spec), None)
