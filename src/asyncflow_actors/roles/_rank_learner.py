"""One rank of a data-parallel trainer: its shard of the policy, its share of each update.

Every rank draws the same updates of a global batch (``plan``: mini-batches, each cut into
length-balanced partitions by ``partition_lpt``) and trains on its partition of each, holding
the whole batch (the ``step`` command) or only the rows it needs (``needed``: ``step_rows``,
each rank fetching them from the TransferQueue, ``_rank_fetch``). The loss of each of its
micro-batches is scaled by its share of the loss's normaliser (its loss tokens, its non-empty
sequences, or for ``seq-mean-token-sum-norm`` its rows times the mini-batch's padded width),
the gradients are summed over ranks (FSDP2 with ``set_gradient_divide_factor(1.0)``, as
torchtitan does; ``ddp``: replicated parameters, one all-reduce of the flat gradients), and
divided by the global normaliser, all-reduced: the update is the one a single process would
take on the whole mini-batch, whatever the split. Then one clipped
optimizer step (``clip_grad_norm_`` over the sharded gradients) per mini-batch.

The policy is sharded from outside (``fully_shard`` per block, then the root), with
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` for ``dtype = "bf16"`` (the
master weights and the optimizer stay fp32), gradient checkpointing for HF policies, and LoRA
adapters (``_lora``) applied before sharding.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..transfer_queue._samplers import partition_lpt
from ._compute import MiniBatches, build_policy, loss_config, policy_token_logprobs
from ._rank_settings import LoraSettings, ParallelSettings
from ._ranks import control_group
from ._settings import RunSpec, SettingsError


def _device_index(kind: str) -> int:
    """This rank's device (set when the rank joined its group)."""
    module = getattr(torch, kind)
    return int(module.current_device())


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a policy (TinyDecoder, HF, or HF under peft): the longest
    ``ModuleList`` named ``layers``, ``h`` or ``blocks``."""
    found: list[nn.Module] = []
    for name, module in model.named_modules():
        if (
            isinstance(module, nn.ModuleList)
            and name.rsplit(".", 1)[-1]
            in (
                "layers",
                "h",
                "blocks",
            )
            and len(module) > len(found)
        ):
            found = list(module)
    return found


def shard(model: nn.Module, parallel: ParallelSettings) -> nn.Module:
    """Apply FSDP2 (``fully_shard`` per block, then the root) or DDP over the default group."""
    if parallel.sharding == "ddp":
        if parallel.dtype == "bf16":
            raise SettingsError("train.dtype bf16 needs sharding fsdp (its mixed precision)")
        return model  # replicated: ``_update`` sums the gradients in one all-reduce
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import (
        FSDPModule,
        MixedPrecisionPolicy,
        fully_shard,
        register_fsdp_forward_method,
    )

    from ..models import TinyDecoder

    device = next(model.parameters()).device.type
    mesh = init_device_mesh(device, (world(),))
    policy = MixedPrecisionPolicy()
    if parallel.dtype == "bf16":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    units: list[nn.Module | list[nn.Module]] = list(blocks(model))
    if isinstance(model, TinyDecoder):
        # its log-probs call hidden_states, then lm_head: the head is a unit of its own, or
        # one with the embedding it is tied to (a shared parameter lives in one FSDP group)
        tied = model.config.tie_embeddings
        units.append([model.embed, model.lm_head] if tied else model.lm_head)
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    if isinstance(model, TinyDecoder):
        register_fsdp_forward_method(model, "hidden_states")
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # we divide by the global normaliser; a plain SUM (gloo has no PREMUL_SUM)
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model


@attrs.frozen
class Update:
    """One optimizer step of a global batch: the mini-batch's rows (``index``: global
    positions), each rank's of them (``parts``: places in ``index``), the rows of a
    micro-batch, the passes every rank runs and the mini-batch's response width."""

    index: Tensor
    parts: list[list[int]]
    micro: int
    passes: int
    width: int

    def rows_of(self, rank: int) -> list[int]:
        """The global positions ``rank``'s passes read (a void pass reads ``index[0]``)."""
        mine = [int(self.index[k]) for k in self.parts[rank]]
        out = []
        for p in range(self.passes):
            out += mine[p * self.micro : (p + 1) * self.micro] or [int(self.index[0])]
        return out


