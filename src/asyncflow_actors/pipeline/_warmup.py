"""A run's supervised warm-up (``train.sft_warmup_steps``): run once, before the roles start.

A new run with ``sft_warmup_steps > 0`` warms its initial policy up in the trainer's process
(``roles._warmup``), into ``run_dir/warmup/policy.safetensors``, and records what it did in
``run_dir/warmup/warmup.json``; every role then starts from that file (their ``model.init``),
the reference policy of a KL penalty included. The Driver keeps the run's own ``[model]``: what
a checkpoint records and a resume compares. A resume finds the warm-up there and never runs it
again: its weights are the checkpoint's.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

import attrs
import trio

from ..actors import ActorCrashed, Restart
from ..roles._settings import RunSpec
from ..roles._warmup import WarmedUp, WarmUp, WarmUpPolicy
from ._config import PipelineConfig, PipelineConfigError

if TYPE_CHECKING:  # preflight imports this module: it stays light (no queue, no stations)
    from ._placement import Placement
    from ._report import Progress

WARMUP = "warmup"  # the warm-up's folder under run_dir
POLICY = "policy.safetensors"
RECORD = "warmup.json"


def warm_policy(run_dir: str) -> str:
    """The warmed-up policy's file of the run in ``run_dir`` (absolute: nodes have their own
    working directories)."""
    return os.path.abspath(os.path.join(run_dir, WARMUP, POLICY))


def warms_up(config: PipelineConfig) -> bool:
    return config.train.sft_warmup_steps > 0


def roles_spec(config: PipelineConfig, spec: RunSpec) -> RunSpec:
    """The spec the roles start from: ``model.init`` is the warmed-up policy when the run
    warms up, else ``spec`` itself."""
    if not warms_up(config):
        return spec
    assert config.run_dir is not None  # PipelineConfig requires one
    model = attrs.evolve(spec.model, init=warm_policy(config.run_dir))
    return attrs.evolve(spec, model=model)


def read_warmup(run_dir: str) -> WarmedUp | None:
    """The warm-up recorded in ``run_dir`` (``None``: none, or unreadable)."""
    try:
        with open(os.path.join(run_dir, WARMUP, RECORD), encoding="utf-8") as f:
            return WarmedUp.from_json(json.load(f))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check_warmup(config: PipelineConfig, task: Any, *, resume: str | None) -> None:
    """Preflight: a new run's task has reference answers to learn; a resume finds the
    warm-up of the run it continues (``PipelineConfigError`` otherwise)."""
    if not warms_up(config):
        return
    assert config.run_dir is not None
    if resume is not None:
        if read_warmup(config.run_dir) is None or not os.path.isfile(warm_policy(config.run_dir)):
            raise PipelineConfigError(
                f"train.sft_warmup_steps: {config.run_dir} holds no warm-up "
                f"({WARMUP}/{RECORD}, {WARMUP}/{POLICY}) and a resume never warms up: resume "
                "with the run_dir of the run that warmed up, or set sft_warmup_steps = 0"
            )
        return
    try:
        problems = task.sample(8, config.task.seed)
    except ValueError as exc:  # rl.TaskError: e.g. a dataset without an answer column
        raise PipelineConfigError(f"train.sft_warmup_steps: {exc}") from exc
    if not problems or not all(p.answer for p in problems):
        raise PipelineConfigError(
            "train.sft_warmup_steps: the task's problems have no reference answers to learn"
        )


async def warm_up(
    place: Placement, config: PipelineConfig, spec: RunSpec, progress: Progress
) -> WarmedUp | None:
    """Warm a new run's policy up where its trainer will run (``roles.WarmUp``), record it and
    say so on ``progress``; a resume's recorded warm-up (never run again); ``None`` without."""
    if not warms_up(config) or spec.resume_from is not None:
        await trio.lowlevel.checkpoint()
        return read_warmup(config.run_dir) if config.run_dir and warms_up(config) else None
    assert config.run_dir is not None  # PipelineConfig requires one
    ref = await place.spawn(
        WarmUp, role="trainer", worker="trainer-0", kwargs={"spec": spec},
        restart=Restart.TEMPORARY, name=f"warmup.{place.suffix}",
    )  # fmt: skip
    from ._placement import RunFailed

    try:
        done = await ref.ask(WarmUpPolicy(warm_policy(config.run_dir)))
    except Exception as exc:
        raise RunFailed("warmup", exc) from exc
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(10):
            try:
                await ref.stop()
            except ActorCrashed:
                pass  # gone already: its error is the one raised
    await trio.to_thread.run_sync(_record, config.run_dir, done)
    target = config.train.sft_warmup_accuracy
    goal = f" (target {target:.0%})" if target < 1 else ""
    progress.note(
        f"SFT warm-up: {done.steps} steps in {done.seconds:.0f} s, held-out greedy exact "
        f"{done.accuracy:.0%}{goal}"
    )
    return done


def _record(run_dir: str, done: WarmedUp) -> None:
    path = os.path.join(run_dir, WARMUP, RECORD)
    with open(path + ".partial", "w", encoding="utf-8") as f:
        json.dump(done.to_json(), f, indent=1)
    os.replace(path + ".partial", path)
