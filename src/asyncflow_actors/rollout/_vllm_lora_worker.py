"""Inside vLLM's worker: staging and swapping our LoRA adapter (the receiving side of
``_vllm_lora``; ``WorkerExtension`` inherits these methods, ``collective_rpc`` calls them).

- ``afa_lora_stage(plan, config)``: map the shared-memory segments (checksummed), check every
  tensor (PEFT's ``lora_A`` / ``lora_B`` names, a module vLLM's LoRA serves, ``A: (r, in)``,
  ``B: (out, r)`` against the served checkpoint's weight, both halves present, ``r`` within
  ``max_lora_rank``) and build the adapter from copies of the tensors (vLLM's
  ``LoRAModel.from_lora_tensors``). Nothing served changes; a failure raises.
- ``afa_lora_commit()``: replace the adapter under ``ADAPTER_ID`` in vLLM's LoRA manager and put
  it in its slot. It runs between two engine steps (a ``collective_rpc``).
- ``afa_lora_drop()``: forget a staged adapter.

This path stays clear of vLLM's ``start/update/finish_weight_update``: finishing an update
drops every LoRA adapter (``reset_lora_state``, as the base weights changed), which a LoRA-only
sync must not do.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from ._vllm_lora import ADAPTER_ID
from ._vllm_shm import SegmentError, UpdatePlan, map_segment, tensors_of

__all__ = ["LoraWorker"]

_NAME = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")


class LoraWorker:
    """The LoRA methods of our worker extension (``self`` is vLLM's worker)."""

    def afa_lora_modules(self) -> list[str]:
        """The module names (suffixes) vLLM's LoRA serves in this model, packed modules
        (``qkv_proj``) spelt as their parts (``q_proj``, ``k_proj``, ``v_proj``)."""
        manager = _manager(self)
        expected: set[str] = set()
        for module in manager.supported_lora_modules:
            expected.update(manager.packed_modules_mapping.get(module, [module]))
        return sorted(expected)

    def afa_lora_stage(self, plan: dict[str, Any], config: dict[str, Any]) -> int:
        """Stage the adapter of ``plan`` (``UpdatePlan.to_wire``) with PEFT's ``config``
        (``r``, ``lora_alpha``, ``target_modules``); returns its bytes."""
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        worker: Any = self
        worker._afa_lora = None
        manager = _manager(self)
        update = UpdatePlan.from_wire(plan["segments"], plan["params"], plan.get("checksum", ""))
        mappings = [map_segment(s, checksum=update.checksum) for s in update.segments]
        try:
            # copies: vLLM scales lora_B in place when it packs the adapter
            tensors = {name: t.clone() for name, t in tensors_of(update, mappings)}
        finally:
            for mapped in mappings:
                try:
                    mapped.close()
                except BufferError:  # pragma: no cover - a view still exists: it goes with it
                    pass
        helper = PEFTHelper.from_dict(dict(config))
        lora_config = worker.vllm_config.lora_config
        try:
            helper.validate_legal(lora_config)
        except ValueError as exc:
            raise SegmentError(str(exc)) from exc
        _check(self, tensors, int(config["r"]))
        model = manager.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        worker._afa_lora = LoRAModel.from_lora_tensors(
            ADAPTER_ID,
            tensors,
            helper,
            device="cpu",
            dtype=lora_config.lora_dtype,
            model_vocab_size=worker.model_config.get_vocab_size(),
            weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
            skip_prefixes=getattr(model, "lora_skip_prefixes", None),
        )
        return update.nbytes

    def afa_lora_commit(self) -> None:
        """Serve the staged adapter under ``ADAPTER_ID`` from the next step on."""
        worker: Any = self
        lora, worker._afa_lora = getattr(worker, "_afa_lora", None), None
        if lora is None:
            raise SegmentError("commit without a staged adapter")
        manager = _manager(self)
        manager.remove_adapter(ADAPTER_ID)
        manager.add_adapter(lora)
        manager.activate_adapter(ADAPTER_ID)

    def afa_lora_drop(self) -> None:
        worker: Any = self
        worker._afa_lora = None


def _check(worker: Any, tensors: dict[str, torch.Tensor], r: int) -> None:
    """Refuse what vLLM could not serve as this adapter (``SegmentError``, the first five
    problems). A function, not a method: vLLM adds every method of the extension to its
    worker."""
    # the served checkpoint's weight shapes, as our afa_shm engine read them at start-up
    engine = getattr(worker, "weight_transfer_engine", None)
    shapes: dict[str, tuple[int, ...]] = getattr(engine, "shapes", None) or {}
    served = set(LoraWorker.afa_lora_modules(worker))
    problems: list[str] = []
    halves: dict[str, set[str]] = {}
    if not tensors:
        problems.append("the adapter has no tensors")
    for name, tensor in tensors.items():
        found = _NAME.match(name)
        if found is None:
            problems.append(f"{name!r} is not a LoRA tensor")
            continue
        module, ab = found["module"], found["ab"]
        halves.setdefault(module, set()).add(ab)
        suffix = module.rsplit(".", 1)[-1]
        if suffix not in served:
            problems.append(
                f"{module!r}: vLLM's LoRA does not serve {suffix!r} modules "
                f"(it serves {', '.join(sorted(served))})"
            )
            continue
        base = shapes.get(f"{module}.weight")
        if base is None:
            if shapes:
                problems.append(f"{module!r} is not a module of the served model")
            continue
        out, in_ = base
        want = (r, in_) if ab == "A" else (out, r)
        if tuple(tensor.shape) != want:
            problems.append(f"{name!r} has shape {tuple(tensor.shape)}, expected {want}")
    for module, have in sorted(halves.items()):
        if have != {"A", "B"}:
            problems.append(f"{module!r} comes without its lora_{'AB'[('A' in have)]}")
    if problems:
        raise SegmentError("; ".join(problems[:5]))


def _manager(worker: Any) -> Any:
    """vLLM's ``LoRAModelManager`` of this worker's model."""
    runner = worker.model_runner
    manager = getattr(getattr(runner, "lora_manager", None), "_adapter_manager", None)
    if manager is None:
        raise SegmentError("vLLM runs without LoRA (start it with a lora= adapter)")
    return manager