def needed(updates: Sequence[Update], rank: int) -> list[int]:
    """The global positions of the rows ``rank`` trains on in ``updates``, ascending."""
    return sorted({p for update in updates for p in update.rows_of(rank)})


def all_reduce_grads(params: Sequence[nn.Parameter]) -> None:
    """Sum replicated gradients over the ranks: one all-reduce of a flat buffer."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    offset = 0
    for grad in grads:
        n = grad.numel()
        grad.copy_(flat[offset : offset + n].view_as(grad))
        offset += n


class RankLearner:
    """The model, optimizer and updates of this rank (see the module docstring)."""

    def __init__(
        self,
        spec: RunSpec,
        parallel: ParallelSettings,
        lora: LoraSettings | None,
        *,
        path: str | None = None,
    ) -> None:
        self.spec = spec
        self.parallel = parallel
        self.lora = lora if lora is not None and lora.enabled else None
        task = spec.task.build()
        model, self.tokenizer = build_policy(spec.model, task, path=path)
        if self.lora is not None:
            from ._lora import apply_lora

            model = apply_lora(model, self.lora)
        if parallel.gradient_checkpointing:
            kwargs = {"use_reentrant": False}
            if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x
                model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            elif hasattr(model, "gradient_checkpointing_enable"):
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
            else:
                raise SettingsError("train.gradient_checkpointing needs an HF policy (model.hf)")
        model.train()
        self.device = torch.device(spec.model.device)
        if self.device.type != "cpu":
            self.device = torch.device(self.device.type, _device_index(self.device.type))
        model.to(self.device)
        self.model = shard(model, parallel)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=spec.train.lr, weight_decay=spec.train.weight_decay
        )
        self.loss = loss_config(spec.algorithm, spec.staleness)
        self.generator = torch.Generator().manual_seed(spec.train.seed)

    @property
    def policy(self) -> nn.Module:
        return self.model

    def loss_columns(self, reuse: bool) -> list[str]:
        names = ["advantages", "behaviour_logprobs"]
        return (
            names
            + ([] if reuse else ["old_logprobs"])
            + (["ref_logprobs"] if self.spec.use_ref else [])
        )

    def plan(self, sizes: Tensor, lengths: Tensor) -> list[Update]:
        """The updates of one global batch (rows of ``sizes`` tokens, ``lengths`` response
        tokens): ``mini_batches`` a pass over it, ``epochs`` passes, each mini-batch a
        random draw of the batch (this rank's generator: every rank draws the same) cut into
        length-balanced partitions, one a rank."""
        train = self.spec.train
        if self.spec.trainer_forward and not (train.mini_batches == 1 and train.epochs == 1):
            raise SettingsError("a multi-rank trainer_forward needs mini_batches = epochs = 1")
        n = len(sizes)
        chunks = max(1, min(train.mini_batches, n))
        size = world()
        out = []
        for _ in range(train.epochs):
            order = torch.randperm(n, generator=self.generator)
            for k in range(chunks):
                index = order[k * n // chunks : (k + 1) * n // chunks]
                items = [(int(sizes[int(i)]), [j]) for j, i in enumerate(index.tolist())]
                parts = partition_lpt(items, size, equal_count=True)
                micro = self.parallel.micro_batch_size or max(len(p) for p in parts) or 1
                passes = max(1, max(math.ceil(len(p) / micro) for p in parts))
                width = max(1, int(lengths[index].max()))
                out.append(Update(index, parts, micro, passes, width))
        return out

    def step(self, data: Mapping[str, Any]) -> dict[str, float]:
        """Train on one global batch (every rank passes the same one): ``mini_batches``
        updates, ``epochs`` times, each rank computing its partition. Returns the metrics of
        this rank's share (``grad_norm`` and ``valid_tokens`` global)."""
        rows = MiniBatches(
            data, self.loss_columns(self.spec.trainer_forward), self.tokenizer.pad_id
        )
        return self.train(rows, self.plan(rows.prompt_lengths + rows.lengths, rows.lengths))

    def train(
        self, rows: MiniBatches, updates: Sequence[Update], local: Tensor | None = None
    ) -> dict[str, float]:
        """Run ``updates`` (``plan``) on ``rows``: the global batch, or (``local``: global
        position -> row of ``rows``) this rank's rows of it (``needed``)."""
        sums: dict[str, float] = {}
        for update in updates:
            metrics = self._update(rows, update, self.spec.trainer_forward, local)
            for key, value in metrics.items():
                sums[key] = sums.get(key, 0.0) + value
        out = {key: value / len(updates) for key, value in sums.items()}
        out["updates"] = float(len(updates))
        return out

    def _update(
        self, rows: MiniBatches, update: Update, reuse: bool, local: Tensor | None
    ) -> dict[str, float]:
        """One optimizer step on the mini-batch ``update.index`` (global positions)."""
        size = world()
        index, micro = update.index, update.micro
        mine = index[torch.tensor(update.parts[rank()], dtype=torch.long)]
        loss_cfg = self.loss
        if loss_cfg.agg == "seq-mean-token-sum-norm" and loss_cfg.norm_length is None:
            loss_cfg = attrs.evolve(loss_cfg, norm_length=update.width)  # the mini-batch's width
        self.optimizer.zero_grad(set_to_none=True)
        local_weight = torch.zeros(1, dtype=torch.float64)
        sums: dict[str, float] = {}
        for p in range(update.passes):
            sub = mine[p * micro : (p + 1) * micro]
            real = len(sub) > 0
            if not real:  # every rank runs as many passes (FSDP's collectives): a void one
                sub = index[:1]
            result = self._loss(rows, sub if local is None else local[sub], reuse, loss_cfg)
            weight = self._weight(result.loss_mask, loss_cfg, len(sub)) if real else 0.0
            torch.autograd.backward(result.loss * weight)
            local_weight += weight
            if real:
                for key, value in result.metrics.items():
                    sums[key] = sums.get(key, 0.0) + float(value) * weight
        total = local_weight.clone()
        if size > 1:
            dist.all_reduce(total, group=control_group())
            if self.parallel.sharding == "ddp":
                all_reduce_grads(self.params)
        norm = float(total)
        if norm > 0:
            for param in self.params:
                if param.grad is not None:
                    param.grad.div_(norm)
        grad_norm = nn.utils.clip_grad_norm_(self.params, self.spec.train.max_grad_norm)
        if isinstance(grad_norm, torch.distributed.tensor.DTensor):
            grad_norm = grad_norm.full_tensor()
        self.optimizer.step()
        mine_weight = float(local_weight)
        metrics = {k: v / mine_weight for k, v in sums.items()} if mine_weight > 0 else {}
        metrics["grad_norm"] = float(grad_norm)
        metrics["normaliser"] = norm
        return metrics

    def _weight(self, mask: Tensor, cfg: Any, rows: int) -> float:
        """A micro-batch's share of the loss's normaliser (``aggregate``'s denominator)."""
        if cfg.agg == "token-mean":
            return float(mask.sum())
        if cfg.agg == "seq-mean-token-sum-norm":
            return float(rows * cfg.norm_length)
        return float((mask.sum(dim=1) > 0).sum())

    def _loss(self, rows: MiniBatches, index: Tensor, reuse: bool, cfg: Any) -> Any:
        from ..rl import policy_loss

        batch = rows.batch(index)
        width = batch.response_length
        mask = batch.response_mask
        if self.device.type != "cpu":  # the forward on the rank's device, the loss on the host
            batch = attrs.evolve(batch, **{
                name: getattr(batch, name).to(self.device)
                for name in ("input_ids", "attention_mask", "response_mask")
            })  # fmt: skip

        def column(name: str) -> Tensor:
            return rows.column(name, index, width)

        with_entropy = cfg.entropy_coef > 0
        forward = policy_token_logprobs(
            self.model, batch, self.spec.rollout.temperature, with_entropy=with_entropy
        )
        logprobs = forward.logprobs.float().cpu()
        return policy_loss(
            logprobs,
            logprobs.detach() if reuse else column("old_logprobs"),
            column("advantages"),
            mask,
            cfg,
            behaviour_logprobs=column("behaviour_logprobs"),
            ref_logprobs=column("ref_logprobs") if self.spec.use_ref else None,
            entropy=None if forward.entropy is None else forward.entropy.float().cpu(),
        )

    # -- state -----------------------------------------------------------------------------

    def full_state_dict(self) -> dict[str, Tensor]:
        """The whole model's state on rank 0 (CPU; an empty dict elsewhere): a collective."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(self.policy, options=options)
        return {k: v for k, v in state.items() if isinstance(v, Tensor)} if rank() == 0 else {}

    def memory(self) -> dict[str, int]:
        """Bytes the group holds, summed over its ranks (a collective): its parameters, the
        trainable ones, and the optimizer's state (AdamW's moments and step counts; nothing
        before the first step). Under FSDP each rank counts its shards."""
        from torch.distributed.tensor import DTensor

        def nbytes(tensor: Tensor) -> int:
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            return local.numel() * local.element_size()

        state = [
            value
            for per_param in self.optimizer.state.values()
            for value in per_param.values()
            if isinstance(value, Tensor)
        ]
        figures = torch.tensor(
            [
                sum(nbytes(p) for p in self.model.parameters()),
                sum(nbytes(p) for p in self.params),
                sum(nbytes(t) for t in state),
            ],
            dtype=torch.int64,
        )
        if world() > 1:
            dist.all_reduce(figures, group=control_group())
        parameters, trainable, optimizer = (int(x) for x in figures)
        return {"parameter_bytes": parameters, "trainable_bytes": trainable,
                "optimizer_bytes": optimizer}  # fmt: skip

    def named_parameters(self) -> list[tuple[str, Tensor]]:
        """This rank's parameters by their state-dict names (DTensor shards under FSDP)."""
        return [(n, p.detach()) for n, p in self.policy.named_parameters()]


