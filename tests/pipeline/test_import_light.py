"""The driver process imports no torch before its nodes are launched (``pipeline._role_classes``):
``import asyncflow_actors.pipeline`` and its run module stay torch-free, and the roles' modules
are loaded in a worker thread once the nodes are starting."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncflow_actors import roles
from asyncflow_actors.pipeline import PipelineConfig, _start, run_pipeline
from asyncflow_actors.pipeline._role_classes import ROLE_MODULES, role_class

from .kit import tiny

# A run's whole start, in a fresh process: records when each node process was launched, and
# where and when this process imported torch (its first lookup's thread, the end of its
# import), then runs one step with the trainer on a node.
RUN = """
import json, sys, threading, time
import importlib.abc, importlib.machinery

torch: dict = {}

class Watch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "torch" or torch:
            return None
        torch["main_thread"] = threading.current_thread() is threading.main_thread()
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module
        def exec_module(module):
            run(module)
            torch["done"] = time.monotonic()
        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, Watch())
import trio
from asyncflow_actors.actors.remote import _launch
from asyncflow_actors.pipeline import PipelineConfig, run_pipeline

launched = []
launch = _launch.SubprocessLauncher.launch

async def recording(self, *args, **kwargs):
    launched.append(time.monotonic())
    return await launch(self, *args, **kwargs)

_launch.SubprocessLauncher.launch = recording
config = PipelineConfig.from_dict({
    "mode": "async", "progress": "none", "plot": False,
    "model": {"d_model": 32, "n_layers": 1, "n_heads": 2, "max_seq_len": 16},
    "task": {"kind": "addition", "options": {"min_digits": 1, "max_digits": 2}},
    "rollout": {"group_size": 4, "max_new_tokens": 4, "max_batch": 32},
    "train": {"steps": 1, "prompts_per_step": 4, "forward_batch": 8},
    "placement": {"default": "local", "roles": {"trainer": "t"}},
})
result = trio.run(run_pipeline, config)
print(json.dumps({
    "launched_before_torch": [t < torch["done"] for t in launched],
    "torch_on_the_main_thread": torch["main_thread"],
    "steps": len(result.records),
}))
"""


def _python(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )


def test_importing_the_pipeline_imports_no_torch(tmp_path: Path) -> None:
    """With a ``torch`` and ``transformers`` that raise when imported, the pipeline package, its
    run module and ``run_pipeline`` import, and neither is in ``sys.modules``."""
    shim = tmp_path / "shim"
    for heavy in ("torch", "transformers"):
        (shim / heavy).mkdir(parents=True)
        (shim / heavy / "__init__.py").write_text(f"raise ImportError('{heavy} was imported')\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(shim), *filter(None, [env.get("PYTHONPATH")])])
    code = (
        "import sys\n"
        "import asyncflow_actors.pipeline as p\n"
        "import asyncflow_actors.pipeline._run, asyncflow_actors.pipeline._start\n"
        "assert p.run_pipeline and p.open_pipeline and p.PipelineConfig\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    done = _python(code, env)
    assert (done.returncode, done.stdout, done.stderr) == (0, "[]\n", "")


def test_the_nodes_are_launched_before_this_process_imports_torch() -> None:
    """The trainer's node is launched before the driver process has finished importing torch,
    which a worker thread imports (the slow checks, the roles' modules) and never the event
    loop's thread; and the run trains."""
    done = _python(RUN)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report == {
        "launched_before_torch": [True],
        "torch_on_the_main_thread": False,
        "steps": 1,
    }


def test_role_modules_name_each_role_class() -> None:
    """``ROLE_MODULES`` (what a node preloads, by name) is where each role's class lives."""
    classes = {
        "reward": roles.Reward,
        "rollout": roles.Rollout,
        "actor_fwd": roles.ActorForward,
        "ref_fwd": roles.RefForward,
        "advantage": roles.Advantage,
        "trainer": roles.Trainer,
    }
    assert set(ROLE_MODULES) == set(classes)
    for role, cls in classes.items():
        assert role_class(role) is cls
        assert ROLE_MODULES[role] == cls.__module__


async def test_the_slow_checks_and_the_imports_run_with_the_collector_paused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``check_contents`` and this process's imports run in ``roles._gc.gc_paused`` (no full
    collection rescanning torch's and transformers' objects); the collector runs again after."""
    seen: list[bool] = []
    check = _start.check_contents

    def recording(config: PipelineConfig, checkpoint: str | None) -> None:
        seen.append(gc.isenabled())
        check(config, checkpoint)

    monkeypatch.setattr(_start, "check_contents", recording)
    assert gc.isenabled()
    result = await run_pipeline(tiny("async", train={"steps": 1}))
    assert seen == [False] and gc.isenabled() and len(result.records) == 1
