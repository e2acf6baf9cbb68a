"""``DistributedLearner``: the trainer's N ranks as one learner, driven from rank 0.

Rank 0 is this process (the Trainer actor's compute thread); ranks 1..N-1 are the group's other
processes (``RankGroup``). Each call broadcasts a command and runs rank 0's part of it: the
same ``RankHost`` code runs on every rank. Every call is synchronous and long (run it in a
worker thread); it raises ``RankFailed`` naming a rank that died, within the collective
timeout, never hangs.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import attrs
import torch.distributed as dist
from torch import Tensor

from ._rank_host import RankHost, encode_batch, spec_to_wire
from ._rank_keys import rank_key_env
from ._rank_learner import RankLearner
from ._rank_settings import LoraSettings, ParallelSettings
from ._ranks import RankGroup, backend_for
from ._ray_ranks import RayRanks, ray_host, start_ray_ranks
from ._settings import RunSpec
from ._threads import intra_op_threads


def ray_ranks(parallel: ParallelSettings) -> RayRanks | None:
    """The Ray placement of a group's ranks, if they go to Ray."""
    if parallel.launcher != "ray":
        return None
    resources = dict(parallel.ray_rank_resources)
    return RayRanks(
        strategy=parallel.ray_strategy,
        num_cpus=resources.pop("CPU", 0.0),
        num_gpus=resources.pop("GPU", 0.0),
        resources=resources,
        address=parallel.ray_address,
        start_timeout=parallel.timeout_s,
    )


def open_group(
    spec: RunSpec, parallel: ParallelSettings, env: Mapping[str, str] | None = None
) -> RankGroup:
    """Start ``parallel.ranks`` ranks (this process is rank 0; the others child processes or,
    with ``parallel.launcher == "ray"``, Ray actors) on the backend of the run's device."""
    placement = ray_ranks(parallel)
    if placement is None:  # child processes: under CURVE they present this node's key
        env = {**rank_key_env(), **(env or {})}
    return RankGroup.open(
        parallel.ranks,
        host="127.0.0.1" if placement is None else ray_host(placement),
        backend=backend_for(spec.model.device),
        timeout_s=parallel.timeout_s,
        env=env,
        threads=intra_op_threads(spec),
        spawn=None if placement is None else functools.partial(start_ray_ranks, placement),
    )


