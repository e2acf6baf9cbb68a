"""The torch side of the stations: models, log-probs, advantages, the training step.

Everything here is synchronous and may take long: stations call it through
``trio.to_thread.run_sync`` (the runtime's rule: no heavy compute on an event loop that serves
other actors). Importing this module imports torch, so stations import it in a thread too.
"""

from __future__ import annotations

import json
import os
from collections.abc import Generator, Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import Tensor

from ..models import (
    BatchLayoutError,
    CharTokenizer,
    PackedBatch,
    TinyConfig,
    TinyDecoder,
    TokenLogprobs,
    load_model,
    load_safetensors,
    load_tokenizer,
    pack_batch,
    save_model,
    save_safetensors,
    token_logprobs,
)
from ..rl import (
    OffPolicyCorrection,
    PPOLossConfig,
    Task,
    dr_grpo_advantages,
    grpo_advantages,
    policy_loss,
    rloo_advantages,
)
from ._adamw import DirectAdamW
from ._settings import AlgorithmSettings, ModelSettings, RunSpec

POLICY_FILE = "policy.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"


def setup_torch(threads: int) -> None:
    torch.set_num_threads(threads)


def build_policy(model: ModelSettings, task: Task, *, path: str | None = None) -> tuple[Any, Any]:
    """The policy of a run and its tokenizer: loaded from ``path`` (a checkpoint) or
    ``model.init``/``model.hf``, else built from the seed (every process builds the same
    weights)."""
    if model.native:
        from ._native_policy import load_native_policy

        assert model.hf is not None
        return load_native_policy(model.hf, model.device, path=path)
    if model.hf is not None:
        from ._hf_policy import load_hf_policy

        return load_hf_policy(os.path.join(path, "policy") if path else model.hf, model.device)
    source = path or model.init
    if source is not None:
        return load_model(source), load_tokenizer(source)
    tokenizer = CharTokenizer(task.alphabet)
    config = TinyConfig(
        vocab_size=tokenizer.vocab_size,
        d_model=model.d_model,
        n_layers=model.n_layers,
        n_heads=model.n_heads,
        max_seq_len=model.max_seq_len,
    )
    with torch.random.fork_rng():
        torch.manual_seed(model.seed)
        return TinyDecoder(config), tokenizer


def save_tiny_policy(
    model: TinyDecoder,
    tokenizer: Any,
    settings: ModelSettings,
    directory: str,
    *,
    name: str = POLICY_FILE,
) -> None:
    """``directory/name``: the tiny policy (with its tokenizer when that is a
    ``CharTokenizer``); a native run (``model.impl="native"``) also writes its Hugging Face
    folder ``directory/policy``."""
    char = tokenizer if isinstance(tokenizer, CharTokenizer) else None
    save_model(os.path.join(directory, name), model, tokenizer=char)
    if settings.native:
        from ._native_policy import save_native_export

        assert settings.hf is not None
        save_native_export(model, settings.hf, directory)


def policy_tokenizer(spec: RunSpec, task: Task) -> Any:
    """The tokenizer of a run's policy, without loading the model (for the Driver)."""
    if spec.model.native:
        from ._native_policy import native_tokenizer

        assert spec.model.hf is not None
        return native_tokenizer(spec.model.hf)
    if spec.model.hf is not None:
        from transformers import AutoTokenizer

        from ._hf_policy import HFTokenizer

        return HFTokenizer(AutoTokenizer.from_pretrained(spec.model.hf, local_files_only=True))
    source = os.path.join(spec.resume_from, POLICY_FILE) if spec.resume_from else spec.model.init
    return load_tokenizer(source) if source else CharTokenizer(task.alphabet)


def right_pad(rows: Sequence[Tensor], width: int) -> Tensor:
    """Per-token rows [len_i] right-padded with zeros to [B, width] (float32)."""
    if not rows:
        return torch.zeros((0, width), dtype=torch.float32)
    out, _ = pad_rows(rows, torch.float32, 0, min_width=width)
    return out[:, :width]


@attrs.frozen
class PaddedRows:
    """Variable-length rows as one tensor: ``values`` [n, W] holds row i in its first
    ``lengths[i]`` columns and zeros after them (W >= 1). What a per-token column of a batch is
    without one tensor per row: a mini-batch of it is one index and one slice."""

    values: Tensor
    lengths: Tensor

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    def rows(self) -> list[Tensor]:
        """One tensor per row (copies, not views of ``values``)."""
        return [self.values[i, :n].clone() for i, n in enumerate(self.lengths.tolist())]


