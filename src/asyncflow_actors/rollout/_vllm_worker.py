"""Inside vLLM's worker process: the ``afa_shm`` weight-transfer engine and our worker extension.

vLLM imports this module in each of its workers because ``open_vllm_engine`` names
``WorkerExtension`` as ``worker_extension_cls``; importing it registers the ``afa_shm`` backend
with ``WeightTransferEngineFactory`` before the worker creates its weight-transfer engine.

One update, driven by ``VLLMEngine.load_weights`` through vLLM's own weight-update calls (in
two round trips: ``WorkerExtension.afa_stage`` runs 1 and 2, ``afa_commit`` 3 and 4):

1. ``start_weight_update``: forget anything staged.
2. ``update_weights({"segments", "params", "checksum"})`` (*stage*, any number of times): map
   each segment (``_vllm_shm.map_segment``: name, size, checksum checked: XXH3-64 or CRC-32, as
   the plan names) and check every tensor against the served checkpoint's names and shapes (read from its safetensors headers) and that packed
   modules come whole (``q/k/v``, ``gate/up``). The model is not touched: a failure here leaves
   the old weights serving.
3. ``update_weights({"commit": True})``: load everything staged in one go, through vLLM's
   layerwise reload (which redoes the CPU/GPU weight post-processing, e.g. oneDNN packing).
   This runs between two engine steps, so no step sees a mix of versions.
4. ``finish_weight_update``: drop the mappings (the sender unlinks the files).

``WorkerExtension`` adds ``afa_dump_weights`` (reads the served parameters back, for a
bit-exact check), ``afa_transfer_stats`` and the LoRA-only path (``_vllm_lora_worker``).
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from ._vllm_lora_worker import LoraWorker
from ._vllm_shm import SegmentError, UpdatePlan, map_segment, tensors_of

BACKEND = "afa_shm"

__all__ = ["BACKEND", "ShmWeightTransferEngine", "WorkerExtension"]


@dataclass
class ShmInitInfo(WeightTransferInitInfo):  # type: ignore[misc]
    """No rendezvous: the segments are files on this host."""

    checksum: bool = True


@dataclass
class ShmUpdateInfo(WeightTransferUpdateInfo):  # type: ignore[misc]
    """One stage (``segments`` + ``params``, their ``checksum`` algorithm) or the commit
    (``commit=True``)."""

    segments: list[Any] = field(default_factory=list)
    params: list[Any] = field(default_factory=list)
    checksum: str = ""
    commit: bool = False


def checkpoint_shapes(folder: str) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of the ``*.safetensors`` files of a model folder (their
    headers only); empty when ``folder`` is not a local folder with such files."""
    shapes: dict[str, tuple[int, ...]] = {}
    if not os.path.isdir(folder):
        return shapes
    for entry in sorted(os.listdir(folder)):
        if not entry.endswith(".safetensors"):
            continue
        with open(os.path.join(folder, entry), "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for name, meta in header.items():
            if name != "__metadata__":
                shapes[name] = tuple(int(x) for x in meta["shape"])
    return shapes


class ShmWeightTransferEngine(WeightTransferEngine):  # type: ignore[misc]
    """vLLM's worker side of the ``afa_shm`` backend (see the module docstring)."""

    init_info_cls = ShmInitInfo
    update_info_cls = ShmUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        self.checksum = True
        self.shapes = checkpoint_shapes(str(self.model_config.model))
        self.packed: Mapping[str, list[str]] = dict(
            getattr(model, "packed_modules_mapping", None) or {}
        )
        self.staged: list[tuple[str, torch.Tensor]] = []
        self.mappings: list[mmap.mmap] = []
        self.commits = 0
        self.staged_bytes = 0
        self.timings: dict[str, float] = {}  # the last update's verify / load seconds

    def init_transfer_engine(self, init_info: ShmInitInfo) -> None:
        self.checksum = bool(init_info.checksum)

    def start_weight_update(self) -> None:
        self._drop()
        self.timings = {}

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # vLLM's base method also synchronizes the accelerator, which a CPU worker lacks.
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.current_accelerator() is not None:
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: ShmUpdateInfo) -> None:
        try:
            if update_info.commit:
                self._commit()
            else:
                plan = UpdatePlan.from_wire(
                    update_info.segments, update_info.params, update_info.checksum
                )
                self._stage(plan)
        except BaseException:
            self._drop()  # vLLM ends the update on a failure: nothing may stay mapped
            raise

    def finish_weight_update(self) -> None:
        self._drop()

    def shutdown(self) -> None:
        self._drop()

    def _stage(self, plan: UpdatePlan) -> None:
        started = time.perf_counter()
        if self.checksum and not plan.checksum:
            raise SegmentError("the update carries no checksum (this engine checks them)")
        algorithm = plan.checksum if self.checksum else ""
        mappings = [map_segment(s, checksum=algorithm) for s in plan.segments]
        self.mappings.extend(mappings)
        self.timings["verify"] = self.timings.get("verify", 0.0) + time.perf_counter() - started
        tensors = list(tensors_of(plan, mappings))
        problems: list[str] = []
        if self.shapes:
            for name, tensor in tensors:
                want = self.shapes.get(name)
                if want is None:
                    problems.append(f"{name!r} is not a weight of the served model")
                elif tuple(tensor.shape) != want:
                    problems.append(f"{name!r} has shape {tuple(tensor.shape)}, expected {want}")
        names = {n for n, _ in tensors} | {n for n, _ in self.staged}
        for name in sorted(names):
            for parts in self.packed.values():
                for part in parts:
                    key = f".{part}."
                    if key not in name:
                        continue
                    siblings = [name.replace(key, f".{p}.") for p in parts]
                    missing = [s for s in siblings if s not in names and s in self.shapes]
                    if missing:
                        problems.append(f"{name!r} comes without {missing[0]!r} (one module)")
        if problems:
            raise SegmentError("; ".join(problems[:5]))
        self.staged.extend(tensors)
        self.staged_bytes += plan.nbytes

    def _commit(self) -> None:
        from vllm.model_executor.model_loader.mtp_validation import (
            disable_mtp_completeness_check,
        )
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        if not self.staged:
            raise SegmentError("commit without staged weights")
        started = time.perf_counter()
        initialize_layerwise_reload(self.model)
        with disable_mtp_completeness_check():
            self.model.load_weights(iter(self.staged))
        finalize_layerwise_reload(self.model, self.model_config)
        self.timings["load"] = time.perf_counter() - started
        self.commits += 1
        self._drop()

    def _drop(self) -> None:
        self.staged = []
        self.staged_bytes = 0
        mappings, self.mappings = self.mappings, []
        for mapped in mappings:
            try:
                mapped.close()
            except BufferError:
                pass  # a view still exists: the mapping goes with it


