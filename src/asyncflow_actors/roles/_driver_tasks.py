"""The Driver's part in a user's task: prompts from a dataset (rendered with the chat template,
checked for length once, before any is admitted), their records, groups dropped by a failing
reward, and evaluations during training.

- **Prompts.** A dataset task is prepared here, in the driver process, when the run starts
  (``DatasetTask.prepare``): ``overlong = "error"`` fails the run before any worker starts,
  ``"filter"`` counts and reports the prompts it drops once (a warning, and
  ``dataset/filtered_prompts`` in the first step record).
- **Dropped groups** (``reward.on_error = "drop"``): their slots are freed and other prompts
  admitted; the step record says how many (``reward/dropped_groups``). A fatal one
  (``"raise"``) fails the run with its one line (``RewardFailed``).
- **Evaluation.** Every ``eval.every`` steps one rollout worker evaluates (``Evaluate``) while
  training goes on; its figures join the next step record (the last step's, awaited, its own).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import trio

from ..tasks._dataset import PreparedPrompts
from ._messages import Evaluate, Evaluated, GroupDropped, StepDone
from ._reward import record_json
from ._settings import RunSpec

log = logging.getLogger("asyncflow_actors.roles")

EVAL_TIMEOUT_S = 600.0


def prompt_limit(spec: RunSpec) -> int | None:
    """The longest prompt (tokens, BOS included): ``task.dataset.max_prompt_length``, or for
    the built-in model its context less ``rollout.max_new_tokens``."""
    given = spec.task.dataset.max_prompt_length
    if given is not None:
        return given
    if spec.model.hf is None and spec.model.init is None:
        return spec.model.max_seq_len - spec.rollout.max_new_tokens
    return None


class DriverTasks:
    """See the module docstring; built by ``open`` in a worker thread."""

    def __init__(self, spec: RunSpec) -> None:
        self.spec = spec
        self.prompts: PreparedPrompts | None = None
        self.eval_prompts: tuple[str, ...] = ()
        self.eval_records: tuple[str, ...] = ()
        self.dropped = 0
        self._reported_filter = False
        self._results: list[Evaluated] = []
        self._send, self._receive = trio.open_memory_channel[int](math.inf)

    @classmethod
    def open(cls, spec: RunSpec, task: Any, tokenizer: Any) -> DriverTasks:
        """Prepare the prompts and the evaluation set (raises ``TaskError``), and import the
        reward functions once here, so that a bad path fails the run before it starts."""
        from ..tasks import DatasetTask, load_function, read_records

        self = cls(spec)
        for path in spec.task.reward:
            load_function(path)
        limit = prompt_limit(spec)
        prepare = getattr(task, "prepare", None)
        if prepare is not None:
            self.prompts = prepare(tokenizer, limit)
        if spec.eval.every:
            n = spec.eval.samples
            if spec.eval.dataset is not None:
                data = DatasetTask(spec.task.dataset, read_records(spec.task.dataset,
                                                                   spec.eval.dataset))  # fmt: skip
                problems = list(data.prepare(tokenizer, limit, shuffle=False).problems[:n])
            elif self.prompts is not None:
                problems = list(self.prompts.problems[:n])
            else:
                problems = task.sample(n, spec.task.seed * 1_000_003 + 999_983)
            self.eval_prompts = tuple(p.prompt for p in problems)
            self.eval_records = tuple(record_json(p) for p in problems)
        return self

    def problem(self, index: int) -> Any | None:
        """The run's ``index``-th prompt of a prepared dataset (None: the task draws it)."""
        return None if self.prompts is None else self.prompts.problem(index)

    def on_dropped(self, msg: GroupDropped) -> None:
        """Count a dropped group; raise ``RewardFailed`` for a fatal one."""
        from ..tasks import RewardFailed

        if msg.fatal:
            raise RewardFailed(msg.reason)
        self.dropped += 1
        log.info("group %d dropped by %s: %s", msg.group_id, msg.worker, msg.reason)

    def with_metrics(self, msg: StepDone) -> StepDone:
        """``msg`` with this step's task figures: dropped groups, the filtered prompts (once),
        the evaluations finished since the last step."""
        import attrs

        metrics = dict(msg.metrics)
        if self.spec.reward.on_error == "drop" or self.dropped:  # so far in the run
            metrics["reward/dropped_groups"] = float(self.dropped)
        if self.prompts is not None and not self._reported_filter:
            self._reported_filter = True
            metrics["dataset/filtered_prompts"] = float(self.prompts.filtered)
            metrics["dataset/truncated_prompts"] = float(self.prompts.truncated)
        for result in self._results:
            metrics.update(result.metrics)
            metrics["eval_version"] = float(result.version)
        self._results.clear()
        return attrs.evolve(msg, metrics=metrics)

    def eval_due(self, steps_done: int) -> bool:
        every = self.spec.eval.every
        return bool(every) and bool(self.eval_prompts) and steps_done % every == 0

    def request_eval(self, steps_done: int) -> None:
        """Have ``serve`` evaluate (training goes on meanwhile)."""
        self._send.send_nowait(steps_done)

    async def serve(self, hooks: Any) -> None:
        """The Driver's evaluation task: one evaluation at a time, as requested."""
        async for _ in self._receive:
            await self.evaluate(hooks)

    async def evaluate(self, hooks: Any) -> None:
        """Ask the first rollout worker to evaluate; keep its figures for the next record. A
        failed evaluation is logged, the run goes on."""
        rollouts = getattr(hooks, "rollouts", None)
        if not rollouts:
            return
        n = 1 if self.spec.eval.greedy else self.spec.rollout.group_size
        request = Evaluate(self.eval_prompts, self.eval_records, n, self.spec.eval.pass_threshold)
        try:
            with trio.fail_after(EVAL_TIMEOUT_S):
                result = await rollouts[0].ask(request)
        except Exception as exc:
            log.warning("evaluation failed: %r", exc)
            return
        self._results.append(result)