def pad_rows(
    rows: Sequence[Tensor] | PaddedRows,
    dtype: torch.dtype,
    fill: float,
    *,
    left: bool = False,
    min_width: int = 1,
) -> tuple[Tensor, Tensor]:
    """Rows [len_i] as ``[n, W]`` of ``dtype`` filled with ``fill`` around them (W = the
    longest row, at least ``min_width``), right-aligned with ``left`` padding, and their
    lengths [n]: one copy of all the rows (a copy per row cost milliseconds per batch)."""
    if isinstance(rows, PaddedRows):
        if left or fill != 0:
            raise ValueError("PaddedRows hold their rows left-aligned in zeros")
        values = rows.values.to(dtype)
        if values.shape[1] < min_width:
            values = torch.nn.functional.pad(values, (0, min_width - values.shape[1]))
        return values, rows.lengths
    lengths = torch.tensor([int(r.shape[0]) for r in rows], dtype=torch.long)
    width = max(min_width, int(lengths.max()) if len(rows) else 0)
    columns = torch.arange(width)
    mask = columns >= (width - lengths).unsqueeze(1) if left else columns < lengths.unsqueeze(1)
    out = torch.full(mask.shape, fill, dtype=dtype)
    if len(rows):
        out[mask] = torch.cat(list(rows)).to(dtype)  # row-major: one scatter for every row
    return out, lengths


class MiniBatches:
    """The rows of one global batch, padded once per column; each mini-batch is then an index
    and a slice of them, the very tensors ``pack_batch`` and ``right_pad`` build from its rows
    (same values, shapes and layout: the update is unchanged, bit for bit)."""

    def __init__(self, data: Mapping[str, Any], columns: Sequence[str], pad_id: int) -> None:
        prompts, responses = data["prompt_ids"], data["response_ids"]
        if len(prompts) != len(responses):
            raise BatchLayoutError(
                f"got {len(prompts)} prompts and {len(responses)} responses; expected equal counts"
            )
        if not len(prompts):
            raise BatchLayoutError("expected at least one prompt, got an empty sequence")
        self.prompts, self.prompt_lengths = pad_rows(prompts, torch.long, pad_id, left=True)
        empty = (self.prompt_lengths == 0).nonzero()
        if len(empty):
            raise BatchLayoutError(
                f"prompt {int(empty[0])} is empty; every prompt needs at least one token"
            )
        self.responses, self.lengths = pad_rows(responses, torch.long, pad_id)
        self.columns = {name: pad_rows(data[name], torch.float32, 0)[0] for name in columns}

    def batch(self, index: Tensor) -> PackedBatch:
        """``pack_batch`` of the rows at ``index``."""
        lengths = self.prompt_lengths[index]
        width = int(lengths.max())
        prompt_mask = torch.arange(width) >= (width - lengths).unsqueeze(1)
        prompt_ids = self.prompts[index, self.prompts.shape[1] - width :]
        lengths = self.lengths[index]
        width = max(1, int(lengths.max()))
        response_mask = torch.arange(width) < lengths.unsqueeze(1)
        response_ids = self.responses[index, :width]
        return PackedBatch(
            input_ids=torch.cat((prompt_ids, response_ids), dim=1),
            attention_mask=torch.cat((prompt_mask, response_mask), dim=1),
            response_mask=response_mask,
        )

    def column(self, name: str, index: Tensor, width: int) -> Tensor:
        """``right_pad`` of column ``name``'s rows at ``index`` to ``width``."""
        return self.columns[name][index, :width].contiguous()


def policy_logprobs(model: Any, batch: Any, temperature: float) -> Tensor:
    """``[B, R]`` response log-probs of a packed batch under either kind of policy."""
    return policy_token_logprobs(model, batch, temperature).logprobs


def policy_token_logprobs(
    model: Any, batch: Any, temperature: float, *, with_entropy: bool = False
) -> TokenLogprobs:
    """``policy_logprobs`` and, with ``with_entropy``, each response token's entropy (what an
    entropy bonus needs; computed only then, from the same log-softmax)."""
    if isinstance(model, TinyDecoder):
        return token_logprobs(model, batch, temperature=temperature, with_entropy=with_entropy)
    from ._hf_policy import hf_logprobs

    return hf_logprobs(model, batch, temperature, with_entropy=with_entropy)


