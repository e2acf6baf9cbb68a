"""The role classes of a run, by role name, imported when the run needs them.

Their modules import torch (the weight-sync messages hold tensors, the stations compute): the
driver process imports them in a worker thread while its nodes start (``_start``), never at
``import asyncflow_actors.pipeline``, so that the nodes are launched before this process has
loaded torch (``tests/pipeline/test_import_light.py`` keeps it so). A node preloads the module
of each role it hosts (``ROLE_MODULES``) by name, without importing it here.
"""

from __future__ import annotations

import importlib
from typing import Any

ROLE_MODULES = {
    "reward": "asyncflow_actors.roles._reward",
    "rollout": "asyncflow_actors.roles._rollout",
    "actor_fwd": "asyncflow_actors.roles._forward",
    "ref_fwd": "asyncflow_actors.roles._forward",
    "advantage": "asyncflow_actors.roles._advantage",
    "trainer": "asyncflow_actors.roles._trainer",
}
"""The module of each role's class (what a node hosting the role preloads)."""

_CLASSES = {
    "reward": "Reward",
    "rollout": "Rollout",
    "actor_fwd": "ActorForward",
    "ref_fwd": "RefForward",
    "advantage": "Advantage",
    "trainer": "Trainer",
}

DRIVER_MODULE = "asyncflow_actors.roles._driver"
"""The Driver's module (always in the driver process)."""


def role_class(role: str) -> Any:
    """The actor class of ``role`` (its module imported now if it was not)."""
    return getattr(importlib.import_module(ROLE_MODULES[role]), _CLASSES[role])
