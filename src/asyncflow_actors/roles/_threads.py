"""How many intra-op threads torch runs in a process of a run (``train.torch_threads``).

A number is used as given. ``"auto"`` reads the CPUs this process may run on
(``os.sched_getaffinity``) and the run's shape: on-policy (staleness 0) the rollout waits for
each step's weights and the trainer for each step's samples, so the two take turns and each
process may use every CPU while it computes (a streamed step's pieces overlap only the end of
the generation); otherwise rollout and training run at the same time and the CPUs are divided
among the run's processes (``RunSpec.processes``). It assumes the run's processes share this
machine's CPUs (nodes elsewhere: give a number).

A thread per CPU is not free: with more threads than idle CPUs, torch's threads wait for each
other (on a loaded machine a second thread can cost more than it brings: benchmarks/RESULTS.md),
hence 1 by default.
"""

from __future__ import annotations

import os

from ._settings import RunSpec

AUTO = "auto"


def available_cpus() -> int:
    """The CPUs this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def intra_op_threads(spec: RunSpec, cpus: int | None = None) -> int:
    """``spec.train.torch_threads`` for this process (``cpus``: default ``available_cpus``)."""
    threads = spec.train.torch_threads
    if threads != AUTO:
        return int(threads)
    cpus = available_cpus() if cpus is None else cpus
    if spec.staleness == 0:
        return cpus
    return max(1, cpus // max(1, spec.processes))
