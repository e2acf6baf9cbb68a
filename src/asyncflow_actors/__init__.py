"""asyncflow_actors: asynchronous, streaming RL post-training as an actor-model library on trio."""

from __future__ import annotations

__version__ = "0.1.0.dev0"