class WorkerExtension(LoraWorker):
    """Methods vLLM adds to its worker class, called through ``collective_rpc`` (the
    ``afa_lora_*`` ones: ``_vllm_lora_worker``)."""

    def afa_stage(self, plan: dict[str, Any]) -> None:
        """Steps 1 and 2 in one round trip: vLLM's ``start_weight_update`` then
        ``update_weights(plan)`` (a failure leaves the update open: the sender ends it)."""
        worker: Any = self
        worker.start_weight_update()
        worker.update_weights(plan)

    def afa_commit(self) -> None:
        """Steps 3 and 4 in one round trip: the commit, then vLLM's ``finish_weight_update``
        (the sender labels the version next, vLLM held paused)."""
        worker: Any = self
        worker.update_weights({"commit": True})
        worker.finish_weight_update()

    def afa_dump_weights(self, path: str) -> int:
        """Write the served parameters (vLLM's names and layout) to a safetensors file at
        ``path`` + ``.rank<N>``; returns how many tensors.

        On CPU vLLM hands linear weights to its GEMM kernel (oneDNN, packed) and drops the
        parameter: those are read back *through the kernel*, as ``kernel(I)`` (exact in
        fp32: every output element is one weight times 1 plus zeros)."""
        from safetensors.torch import save_file

        worker: Any = self
        model = worker.model_runner.get_model()
        tensors = {
            name: p.detach().to("cpu").contiguous().clone()
            for name, p in model.named_parameters()
            if p.numel() > 0
        }
        with torch.no_grad():
            for name, module in model.named_modules():
                weight = getattr(module, "weight", None)
                kernel = getattr(module, "cpu_linear", None)
                if not isinstance(weight, torch.Tensor) or weight.numel() or kernel is None:
                    continue
                eye = torch.eye(int(module.input_size_per_partition), dtype=weight.dtype)
                tensors[f"{name}.weight"] = kernel(eye, weight, None).T.contiguous()
        save_file(tensors, f"{path}.rank{worker.rank}")
        return len(tensors)

    def afa_update_floor(self, rounds: int) -> dict[str, list[float]]:
        """A benchmark's lower bound, measured here on the worker's own cores: ``pack``, the
        seconds of re-packing every linear weight of the model for oneDNN as vLLM's CPU
        backend does after any weight load (``create_onednn_mm``, from same-shape tensors
        already in memory), and ``copy``, those of a raw copy of the same bytes, alternated
        ``rounds`` times. ``{}`` where vLLM packs no linear weight (not its CPU backend)."""
        from vllm import _custom_ops as ops

        worker: Any = self
        model = worker.model_runner.get_model()
        shapes = [
            (int(m.output_size_per_partition), int(m.input_size_per_partition))
            for _, m in model.named_modules()
            if getattr(m, "cpu_linear", None) is not None
            and isinstance(getattr(m, "weight", None), torch.Tensor)
            and m.weight.numel() == 0
        ]
        if not shapes or not getattr(ops, "_supports_onednn", False):
            return {}
        sources = [torch.randn(n, k) for n, k in shapes]
        copies = [torch.empty_like(t) for t in sources]
        for copy, source in zip(copies, sources, strict=True):
            copy.copy_(source)  # faulted in: the copy baseline writes warm memory
        out: dict[str, list[float]] = {"pack": [], "copy": []}
        for _ in range(rounds):
            started = time.perf_counter()
            handles = [ops.create_onednn_mm(t.t(), 32) for t in sources]
            out["pack"].append(time.perf_counter() - started)
            del handles
            started = time.perf_counter()
            for copy, source in zip(copies, sources, strict=True):
                copy.copy_(source)
            out["copy"].append(time.perf_counter() - started)
        return out

    def afa_transfer_stats(self) -> dict[str, Any]:
        """The ``afa_shm`` engine's backend name, commit count and the last update's seconds
        in the worker (``verify``: map and checksum, ``load``: vLLM's reload); ``{}`` without
        it."""
        engine = getattr(self, "weight_transfer_engine", None)
        if not isinstance(engine, ShmWeightTransferEngine):
            return {}
        return {"backend": BACKEND, "commits": engine.commits, "timings": dict(engine.timings)}


try:
    WeightTransferEngineFactory.register_engine(BACKEND, ShmWeightTransferEngine)
except ValueError:  # registered already (imported again in this process)
    pass
