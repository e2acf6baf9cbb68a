"""The soak (issue #27 §5): a whole run under random faults, judged from its per-sample ledger.

A real pipeline run of the tiny built-in model on the addition task (one process per role:
rollout, a Reward actor, ActorForward, RefForward, Advantage, the Trainer; two TransferQueue
storage units in processes of their own) for ``--minutes``, while ``asyncflow_actors.testing``'s
``FaultSchedule`` (seeded) injects a random fault every ``--every`` seconds: ``kill -9`` of a
station's node or of a storage unit, a stall (SIGSTOP) of a station, a cut, a blip or a delay
of the driver's link to a node, ``kill -9`` of the Trainer's node (the run resumes it:
``train.auto_resume``); ``--kinds`` picks. ``--placement folded`` runs the layout
``docs/pipeline.md`` recommends for small models instead: ActorForward and Advantage folded into
the Trainer (``placement.roles.actor_fwd = advantage = "trainer"``), so their kills are kills of
the Trainer's process (``--targets actor_fwd-0`` hits it; each fault's line names what its
process held). Then the run is stopped and judged:

- ``soak_faults_injected`` and ``soak_faults_<kind>``: what was done;
- ``soak_samples_lost`` (prompts admitted whose fate the ledger does not record; target 0),
  ``soak_samples_duplicated`` (samples trained twice; target 0), ``soak_samples_stale``
  (trained outside the staleness bound; target 0), ``soak_prompts_retrained`` (prompts trained
  in two attempts; target 0);
- ``soak_recovery_s_p50`` / ``_p99``: seconds from a fault to the next completed step
  (``soak_unrecovered``: faults no step followed);
- ``soak_steps_per_min``, against an undisturbed run of the same configuration in the same
  sitting (``baseline``, ``ratio``; ``--baseline-minutes``, 0 to skip);
- ``soak_finished`` (the run reached its clean stop) and ``soak_leaks`` (processes, threads,
  sockets, ``/dev/shm`` segments left).

Exit status 1 if anything was lost, duplicated or stale, the run did not finish, a fault was
never followed by a step, or anything leaked; 2 if this asyncflow_actors has no ledger.

``nox -s soak -- --minutes 30`` or ``python benchmarks/soak.py [--minutes N] [--every S]
[--seed N] [--kinds kill_role,stall,...] [--targets reward-0,...] [--placement process|folded]
[--baseline-minutes M] [--run-dir DIR]``
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any

import trio

from asyncflow_actors import testing as aft
from asyncflow_actors.pipeline import PipelineConfig

# the role placements the soak runs: one process per role, or ActorForward and Advantage folded
# into the Trainer (docs/pipeline.md §1, "Folding stations into the trainer")
PLACEMENTS: dict[str, dict[str, str]] = {
    "process": {},
    "folded": {"actor_fwd": "trainer", "advantage": "trainer"},
}


def soak_config(run_dir: str, placement: str = "process") -> PipelineConfig:
    """The soak's run: the tiny model, every role (``placement``: or ActorForward and
    Advantage folded into the Trainer) and storage unit in a process of its own, steps without
    end (the soak stops it), every Trainer death resumed from a checkpoint of the last 5 steps."""
    table: dict[str, Any] = {
        "mode": "async",
        "staleness": 1,
        "run_dir": run_dir,
        "progress": "none",
        "plot": False,
        "model": {"d_model": 32, "n_layers": 1, "n_heads": 2, "max_seq_len": 16},
        "task": {"kind": "addition", "options": {"min_digits": 1, "max_digits": 2}},
        "rollout": {"group_size": 4, "max_new_tokens": 4, "max_batch": 32, "reward": "actor"},
        "algorithm": {"kl_coef": 0.01},  # a RefForward station too
        "train": {
            "steps": 10**9,
            "prompts_per_step": 4,
            "forward_batch": 8,
            "auto_resume": True,
            "auto_resume_retries": 10**6,
            "checkpoint_every": 5,
            "keep_last": 2,
        },
        "placement": {
            "default": "process",
            "tq_placement": "process",
            "tq_units": 2,
            "roles": PLACEMENTS[placement],
        },
    }
    return PipelineConfig.from_dict(table)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0, help="how long faults come (10)")
    p.add_argument("--every", type=float, default=20.0, help="seconds between faults (20)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--kinds",
        default=",".join(aft.FAULT_KINDS),
        help=f"fault kinds, comma-separated (default: all: {', '.join(aft.FAULT_KINDS)})",
    )
    p.add_argument(
        "--targets",
        default=None,
        help="hit only these, comma-separated (rollout-0, reward-0, unit-0...; a folded "
        "station's worker, actor_fwd-0, hits the process that holds it)",
    )
    p.add_argument(
        "--placement",
        default="process",
        choices=sorted(PLACEMENTS),
        help="process: one process per role (default); folded: ActorForward and Advantage "
        "in the Trainer's process",
    )
    p.add_argument(
        "--baseline-minutes",
        type=float,
        default=None,
        help="the undisturbed run (default: min(minutes, 3); 0: none)",
    )
    p.add_argument("--run-dir", default=None, help="where the runs write (default: a temp dir)")
    return p.parse_args(argv)


def emit(row: dict[str, Any]) -> None:
    print(json.dumps(row), flush=True)


def say(line: str) -> None:
    print(f"# {line}", file=sys.stderr, flush=True)


async def main(args: argparse.Namespace) -> int:
    try:
        aft.require_ledger()
    except aft.LedgerMissing as exc:
        say(f"error: {exc}")
        return 2
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    root = args.run_dir or tempfile.mkdtemp(prefix="afa-soak-")
    config = soak_config(os.path.join(root, "soak"), args.placement)
    try:
        only = None if args.targets is None else _targets(config, args.targets.split(","))
        schedule = aft.FaultSchedule(
            every=args.every, seed=args.seed, weights=dict.fromkeys(kinds, 1), only=only
        )
    except ValueError as exc:
        say(f"error: {exc}")
        return 2
    # the links the run will proxy: every node and unit (what open_link_faults opens)
    links = list(aft.roles_at(config))
    plan = schedule.plan(60 * args.minutes, aft.fault_targets(config, links=links))
    if not plan:
        say(f"error: no fault of {', '.join(kinds)} hits {args.targets or 'this run'} "
            f"in the {args.placement} placement")  # fmt: skip
        return 2
    for node, held in aft.roles_at(config).items():
        say(f"{node}: {', '.join(held)}")
    baseline_minutes = (
        min(args.minutes, 3.0) if args.baseline_minutes is None else args.baseline_minutes
    )
    baseline = None
    if baseline_minutes > 0:
        say(f"baseline: {baseline_minutes:g} min undisturbed")
        steady = soak_config(os.path.join(root, "baseline"), args.placement)
        baseline = await aft.run_soak(steady, None, seconds=60 * baseline_minutes)
        say(
            f"baseline: {baseline.steps} steps, finished {baseline.finished} {baseline.error or ''}"
        )
    say(
        f"soak: {args.minutes:g} min, {args.placement} placement, a fault every "
        f"{args.every:g} s ({', '.join(kinds)}): {len(plan)} planned"
    )
    result = await aft.run_soak(config, schedule, seconds=60 * args.minutes, on_fault=say)
    for row in result.metrics(baseline):
        emit(row)
    if result.error:
        say(f"the run did not finish: {result.error}")
    for what, seconds in zip(result.injected, result.recovery_s, strict=True):
        say(f"{what}: next step after {seconds:.2f} s")
    for what in result.skipped:
        say(f"fault not carried out: {what}")
    for name, ids in (("lost", result.lost), ("duplicated", result.duplicated),
                      ("stale", result.stale), ("retrained", result.retrained)):  # fmt: skip
        if ids:
            say(f"{name}: {len(ids)}, first: {', '.join(ids[:8])}")
    for leak in result.leaks:
        say(f"leak: {leak}")
    say(f"run directory: {root}")
    return 0 if result.ok else 1


def _targets(config: PipelineConfig, names: list[str]) -> list[str]:
    """The processes ``--targets`` names (a folded station's worker: the one holding it)."""
    out = []
    for name in (n.strip() for n in names if n.strip()):
        node = aft.target_node(config, name)
        if node != name:
            say(f"target {name} is in {node}'s process: its faults hit {node}")
        out.append(node)
    return out


if __name__ == "__main__":
    sys.exit(trio.run(main, parse()))
