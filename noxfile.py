"""Developer sessions: tests, lint, typecheck, bench, demo.

Every session installs the CPU build of torch pinned first, so that resolving the
project never pulls a multi-GB CUDA wheel on a CPU machine.
"""

from __future__ import annotations

import os

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["tests", "lint", "typecheck"]

TORCH = os.environ.get("AFA_TORCH_SPEC", "torch==2.13.0")


def _install(session: nox.Session, *extras: str) -> None:
    session.install(TORCH)
    spec = "." if not extras else f".[{','.join(extras)}]"
    session.install("-e", spec)


@nox.session
def tests(session: nox.Session) -> None:
    """Run the test suite (the README's test command)."""
    _install(session, "dev")
    session.run("pytest", "-q", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff>=0.6")
    session.run("ruff", "check", "src", "tests", "examples", "benchmarks", "noxfile.py")
    session.run("ruff", "format", "--check", "src", "tests", "examples", "benchmarks", "noxfile.py")


@nox.session
def typecheck(session: nox.Session) -> None:
    _install(session, "dev")
    session.run("mypy")


@nox.session
def bench(session: nox.Session) -> None:
    """Run every benchmark; each prints JSON lines {name, value, unit[, baseline, ratio]}."""
    _install(session, "dev")
    names = session.posargs or sorted(
        f[:-3] for f in os.listdir("benchmarks") if f.startswith("bench_") and f.endswith(".py")
    )
    session.env["PYTHONPATH"] = "benchmarks"
    for name in names:
        session.run("python", f"benchmarks/{name}.py")


@nox.session
def bench_peer(session: nox.Session) -> None:
    """The public transferqueue 0.1.11 on bench_tq's workload, in its own venv (not ours)."""
    session.install(TORCH)  # first: an unpinned torch pulls a multi-GB CUDA build
    session.install("transferqueue==0.1.11", "ray[default]==2.60.0", "tensordict==0.15.3")
    session.run("python", "benchmarks/peer_transferqueue.py", *session.posargs)


@nox.session
def bench_peer_trl(session: nox.Session) -> None:
    """Our pipeline against TRL's GRPOTrainer (trl 1.16.0) on the same model, prompts and
    reward, in its own venv (benchmarks/peer_trl.py)."""
    session.install(TORCH)  # first: an unpinned torch pulls a multi-GB CUDA build
    session.install("trl==1.16.0")
    session.install("-e", ".[hf,datasets]")
    session.env["PYTHONPATH"] = "benchmarks"
    session.run("python", "benchmarks/peer_trl.py", *session.posargs)


@nox.session
def demo(session: nox.Session) -> None:
    """The demo: SFT warm-up, then asynchronous GRPO of a tiny policy on CPU (a few minutes on
    2 cores); it prints the reward of every step and what the policy learned."""
    _install(session, "pipeline")
    session.run("python", "examples/addition_grpo.py", *session.posargs)
