"""``Preload``: a node imports its roles' modules (and an HF model's transformers classes) in a
worker thread before they are spawned; only this package's modules."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from asyncflow_actors.actors.remote import open_actor_system
from asyncflow_actors.pipeline import PipelineConfig
from asyncflow_actors.pipeline._placement import Placement
from asyncflow_actors.roles import preload
from asyncflow_actors.roles.preload import Preload


async def test_it_imports_the_modules_in_a_worker_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[str, bool]] = []
    main = threading.get_ident()

    def record(name: str) -> None:
        seen.append((name, threading.get_ident() != main))

    monkeypatch.setattr(preload.importlib, "import_module", record)
    modules = ("asyncflow_actors.roles._trainer", "asyncflow_actors.roles._compute")
    async with open_actor_system() as system:
        ref = await system.spawn(lambda: Preload(modules), name="preload")
        await ref.stop()
    assert seen == [(m, True) for m in modules]


def test_it_refuses_modules_of_other_packages() -> None:
    with pytest.raises(ValueError, match="asyncflow_actors only"):
        Preload(("os",))
    with pytest.raises(ValueError, match="asyncflow_actors only"):
        Preload(("asyncflow_actors_evil.x",))


def test_a_node_preloads_the_modules_of_the_roles_placed_on_it() -> None:
    config = PipelineConfig.from_dict(
        {"mode": "async", "placement": {"default": "process", "roles": {"advantage": "trainer"}}}
    )
    place = Placement(None, config, "x")  # type: ignore[arg-type]
    modules = {"rollout": "m.rollout", "actor_fwd": "m.forward", "trainer": "m.trainer"}
    compute = "asyncflow_actors.roles._compute"
    assert place.preload_modules("trainer-0", modules) == (compute, "m.trainer")
    assert place.preload_modules("rollout-0", modules) == (compute, "m.rollout")
    assert place.preload_modules("actor_fwd-0", modules) == (compute, "m.forward")


def test_only_nodes_hosting_a_model_warm_its_transformers_classes() -> None:
    config = PipelineConfig.from_dict({"mode": "async", "placement": {"default": "process"}})
    place = Placement(None, config, "x")  # type: ignore[arg-type]
    models = {"rollout", "actor_fwd", "ref_fwd", "trainer"}
    assert place.hosts("trainer-0", models) and place.hosts("rollout-0", models)
    assert not place.hosts("advantage-0", models)


def test_the_hf_classes_are_warmed_where_transformers_loads_the_policy(tmp_path: Path) -> None:
    """``hf_model_of``: a node (or the driver's process) hosting a role that loads the policy
    with transformers warms ``model.hf``'s classes; a vLLM rollout's does not (vLLM loads its
    own), nor a process with no model role."""
    (tmp_path / "config.json").write_text("{}")

    def place(engine: str) -> Placement:
        config = PipelineConfig.from_dict({
            "mode": "async", "model": {"hf": str(tmp_path)}, "rollout": {"engine": engine},
            "placement": {"default": "process", "roles": {"rollout": "driver"}},
        })  # fmt: skip
        return Placement(None, config, "x")  # type: ignore[arg-type]

    assert place("hf").hf_model_of("driver") == str(tmp_path)
    assert place("hf").hf_model_of("trainer-0") == str(tmp_path)
    assert place("hf").hf_model_of("advantage-0") is None
    assert place("vllm").hf_model_of("driver") is None
    assert place("vllm").hf_model_of("trainer-0") == str(tmp_path)
