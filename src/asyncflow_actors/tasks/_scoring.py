"""Calling reward functions on generated groups, off the event loop, within limits.

``RewardRunner.score`` takes the groups that completed together and calls each function once
on all their samples (TRL's batched signature: ``fn(prompts=..., completions=..., **columns)``,
every column of the prompts' records by name). Sync functions run in worker threads, ``async
def`` ones on an asyncio loop in a thread of its own: never on the caller's trio loop. At most
``concurrency`` calls run at once; each is bounded by ``timeout``. What a failing call does is
``on_error``'s (``RewardSettings``); a failure never raises out of ``score`` except as
``RewardFailed`` under ``on_error = "raise"``.

A run without reward functions scores with its task (``task.score(problem, response)``, in
[0, 1]) through the same runner, as one function named after the task.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import trio

from ..rl import Problem, check_reward_values, weighted_rewards
from ._functions import function_name, load_function
from ._settings import RewardSettings

__all__ = ["GroupScore", "RewardFailed", "RewardRunner", "ToScore", "reward_columns"]

log = logging.getLogger("asyncflow_actors.tasks")


class RewardFailed(RuntimeError):
    """A reward function failed under ``on_error = "raise"``: the message names the function,
    its error and a sample it was scoring."""


@attrs.frozen
class ToScore:
    """One group to score: its prompt as generated (rendered), its record (the dataset's
    columns; ``prompt`` is the prompt as the dataset has it) and its responses' texts."""

    prompt: str
    record: Mapping[str, Any]
    texts: tuple[str, ...]


@attrs.frozen
class GroupScore:
    """A group's rewards (the weighted sum), each function's values per sample (``nan`` where a
    function gave ``None``), whether the group is dropped (``dropped``: why) and how many
    function calls failed for it (``errors``)."""

    rewards: tuple[float, ...]
    parts: tuple[tuple[float, ...], ...]  # [sample][function]
    dropped: str | None = None
    errors: int = 0


def reward_columns(record: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword columns of a record for a reward function: all but the prompt."""
    return {k: v for k, v in record.items() if k != "prompt"}


class RewardRunner:
    """The run's reward functions (import paths), weights and settings in one process."""

    def __init__(
        self,
        paths: Sequence[str],
        weights: Sequence[float] | None,
        settings: RewardSettings,
        *,
        task: Any = None,
    ) -> None:
        self.settings = settings
        if paths:
            self.functions: list[tuple[str, Callable[..., Any]]] = [
                (function_name(p), load_function(p)) for p in paths
            ]
        elif task is not None:
            self.functions = [(str(task.name), functools.partial(_task_reward, task))]
        else:
            raise ValueError("a RewardRunner needs reward functions or a task")
        self.weights = tuple(weights) if weights else (1.0,) * len(self.functions)
        self.names = tuple(name for name, _ in self.functions)
        self.limiter = trio.CapacityLimiter(settings.concurrency)
        self._loop: Any = None  # an AsyncioThread, started at the first async function
        self.calls = 0
        self.errors = 0

    def close(self) -> None:
        """Stop the asyncio thread, if one was started."""
        if self._loop is not None:
            self._loop.stop()
            self._loop = None

    async def score(self, groups: Sequence[ToScore]) -> list[GroupScore]:
        """Every group's score (see the module docstring). Raises ``RewardFailed``."""
        prompts: list[Any] = []
        completions: list[Any] = []
        columns: dict[str, list[Any]] = {}
        keys = sorted({k for g in groups for k in reward_columns(g.record)})
        for g in groups:
            raw = g.record.get("prompt", g.prompt)
            conversational = isinstance(raw, list)
            cols = reward_columns(g.record)
            for text in g.texts:
                prompts.append(raw)
                completions.append(
                    [{"role": "assistant", "content": text}] if conversational else text
                )
                for k in keys:
                    columns.setdefault(k, []).append(cols.get(k))
        n = len(prompts)
        parts: list[list[float | None]] = [[None] * n for _ in self.functions]
        failed: list[str] = []

        async def one(f: int) -> None:
            name, fn = self.functions[f]
            try:
                values = await self._call(fn, prompts, completions, columns)
                parts[f] = check_reward_values(name, values, n)
            except Exception as exc:
                self.errors += 1
                what = _describe_failure(name, exc, prompts, completions)
                if self.settings.on_error == "zero":
                    log.warning("%s (scored 0.0)", what)
                    parts[f] = [0.0] * n
                failed.append(what)

        async with trio.open_nursery() as nursery:
            for f in range(len(self.functions)):
                nursery.start_soon(one, f)
        if failed and self.settings.on_error == "raise":
            raise RewardFailed(failed[0])
        drop = failed[0] if failed and self.settings.on_error == "drop" else None
        if drop is not None:
            log.warning("%s (%d groups dropped)", drop, len(groups))
        totals = weighted_rewards(parts, self.weights)
        out = []
        at = 0
        for g in groups:
            size = len(g.texts)
            rows = tuple(
                tuple(_or_nan(values[i]) for values in parts) for i in range(at, at + size)
            )
            scores = tuple(totals[at : at + size])
            out.append(GroupScore(scores, rows, dropped=drop, errors=len(failed)))
            at += size
        return out

    async def _call(
        self,
        fn: Callable[..., Any],
        prompts: list[Any],
        completions: list[Any],
        columns: dict[str, list[Any]],
    ) -> Any:
        self.calls += 1
        call = functools.partial(fn, prompts=prompts, completions=completions, **columns)
        timeout = self.settings.timeout
        async with self.limiter:
            with trio.fail_after(math.inf if timeout is None else timeout):
                if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
                    getattr(fn, "__call__", None)  # noqa: B004
                ):
                    return await self._asyncio().call(call)
                result = await trio.to_thread.run_sync(call, abandon_on_cancel=True)
                if inspect.isawaitable(result):  # a sync wrapper returning a coroutine
                    return await self._asyncio().call(_awaited, result)
                return result

    def _asyncio(self) -> Any:
        if self._loop is None:
            from ..rollout._asyncio_bridge import AsyncioThread

            self._loop = AsyncioThread(name="afa-rewards")
            self._loop.start()
        return self._loop


def _or_nan(value: float | None) -> float:
    return math.nan if value is None else value


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def _task_reward(
    task: Any, *, prompts: list[Any], completions: list[Any], **columns: Any
) -> list[float]:
    """A task's per-sample ``score`` as a batched reward function (checked into [0, 1])."""
    from ..rl import score_responses

    answers = columns.get("answer") or [""] * len(prompts)
    problems = []
    for i, prompt in enumerate(prompts):
        metadata = {k: v[i] for k, v in columns.items()}
        problems.append(Problem(prompt=str(prompt), answer=str(answers[i]), metadata=metadata))
    return [float(x) for x in score_responses(task, problems, [str(c) for c in completions])]


def _describe_failure(
    name: str, exc: BaseException, prompts: list[Any], completions: list[Any]
) -> str:
    error = "timed out" if isinstance(exc, trio.TooSlowError) else f"raised {exc!r}"
    sample = ""
    if prompts:
        sample = f" (scoring {len(prompts)} samples, the first: prompt {_short(prompts[0])}, "
        sample += f"completion {_short(completions[0])})"
    return f"reward {name!r} {error}{sample}"


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