def sequence_logprobs(
    model: Any,
    prompts: Sequence[Tensor],
    responses: Sequence[Tensor],
    *,
    pad_id: int,
    temperature: float,
) -> list[Tensor]:
    """Each response's token log-probs under ``model`` (one tensor per sample, no grad)."""
    batch = pack_batch(
        [p.tolist() for p in prompts], [r.tolist() for r in responses], pad_id=pad_id
    )
    with torch.no_grad():
        logp = policy_logprobs(model, batch, temperature)
    return [logp[i, : r.shape[0]].clone() for i, r in enumerate(responses)]


def group_advantages(
    algorithm: AlgorithmSettings,
    rewards: Tensor,
    group_ids: Sequence[int],
    lengths: Sequence[int],
) -> list[Tensor]:
    """Per-token advantages of whole groups (outcome estimators: one value per sequence)."""
    return padded_advantages(algorithm, rewards, group_ids, lengths).rows()


def padded_advantages(
    algorithm: AlgorithmSettings,
    rewards: Tensor,
    group_ids: Sequence[int],
    lengths: Sequence[int],
) -> PaddedRows:
    """``group_advantages`` as one padded tensor (what the trainer trains on: no tensor per row)."""
    width = max(1, max(lengths))
    counts = torch.tensor(list(lengths), dtype=torch.long)
    mask = torch.arange(width) < counts.unsqueeze(1)
    estimator = {
        "grpo": grpo_advantages,
        "dr_grpo": dr_grpo_advantages,
        "rloo": rloo_advantages,
    }[algorithm.advantage]
    out = estimator(rewards.float(), torch.tensor(list(group_ids)), mask).advantages
    # zeros after each row, +0.0 where the estimator left -0.0 (a negative value x 0)
    return PaddedRows(out.float().masked_fill(~mask, 0.0), counts)


def oldest_versions(token_versions: Sequence[Tensor], stored: Sequence[int]) -> list[int]:
    """Each sample's oldest token version (its ``stored`` version when it has no token): one
    copy and one reduction for the whole batch."""
    oldest = torch.tensor(list(stored), dtype=torch.long)
    lengths = torch.tensor([int(t.shape[0]) for t in token_versions], dtype=torch.long)
    if int(lengths.sum()):
        rows = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
        flat = torch.cat(list(token_versions)).long()
        start = torch.full_like(oldest, torch.iinfo(torch.long).max)
        oldest = torch.where(lengths > 0, start.scatter_reduce(0, rows, flat, "amin"), oldest)
    versions: list[int] = oldest.tolist()
    return versions


def loss_config(algorithm: AlgorithmSettings, staleness: int = 0) -> PPOLossConfig:
    """The ``rl`` loss of a run's settings at ``staleness`` (which resolves ``anchor="auto"``)."""
    correction = None
    if algorithm.is_level != "none":
        correction = OffPolicyCorrection(
            is_level=algorithm.is_level,  # type: ignore[arg-type]
            is_threshold=algorithm.is_threshold,
        )
    return PPOLossConfig(
        clip_low=algorithm.clip_low,
        clip_high=algorithm.clip_high,
        agg=algorithm.agg,  # type: ignore[arg-type]
        kl_coef=algorithm.kl_coef,
        kl_estimator=algorithm.kl_estimator,  # type: ignore[arg-type]
        entropy_coef=algorithm.entropy_coef,
        correction=correction,
        anchor=algorithm.anchor_of(staleness),  # type: ignore[arg-type]
    )


@attrs.frozen
class Piece:
    """What ``Learner.accumulate`` did with one piece of a streamed batch: its weight in the
    loss's normaliser and its loss metrics."""

    weight: float
    metrics: dict[str, float]


