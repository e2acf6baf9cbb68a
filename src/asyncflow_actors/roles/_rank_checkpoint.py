"""Distributed checkpoints of a rank group: DCP for the model and optimizer, written by every
rank in parallel and loadable on any number of ranks; per-rank RNG; the run state; the export.

Layout of a checkpoint directory::

    dcp/             torch.distributed.checkpoint: model + optimizer, every rank's shards
    rng-<rank>.safetensors   the global and training generators' states of each rank
    run.json         the run state (``meta``: version, ...) and the group's size

``get_state_dict`` / ``set_state_dict`` (``torch.distributed.checkpoint.state_dict``) give the
sharded state of FSDP2 (or replicated DDP) modules under the plain model's names, so a
checkpoint of 2 ranks loads on 1 and back (DCP reshards). ``export`` gathers the full state on
rank 0 and writes the model as Hugging Face ``save_pretrained`` (LoRA merged, or the adapter
alone) or a TinyDecoder safetensors file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import load as dcp_load  # type: ignore[attr-defined]
from torch.distributed.checkpoint import save as dcp_save  # type: ignore[attr-defined]
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from ..models import TinyDecoder, load_safetensors, save_safetensors
from ._compute import save_tiny_policy
from ._rank_learner import RankLearner, rank, world

RUN_FILE = "run.json"


def _barrier() -> None:
    if dist.is_initialized() and world() > 1:
        dist.barrier()


def save(learner: RankLearner, directory: str, meta: Mapping[str, Any]) -> str:
    """Every rank writes its shards (a collective); rank 0 the run state."""
    os.makedirs(directory, exist_ok=True)
    model_state, optim_state = get_state_dict(learner.policy, learner.optimizer)
    dcp_save({"model": model_state, "optim": optim_state},
             checkpoint_id=os.path.join(directory, "dcp"))  # fmt: skip
    rng = {"torch": torch.get_rng_state(), "train": learner.generator.get_state()}
    save_safetensors(os.path.join(directory, f"rng-{rank()}.safetensors"), rng)
    if rank() == 0:
        with open(os.path.join(directory, RUN_FILE), "w") as f:
            json.dump({"meta": dict(meta), "ranks": world()}, f)
    _barrier()
    return directory


def load(learner: RankLearner, directory: str) -> dict[str, Any]:
    """Restore model, optimizer and RNG (this rank's, else rank 0's: a group of another size);
    returns the run state's ``meta``."""
    model_state, optim_state = get_state_dict(learner.policy, learner.optimizer)
    dcp_load({"model": model_state, "optim": optim_state},
             checkpoint_id=os.path.join(directory, "dcp"))  # fmt: skip
    set_state_dict(learner.policy, learner.optimizer,
                   model_state_dict=model_state, optim_state_dict=optim_state)  # fmt: skip
    path = os.path.join(directory, f"rng-{rank()}.safetensors")
    if not os.path.exists(path):
        path = os.path.join(directory, "rng-0.safetensors")
    rng = load_safetensors(path).tensors
    torch.set_rng_state(rng["torch"].clone())
    learner.generator.set_state(rng["train"].clone())
    with open(os.path.join(directory, RUN_FILE)) as f:
        meta: dict[str, Any] = json.load(f)["meta"]
    return meta


def export(
    learner: RankLearner, directory: str, *, merge: bool = True, name: str = "policy"
) -> str:
    """The final model, gathered on rank 0 and written there under ``directory/name`` (a
    collective); its path."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(learner.policy, options=options)
    out = os.path.join(directory, name)
    if rank() == 0:
        os.makedirs(directory, exist_ok=True)
        _write(learner, {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}, out,
               merge=merge)  # fmt: skip
    _barrier()
    return out


def _write(learner: RankLearner, state: dict[str, torch.Tensor], out: str, *, merge: bool) -> None:
    policy: Any = learner.policy
    if isinstance(policy, TinyDecoder):
        model = TinyDecoder(policy.config)
        model.load_state_dict(state)
        head, name = os.path.split(out)
        save_tiny_policy(model, learner.tokenizer, learner.spec.model, head,
                         name=name + ".safetensors")  # fmt: skip
        return
    if learner.lora is not None:
        from ._lora import adapter_state, base_model, merged_state

        if merge:
            base = base_model(policy)
            base.save_pretrained(out, state_dict=merged_state(state, learner.lora),
                                 safe_serialization=True)  # fmt: skip
        else:
            policy.save_pretrained(out, state_dict=adapter_state(state), safe_serialization=True)
    else:
        policy.save_pretrained(out, state_dict=state, safe_serialization=True)
    learner.tokenizer.inner.save_pretrained(out)
