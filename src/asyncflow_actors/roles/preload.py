"""``Preload``: import a node's roles (torch, and transformers for an HF model) in a worker thread.

A node imports an actor's module when it is asked to spawn it, on its event loop; importing
torch and transformers takes seconds, during which that loop answers nothing. Spawning
``Preload`` first, with the modules of the roles the node will host, moves those imports to a
thread, while this process loads its own roles: the node's spawn then finds them imported.
This module itself imports no torch. The garbage collector pauses meanwhile (``_gc``).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

import attrs
import trio

from ..actors import Actor, ActorContext, Request
from ._gc import gc_paused

_OURS = "asyncflow_actors."


@attrs.frozen
class Loaded(Request[bool]):
    pass


class Preload(Actor[Loaded]):
    """Imports ``modules`` (this package's only: names under ``asyncflow_actors.``) in a worker
    thread during ``on_start``; with ``hf_model`` (a local Hugging Face folder) also the
    transformers classes that load it (its config and model class, the tokenizer's), so
    the roles' ``from_pretrained`` only reads the weights. A warm-up: a module or model that
    does not import is left to the role that needs it, which reports the error."""

    def __init__(
        self,
        modules: Sequence[str] = ("asyncflow_actors.roles",),
        hf_model: str | None = None,
    ) -> None:
        bad = [m for m in modules if not (m + ".").startswith(_OURS)]
        if bad:
            raise ValueError(f"Preload imports modules of asyncflow_actors only, got {bad}")
        self.modules = tuple(modules)
        self.hf_model = hf_model

    async def on_start(self, ctx: ActorContext[Loaded]) -> None:
        await trio.to_thread.run_sync(self._load)

    def _load(self) -> None:
        with gc_paused(freeze=True):  # a full collection every quarter of growth: ~0.5 s
            for name in self.modules:
                importlib.import_module(name)
            if self.hf_model is not None:
                warm_hf_classes(self.hf_model)

    async def receive(self, msg: Loaded, ctx: ActorContext[Loaded]) -> bool:
        await trio.lowlevel.checkpoint()
        return True


def warm_hf_classes(folder: str) -> None:
    """Import what ``AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained(folder)`` import
    (the model's modeling module, the tokenizer's), without loading weights; best effort."""
    try:
        import transformers

        config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
        transformers.MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
        _ = transformers.AutoTokenizer, transformers.PreTrainedTokenizerFast
    except Exception:  # a warm-up: the role's own load reports the error
        pass
