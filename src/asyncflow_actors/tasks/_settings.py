"""The wire-safe settings of a user's task: its dataset, how its rewards are called, its
evaluation. Sections of ``PipelineConfig`` (``[task.dataset]``, ``[reward]``, ``[eval]``) and of
the ``RunSpec`` every role gets; plain fields only, so they cross the wire and land in
``config.json`` as they are."""

from __future__ import annotations

from typing import Any

import attrs

__all__ = ["DatasetSettings", "EvalSettings", "RewardSettings", "TaskSettingsError"]


class TaskSettingsError(ValueError):
    """A dataset, reward or evaluation setting is out of range; the message names the key."""


def _one_of(*choices: str) -> Any:
    def check(inst: object, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value not in choices:
            raise TaskSettingsError(
                f"{attribute.name} must be one of {list(choices)}, got {value!r}"
            )

    return check


def _positive(inst: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise TaskSettingsError(f"{attribute.name} must be a number > 0, got {value!r}")


def _non_negative_int(inst: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TaskSettingsError(f"{attribute.name} must be an int >= 0, got {value!r}")


_optional_positive = attrs.validators.optional(_positive)


@attrs.frozen
class DatasetSettings:
    """Where a ``task.kind = "dataset"`` task reads its prompts, and how.

    ``path``: a ``.jsonl`` file, a ``.parquet`` file, or a folder written by
    ``datasets.Dataset.save_to_disk`` (or a ``DatasetDict``'s: ``split`` picks one); ``format``
    ``"auto"`` decides by the path. Columns are renamed ``prompt_column`` -> ``prompt`` and
    ``answer_column`` -> ``answer`` (optional: a reward need not use it); every other column
    reaches the reward functions under its own name. A prompt is a string or a conversation
    (``[{"role": "user", "content": ...}]``, rendered with the tokenizer's chat template);
    ``system_prompt`` is put first. ``max_prompt_length`` (tokens, rendered; by default the
    built-in model's context less ``rollout.max_new_tokens``) with ``overlong``: ``"filter"``
    (dropped, counted and reported once), ``"truncate_left"`` (the end of the prompt is kept)
    or ``"error"`` (the run does not start). ``shuffle`` with ``seed``, reshuffled for every
    epoch over the dataset.
    """

    path: str | None = None
    format: str = attrs.field(default="auto", validator=_one_of("auto", "jsonl", "parquet", "hf"))
    split: str = "train"
    prompt_column: str = "prompt"
    answer_column: str | None = "answer"
    system_prompt: str | None = None
    max_prompt_length: int | None = attrs.field(default=None, validator=_optional_positive)
    overlong: str = attrs.field(
        default="filter", validator=_one_of("filter", "truncate_left", "error")
    )
    shuffle: bool = True
    seed: int = 0


@attrs.frozen
class RewardSettings:
    """How reward functions are called (``docs/tasks.md``).

    ``on_error``: a function that raises (or times out, or returns a malformed list)
    ``"raise"``: fails the run, one line naming the function, the error and a sample;
    ``"zero"``: its values for that call are 0.0; ``"drop"``: the groups of that call are not
    trained (counted in the step record's ``reward/dropped_groups``) and new prompts take
    their place. ``concurrency``: calls at once per process (sync functions run in worker
    threads, ``async def`` ones on an asyncio loop of their own thread: never on the
    rollout's event loop). ``timeout``: seconds per call (none by default).
    """

    on_error: str = attrs.field(default="raise", validator=_one_of("raise", "zero", "drop"))
    concurrency: int = attrs.field(default=4, validator=_positive)
    timeout: float | None = attrs.field(default=None, validator=_optional_positive)


@attrs.frozen
class EvalSettings:
    """Evaluation during training (``docs/tasks.md``): every ``every`` steps (0: never) a rollout
    engine generates ``samples`` prompts of ``dataset`` (a path as ``task.dataset.path``, read
    with the same columns and chat template; default: the training prompts), ``greedy`` (one
    response each) or sampled (``rollout.group_size`` each, with pass@k for ``k`` up to it).
    Its figures go into the step record as ``eval/<name>``."""

    dataset: str | None = None
    every: int = attrs.field(default=0, validator=_non_negative_int)
    samples: int = attrs.field(default=32, validator=_positive)
    greedy: bool = True
    pass_threshold: float = 1.0