class Learner:
    """The trainer's model and optimizer, and one global batch of mini-batch PPO updates."""

    def __init__(
        self,
        spec: RunSpec,
        task: Task,
        *,
        resume: str | None = None,
        shared: tuple[Any, Any] | None = None,
    ) -> None:
        self.spec = spec
        path = os.path.join(resume, POLICY_FILE) if resume else None
        self.model, self.tokenizer = shared or build_policy(spec.model, task, path=path)
        self.model.train()
        # torch's AdamW update without torch.optim's wrappers (their torch._dynamo import
        # was a third of a small run's first step): ``_adamw``
        self.optimizer = DirectAdamW(
            self.model.parameters(), lr=spec.train.lr, weight_decay=spec.train.weight_decay
        )
        self.loss = loss_config(spec.algorithm, spec.staleness)
        self.generator = torch.Generator().manual_seed(spec.train.seed)
        if resume:
            load_optimizer(self.optimizer, self.generator, os.path.join(resume, OPTIMIZER_FILE))
        # The RNG states after the last finished step: what a checkpoint saves (the next
        # step may have drawn from them already while it waits to update).
        self.rng_state = (torch.get_rng_state(), self.generator.get_state())

    def state_dict(self) -> dict[str, Tensor]:
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def step(self, data: Mapping[str, Any]) -> dict[str, float]:
        """Train on one global batch: ``mini_batches`` updates, ``epochs`` times. ``data`` holds
        per-sample lists (``prompt_ids`` expanded per sample; a per-token column may also be
        ``PaddedRows``) and a ``rewards`` tensor."""
        updates = self.updates(data)
        next(updates)
        return finish(updates)

    def updates(self, data: Mapping[str, Any]) -> Generator[None, None, dict[str, float]]:
        """``step`` in two parts: it yields once, right before the batch's first optimizer step
        (its first forward and backward done), and returns the metrics. Until it is resumed the
        parameters, the optimizer state and ``rng_state`` are those of the last finished step:
        the trainer reads them for a weight sync or a checkpoint meanwhile."""
        train, temperature = self.spec.train, self.spec.rollout.temperature
        responses = data["response_ids"]
        n = len(responses)
        sums: dict[str, float] = {}
        updates = 0
        chunks = max(1, min(train.mini_batches, n))
        # ``trainer_forward``: the old log-probs are this policy's before the batch's first
        # update. With one update they are the update's own forward, detached (no second
        # forward); with several, one no-grad forward over the batch fixes them first.
        reuse = self.spec.trainer_forward and chunks * train.epochs == 1
        if self.spec.trainer_forward and not reuse:
            old = sequence_logprobs(self.model, data["prompt_ids"], responses,
                                    pad_id=self.tokenizer.pad_id, temperature=temperature)  # fmt: skip
            data = {**data, "old_logprobs": old}
        rows = MiniBatches(data, self._columns(reuse), self.tokenizer.pad_id)
        for _ in range(train.epochs):
            order = torch.randperm(n, generator=self.generator)
            for k in range(chunks):
                index = order[k * n // chunks : (k + 1) * n // chunks]
                result = self._loss(rows, index, reuse)
                self.optimizer.zero_grad(set_to_none=True)
                torch.autograd.backward(result.loss)
                norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), train.max_grad_norm)
                if updates == 0:
                    yield
                self.optimizer.step()
                updates += 1
                for key, value in result.metrics.items():
                    sums[key] = sums.get(key, 0.0) + float(value)
                sums["grad_norm"] = sums.get("grad_norm", 0.0) + float(norm)
        metrics = {key: value / updates for key, value in sums.items()}
        metrics["updates"] = float(updates)
        self.rng_state = (torch.get_rng_state(), self.generator.get_state())
        return metrics

    def _columns(self, reuse: bool) -> list[str]:
        names = ["advantages", "behaviour_logprobs"]
        return (
            names
            + ([] if reuse else ["old_logprobs"])
            + (["ref_logprobs"] if self.spec.use_ref else [])
        )

    def _loss(self, rows: MiniBatches, index: Tensor, reuse: bool) -> Any:
        """The ``rl`` policy loss of the rows at ``index`` (its forward, not its backward)."""
        batch = rows.batch(index)
        width = batch.response_length

        def column(name: str) -> Tensor:
            return rows.column(name, index, width)

        with_entropy = self.loss.entropy_coef > 0
        forward = policy_token_logprobs(
            self.model, batch, self.spec.rollout.temperature, with_entropy=with_entropy
        )
        logprobs = forward.logprobs
        return policy_loss(
            logprobs,
            logprobs.detach() if reuse else column("old_logprobs"),
            column("advantages"),
            batch.response_mask,
            self.loss,
            behaviour_logprobs=column("behaviour_logprobs"),
            ref_logprobs=column("ref_logprobs") if self.spec.use_ref else None,
            entropy=forward.entropy,
        )

    def accumulate(self, data: Mapping[str, Any], *, first: bool) -> Piece:
        """One piece (whole groups) of a streamed global batch (``RunSpec.streams_updates``):
        its forward and backward, its gradient added to those of the pieces before it
        (``first``: none), scaled by its share of the loss's normaliser — its loss tokens or
        its non-empty sequences, by ``agg`` — so that ``apply``, dividing by the
        total, takes the very step one update over the whole batch would (up to float
        rounding). Parameters, optimizer state and RNG are untouched (a sync may read them)."""
        if first:
            self.optimizer.zero_grad(set_to_none=True)
        reuse = self.spec.trainer_forward
        rows = MiniBatches(data, self._columns(reuse), self.tokenizer.pad_id)
        result = self._loss(rows, torch.arange(len(data["response_ids"])), reuse)
        mask = result.loss_mask
        # token-mean: a mean over the loss tokens; the seq-mean modes: over the non-empty
        # sequences (``streams_updates`` leaves out the mode with a constant normaliser)
        if self.loss.agg == "token-mean":
            weight = float(mask.sum())
        else:
            weight = float((mask.sum(dim=1) > 0).sum())
        torch.autograd.backward(result.loss * weight)
        return Piece(weight, dict(result.metrics))

    def apply(self, pieces: Sequence[Piece]) -> dict[str, float]:
        """The optimizer step of a streamed global batch: the gradient ``accumulate`` summed,
        divided by the total normaliser, clipped; the metrics averaged over the pieces by their
        weights (``valid_tokens`` summed)."""
        total = sum(p.weight for p in pieces)
        params = [p for p in self.model.parameters() if p.grad is not None]
        if total > 0:
            for param in params:
                assert param.grad is not None
                param.grad.div_(total)
        norm = torch.nn.utils.clip_grad_norm_(params, self.spec.train.max_grad_norm)
        self.optimizer.step()
        metrics: dict[str, float] = {}
        for piece in pieces:
            share = piece.weight / total if total > 0 else 1.0 / len(pieces)
            for key, value in piece.metrics.items():
                metrics[key] = metrics.get(key, 0.0) + (
                    value if key == "valid_tokens" else value * share
                )
        metrics["grad_norm"] = float(norm)
        metrics["updates"] = 1.0
        metrics["pieces"] = float(len(pieces))
        self.rng_state = (torch.get_rng_state(), self.generator.get_state())
        return metrics

    def save(self, directory: str, meta: Mapping[str, Any]) -> None:
        """Model (with tokenizer), optimizer state, RNG and ``meta`` (JSON) under ``directory``."""
        os.makedirs(directory, exist_ok=True)
        if isinstance(self.model, TinyDecoder):
            save_tiny_policy(self.model, self.tokenizer, self.spec.model, directory)
        else:
            from ._hf_policy import save_hf_policy

            save_hf_policy(self.model, self.tokenizer, directory)
        save_optimizer(
            self.optimizer, self.rng_state, os.path.join(directory, OPTIMIZER_FILE), meta
        )


