"""Seconds from a process's launch to its first training step: ours (one process per role, and
every role in one process) against TRL's ``GRPOTrainer``, on ``peer_trl``'s model and task.

``python benchmarks/peer_first_step.py [--rounds 5] [--task addition] [-- OURS_ARGS...]`` in a
venv with both (``nox -s bench_peer_trl`` runs it after ``peer_trl.py``). The model is
``peer_trl.build``'s with a short warm-up (``--quick``'s: the same architecture and sizes; a
first step's cost does not depend on how well the model is warmed up). Each round launches a
fresh process of each side (``peer_trl.py --child ... --steps 3``), the order rotating from
round to round; a side's figure is the median over the rounds of the time its first step was
reported, counted from just before its launch (the interpreter, imports, model load, the first
generation, update and, for ours, the node processes' start). TRL runs on its best torch
thread count (measured first, as ``peer_trl`` does). Our side runs ``peer_trl``'s defaults
(``model.impl = "native"``, staleness 1); ``-- --impl hf`` runs transformers' model instead.

JSON lines: ``peer_trl_first_step_process`` and ``peer_trl_first_step_local`` (``value`` ours,
s; ``baseline`` TRL, s; ``ratio``); a ``#`` line with every run's seconds and the load average.
Issue 28's targets: <= 6 s with one process per role, <= 3 s in one process (absolute seconds:
quote them with the machine's speed, i.e. next to TRL's of the same sitting).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

import peer_trl
from common import emit

SIDES = ("trl", "process", "local")


def first_steps(task: str, rounds: int, ours: tuple[str, ...]) -> dict[str, list[float]]:
    """Every side's seconds to its first step, ``rounds`` fresh processes each, rotated."""
    with tempfile.TemporaryDirectory(prefix="peer-first-") as workdir:
        folder = os.path.join(workdir, task, "model")
        peer_trl.build(task, folder, quick=True)
        threads = peer_trl.best_threads(task, folder)
        seconds: dict[str, list[float]] = {side: [] for side in SIDES}
        for index in range(rounds):
            order = SIDES[index % len(SIDES) :] + SIDES[: index % len(SIDES)]
            for side in order:
                child = "trl" if side == "trl" else "ours"
                args = () if side == "trl" else (*ours, "--placement", side)
                run = peer_trl.one_run(child, task, folder, index + 1, threads, 3, args)
                if run["first"] is None:
                    raise SystemExit(f"peer_first_step: {side} reported no step (seed {index + 1})")
                seconds[side].append(float(run["first"]))
        print(f"# first step, s per round: {seconds}; TRL on {threads} torch threads; "
              f"load average {os.getloadavg()[0]:.1f}", file=sys.stderr)  # fmt: skip
        return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description="seconds to the first step: ours against TRL")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--task", default="addition", choices=sorted(peer_trl._tasks()))
    parser.add_argument("ours", nargs="*", help="after --: more arguments for our side's child")
    args = parser.parse_args()
    seconds = first_steps(args.task, args.rounds, tuple(args.ours))
    trl = statistics.median(seconds["trl"])
    for side in ("process", "local"):
        emit(f"peer_trl_first_step_{side}", statistics.median(seconds[side]), "s", trl)


if __name__ == "__main__":
    main()
