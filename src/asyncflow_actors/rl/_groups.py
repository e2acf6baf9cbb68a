"""One call from problems to a scored, packed GRPO batch: sample a group per problem, score it,
pack it, with the group ids the advantage estimators want."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch
from torch import Tensor

from ..models import CharTokenizer, PackedBatch, SamplingParams, TinyDecoder, generate, pack_batch
from ._errors import RLInputError
from ._evaluate import encode_prompts
from ._tasks import Problem, Task, score_responses

__all__ = ["ScoredGroups", "sample_groups", "score_group"]


@attrs.frozen
class ScoredGroups:
    """``group_size`` responses to each problem, scored and packed for training.

    Rows are problem-major (the responses to ``problems[0]`` first). ``batch`` is the
    ``PackedBatch`` (``models.token_logprobs(model, batch)`` gives the trainer's logprobs);
    ``behaviour_logprobs`` [B, R] are the sampler's own (0 on padding); ``rewards`` [B];
    ``group_ids`` [B] the problem's position; ``texts`` the decoded responses.
    """

    problems: tuple[Problem, ...]
    batch: PackedBatch
    behaviour_logprobs: Tensor
    rewards: Tensor
    group_ids: Tensor
    texts: tuple[str, ...]

    @property
    def group_size(self) -> int:
        return len(self.texts) // len(self.problems)


def score_group(
    task: Task, tokenizer: CharTokenizer, problem: Problem, responses: Sequence[Sequence[int]]
) -> Tensor:
    """Rewards [n] of response token ids (decoded up to ``<eos>``) to one ``problem``."""
    texts = [tokenizer.decode(list(ids)) for ids in responses]
    return score_responses(task, [problem] * len(texts), texts)


def sample_groups(
    model: TinyDecoder,
    task: Task,
    tokenizer: CharTokenizer,
    problems: Sequence[Problem],
    *,
    group_size: int,
    params: SamplingParams,
    generator: torch.Generator | None = None,
) -> ScoredGroups:
    """Sample ``group_size`` responses per problem with ``model``, score and pack them."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise RLInputError(f"group_size must be a positive int, got {group_size!r}")
    if not problems:
        raise RLInputError("sample_groups needs at least one problem")
    repeated = [p for p in problems for _ in range(group_size)]
    with torch.no_grad():
        out = generate(
            model,
            encode_prompts(tokenizer, repeated),
            params,
            pad_id=tokenizer.pad_id,
            eos_id=tokenizer.eos_id,
            generator=generator,
        )
    responses = out.responses()
    texts = tuple(tokenizer.decode(ids) for ids in responses)
    batch = pack_batch(encode_prompts(tokenizer, repeated), responses, pad_id=tokenizer.pad_id)
    behaviour = torch.zeros(batch.response_mask.shape, dtype=torch.float32)
    width = min(int(out.logprobs.shape[1]), batch.response_length)
    behaviour[:, :width] = (out.logprobs * out.response_mask)[:, :width]
    return ScoredGroups(
        problems=tuple(problems),
        batch=batch,
        behaviour_logprobs=behaviour,
        rewards=score_responses(task, repeated, list(texts)),
        group_ids=torch.arange(len(problems)).repeat_interleave(group_size),
        texts=texts,
    )