class DistributedLearner:
    """A data-parallel learner over a ``RankGroup`` (module docstring). ``open`` starts the
    other ranks as child processes; ``attach`` takes a group already joined (torchrun)."""

    def __init__(self, group: RankGroup) -> None:
        self.group = group
        self.host = RankHost()

    @classmethod
    def open(
        cls,
        spec: RunSpec,
        parallel: ParallelSettings,
        lora: LoraSettings | None = None,
        *,
        path: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> DistributedLearner:
        """Start ``parallel.ranks`` ranks (this process is rank 0; the others child processes
        or, with ``parallel.launcher == "ray"``, Ray actors) and build the policy on each (from
        ``path``, a checkpoint's policy, when given)."""
        group = open_group(spec, parallel, env)
        learner = cls(group)
        try:
            learner.setup(spec, parallel, lora, path=path)
        except BaseException:
            group.closed = True
            group._kill()
            group.close()
            raise
        return learner

    @classmethod
    def from_env(
        cls,
        spec: RunSpec,
        parallel: ParallelSettings,
        lora: LoraSettings | None = None,
        *,
        path: str | None = None,
    ) -> DistributedLearner | None:
        """For ranks started by torchrun / SLURM (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
        ``MASTER_PORT``): on rank 0, join and return the learner; on the others, join, serve
        rank 0's commands until it closes the group, and return None."""
        from ._rank_host import serve
        from ._ranks import Rendezvous

        rdv, rank = Rendezvous.from_env(
            backend=backend_for(spec.model.device), timeout_s=parallel.timeout_s
        )
        if rank != 0:
            rdv.join_env(rank)
            try:
                serve()
            finally:
                dist.destroy_process_group()
            return None
        learner = cls(RankGroup.attach(rdv))
        learner.setup(spec, parallel, lora, path=path)
        return learner

    def _command(self, header: dict[str, Any], tensors: list[Tensor] | None = None) -> Any:
        return self.group.command(
            header, tensors or [], lambda: self.host.run(header, tensors or [])
        )

    def setup(
        self,
        spec: RunSpec,
        parallel: ParallelSettings,
        lora: LoraSettings | None = None,
        *,
        path: str | None = None,
    ) -> None:
        """(Re)build the learner on every rank."""
        header = {
            "op": "setup",
            "spec": spec_to_wire(spec),
            "parallel": attrs.asdict(parallel),
            "lora": None if lora is None else attrs.asdict(lora),
            "path": path,
        }
        self._command(header)

    @property
    def learner(self) -> RankLearner:
        assert self.host.learner is not None
        return self.host.learner

    def step(self, data: Mapping[str, Any]) -> dict[str, float]:
        """Train on one global batch (the ``Learner.step`` data); rank 0's metrics."""
        layout, tensors = encode_batch(data)
        metrics: dict[str, float] = self._command({"op": "step", "layout": layout}, tensors)
        return metrics

    def step_leased(self, data: Mapping[str, Any]) -> dict[str, float]:
        """Train on one global batch whose rows each rank fetches from the TQ itself
        (``_rank_fetch``): ``data`` holds rank 0's small columns and the step's
        ``RankLeases``. Raises ``StorageUnavailable`` naming the unit a rank could not fetch
        from (before any forward: the group stays in step, the caller nacks the leases)."""
        from ..transfer_queue import StorageUnavailable
        from ._rank_fetch import RANK_FETCH, step_data

        leases = data[RANK_FETCH]
        header, tensors = step_data(data)

        def local() -> Any:
            self.host.fetch = leases.fetch
            try:
                return self.host.run(header, tensors)
            finally:
                self.host.fetch = None

        metrics: dict[str, Any] = self.group.command(header, tensors, local)
        if "failed" in metrics:
            leases.on_failure()  # the controller checks its units
            error = StorageUnavailable(
                f"storage unit {metrics['failed']!r}: rank {metrics['rank']} could not fetch "
                "its rows of the step (its log says why)"
            )
            error.unit = metrics["failed"]
            raise error
        return metrics

    def full_state_dict(self) -> dict[str, Tensor]:
        """The whole model's state dict (CPU tensors), gathered on rank 0."""
        state: dict[str, Tensor] = self._command({"op": "state"})
        return state

    def gradients(self) -> dict[str, Tensor]:
        """The last update's gradients (after division and clipping), whole, on rank 0."""
        grads: dict[str, Tensor] = self._command({"op": "grads"})
        return grads

    def memory(self) -> dict[str, int]:
        """Bytes of the parameters (all, and the trainable ones) and of the optimizer's state,
        summed over the ranks (``optimizer_bytes`` is 0 before the first step)."""
        figures: dict[str, int] = self._command({"op": "memory"})
        return figures

    def save(self, directory: str, meta: Mapping[str, Any]) -> None:
        """A distributed checkpoint (DCP; every rank writes its shards) under ``directory``."""
        self._command({"op": "save", "directory": directory, "meta": dict(meta)})

    def load(self, directory: str) -> dict[str, Any]:
        """Restore a checkpoint ``save`` wrote, on any number of ranks; its ``meta``."""
        meta: dict[str, Any] = self._command({"op": "load", "directory": directory})
        return meta

    def export(self, directory: str, *, merge: bool = True, name: str = "policy") -> str:
        """The final model under ``directory/name`` (HF ``save_pretrained``, or safetensors for
        the TinyDecoder; LoRA merged into the base unless ``merge`` is false). Its path."""
        header = {"op": "export", "directory": directory, "merge": merge, "name": name}
        path: str = self._command(header)
        return path

    def start_gather(self, groups: list[list[str]]) -> None:
        """Tell every other rank to all-gather these groups of parameters, one all-gather a
        group, in this order (rank 0 gathers them itself as a weight sync packs them:
        ``_rank_sync``)."""
        header = {"op": "gather", "groups": groups}
        self.group.command(header, [], lambda: None)

    def start_send(self, header: dict[str, Any]) -> None:
        """Tell every other rank to send its buckets of a weight sync (``_rank_send``); each
        then joins ``join_send``'s all-reduce."""
        self.group.command(header, [], lambda: None)

    def join_send(self, size: int) -> Tensor:
        """Rank 0's part of the all-reduce closing a ``start_send``: every bucket's checksum
        and every rank's status (``_rank_send``), as one int64 tensor of ``size``."""
        import torch

        from ._ranks import control_group

        def join() -> Tensor:
            result = torch.zeros(size, dtype=torch.int64)
            dist.all_reduce(result, group=control_group())
            return result

        result: Tensor = self.group.collective(join)
        return result

    def close(self) -> None:
        self.group.close()

    def __enter__(self) -> DistributedLearner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.group.__exit__(*exc)
