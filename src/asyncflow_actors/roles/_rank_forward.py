"""One rank of a forward station (ActorForward, RefForward) on ranks: its shard of the policy
and its share of each forward (no optimizer, no gradients).

Every rank holds the whole batch of a forward command, takes its length-balanced partition of
the rows (``partition_lpt``, as the trainer's ranks do) and runs ONE forward on it (a rank with
no row runs a void one on row 0: FSDP2's all-gathers must match on every rank). The log-probs
come back to rank 0 in one all-gather of flat host tensors (every rank knows every row's
length, so no sizes travel), and rank 0 puts them back in the batch's order. A weight load
takes full tensors on every rank and keeps each rank's shard (cut locally, as
``distribute_tensor`` places it, without a collective).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch import Tensor

from ..models import pack_batch
from ..transfer_queue._samplers import partition_lpt
from ._compute import build_policy, policy_logprobs
from ._rank_learner import _device_index, rank, shard, world
from ._rank_settings import ParallelSettings, parallel_of
from ._ranks import control_group
from ._settings import RunSpec


def forward_parallel(train: Any) -> ParallelSettings:
    """The ``ParallelSettings`` of a forward station's ranks: ``train.forward_ranks`` ranks,
    launched, placed and timed out as the trainer's are; FSDP2 in fp32 (the log-probs a
    one-process station computes)."""
    return attrs.evolve(
        parallel_of(train),
        ranks=train.forward_ranks,
        sharding="fsdp",
        dtype="fp32",
        gradient_checkpointing=False,
        micro_batch_size=None,
    )


class RankForward:
    """This rank's shard of a forward station's policy (module docstring)."""

    def __init__(self, spec: RunSpec, parallel: ParallelSettings, *, path: str | None) -> None:
        self.spec = spec
        model, self.tokenizer = build_policy(spec.model, spec.task.build(), path=path)
        self.device = torch.device(spec.model.device)
        if self.device.type != "cpu":
            self.device = torch.device(self.device.type, _device_index(self.device.type))
        model.to(self.device)
        for param in model.parameters():
            param.requires_grad_(False)
        self.model = shard(model, parallel)

    def logprobs(
        self,
        prompts: Sequence[Tensor],
        responses: Sequence[Tensor],
        *,
        pad_id: int,
        temperature: float,
    ) -> list[Tensor]:
        """Each response's token log-probs (rank 0: every row, in order; others: [])."""
        size = world()
        lengths = [int(r.shape[0]) for r in responses]
        items = [
            (int(p.shape[0]) + n, [k])
            for k, (p, n) in enumerate(zip(prompts, lengths, strict=True))
        ]
        parts = partition_lpt(items, size, equal_count=True)
        mine = parts[rank()]
        return self.part_logprobs(
            parts, lengths, [prompts[k] for k in mine], [responses[k] for k in mine],
            pad_id=pad_id, temperature=temperature,
        )  # fmt: skip

    def part_logprobs(
        self,
        parts: Sequence[Sequence[int]],
        lengths: Sequence[int],
        prompts: Sequence[Tensor],
        responses: Sequence[Tensor],
        *,
        pad_id: int,
        temperature: float,
    ) -> list[Tensor]:
        """This rank's rows (``prompts``, ``responses``: the rows ``parts[rank]`` names, in
        order) forwarded, and every row's log-probs gathered to rank 0 in the batch's order
        (``lengths``: every row's response length, known to every rank; others get [])."""
        size = world()
        mine = parts[rank()]
        if mine:
            batch = pack_batch([p.tolist() for p in prompts], [r.tolist() for r in responses],
                               pad_id=pad_id)  # fmt: skip
        else:  # a void forward: FSDP2's collectives match on every rank
            batch = pack_batch([[pad_id]], [[pad_id]], pad_id=pad_id)
        if self.device.type != "cpu":
            batch = attrs.evolve(batch, **{
                name: getattr(batch, name).to(self.device)
                for name in ("input_ids", "attention_mask", "response_mask")
            })  # fmt: skip
        with torch.no_grad():
            logp = policy_logprobs(self.model, batch, temperature).float().cpu()
        width = max(1, max(sum(lengths[k] for k in part) for part in parts))
        local = torch.zeros(width, dtype=torch.float32)
        offset = 0
        for i, k in enumerate(mine):
            local[offset : offset + lengths[k]] = logp[i, : lengths[k]]
            offset += lengths[k]
        if size == 1:
            every = [local]
        else:
            every = [torch.empty_like(local) for _ in range(size)]
            dist.all_gather(every, local, group=control_group())
        if rank() != 0:
            return []
        out: list[Tensor] = [torch.empty(0)] * len(lengths)
        for part, flat in zip(parts, every, strict=True):
            offset = 0
            for k in part:
                out[k] = flat[offset : offset + lengths[k]].clone()
                offset += lengths[k]
        return out

    def load(self, weights: Mapping[str, Tensor]) -> None:
        """Load full tensors (every rank has them all): each rank keeps its shard. Names not
        given keep their values (a LoRA-only or partial sync)."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        state = self.model.state_dict()
        with torch.no_grad():
            for name, full in weights.items():
                target = state[name]
                value = full.to(device=self.device, dtype=target.dtype)
                if isinstance(target, DTensor):
                    # this rank's slice, cut locally (every rank has the full tensor: no
                    # collective), into the shard's own storage
                    value = distribute_tensor(
                        value, target.device_mesh, target.placements, src_data_rank=None
                    )
                target.copy_(value)