def gather_many(tensors: Sequence[Tensor]) -> list[Tensor]:
    """The full tensors of several parameters with ONE all-gather (a collective every rank
    joins with the same list): the FSDP2 shards (``Shard(0)`` DTensors) travel as bytes, each
    padded to its largest chunk; anything else is gathered alone (or is whole already)."""
    from torch.distributed.tensor import DTensor, Shard

    size = world()
    sharded = [
        k for k, t in enumerate(tensors)
        if isinstance(t, DTensor) and t.dim() > 0 and tuple(t.placements) == (Shard(0),)
    ]  # fmt: skip
    out = [gather(t) if k not in sharded else t for k, t in enumerate(tensors)]
    if not sharded:
        return out
    layout = []  # (index, rows, chunk rows, bytes a row, offset in a rank's segment)
    segment = 0
    for k in sharded:
        t = tensors[k]
        rows = t.shape[0]
        chunk = -(-rows // size)
        row_bytes = t[0].numel() * t.element_size() if rows else 0
        layout.append((k, rows, chunk, row_bytes, segment))
        segment += chunk * row_bytes
    local = torch.zeros(segment, dtype=torch.uint8, device=tensors[sharded[0]].device)
    for k, _, _, _, offset in layout:
        mine = tensors[k].to_local().detach().contiguous()  # type: ignore[attr-defined]
        n = mine.numel() * mine.element_size()
        if n:
            local[offset : offset + n] = mine.reshape(-1).view(torch.uint8)
    every = torch.empty(size * segment, dtype=torch.uint8, device=local.device)
    dist.all_gather_into_tensor(every, local)
    for k, rows, chunk, row_bytes, offset in layout:
        t = tensors[k]
        parts = []
        for r in range(size):
            have = max(0, min(chunk, rows - r * chunk))
            start = r * segment + offset
            parts.append(every[start : start + have * row_bytes])
        flat = torch.cat(parts)
        out[k] = flat.view(t.dtype).reshape(t.shape)
    return out


def gather(tensor: Tensor) -> Tensor:
    """The full tensor of a parameter: an all-gather of a DTensor (a collective), else itself."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