def finish(updates: Generator[None, None, dict[str, float]]) -> dict[str, float]:
    """Run the rest of a ``Learner.updates`` (resumed after its yield); its metrics."""
    try:
        next(updates)
    except StopIteration as end:
        metrics: dict[str, float] = end.value
        return metrics
    raise AssertionError("Learner.updates yields once")


def save_optimizer(
    optimizer: torch.optim.Optimizer | DirectAdamW,
    rng: tuple[Tensor, Tensor],
    path: str,
    meta: Mapping[str, Any],
) -> None:
    """An optimizer's state and ``rng`` (the global and the training generator's states) as
    safetensors (tensors) + JSON metadata (no pickle)."""
    state = optimizer.state_dict()
    tensors: dict[str, Tensor] = {"rng.torch": rng[0], "rng.train": rng[1]}
    scalars: dict[str, dict[str, Any]] = {}
    for pid, entry in state["state"].items():
        for key, value in entry.items():
            if isinstance(value, Tensor):
                tensors[f"state.{pid}.{key}"] = value.detach().contiguous()
            else:
                scalars.setdefault(str(pid), {})[key] = value
    metadata = {
        "param_groups": json.dumps(state["param_groups"]),
        "scalars": json.dumps(scalars),
        "meta": json.dumps(dict(meta)),
    }
    save_safetensors(path, tensors, metadata=metadata)


def load_optimizer(
    optimizer: torch.optim.Optimizer | DirectAdamW, generator: torch.Generator, path: str
) -> dict[str, Any]:
    """Restore what ``save_optimizer`` wrote; returns its ``meta``."""
    content = load_safetensors(path)
    state: dict[int, dict[str, Any]] = {}
    for name, tensor in content.tensors.items():
        if name.startswith("state."):
            _, pid, key = name.split(".", 2)
            state.setdefault(int(pid), {})[key] = tensor.clone()
    for pid, values in json.loads(content.metadata["scalars"]).items():
        state.setdefault(int(pid), {}).update(values)
    optimizer.load_state_dict(
        {"state": state, "param_groups": json.loads(content.metadata["param_groups"])}
    )
    torch.set_rng_state(content.tensors["rng.torch"].clone())
    generator.set_state(content.tensors["rng.train"].clone())
    meta: dict[str, Any] = json.loads(content.metadata["meta"])
    return meta
