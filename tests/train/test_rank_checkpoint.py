"""Distributed checkpoints (DCP): written by every rank, resumed on another number of ranks
(2 -> 1 -> 2) with the same weights, optimizer state and RNG; the final export."""

from __future__ import annotations

from pathlib import Path

import torch

from asyncflow_actors.models import load_model
from asyncflow_actors.roles._distributed import DistributedLearner
from asyncflow_actors.roles._rank_settings import ParallelSettings

from .conftest import global_batch, run_spec


def test_a_checkpoint_of_two_ranks_resumes_on_one_and_back(tmp_path: Path) -> None:
    spec = run_spec()
    first, second = global_batch(seed=1), global_batch(seed=2)
    with DistributedLearner.open(spec, ParallelSettings(ranks=2)) as two:
        two.step(first)
        two.save(str(tmp_path / "a"), {"version": 1})
        saved = two.full_state_dict()
        two.step(second)  # what a resumed run's next step must do
        expected = two.full_state_dict()
        grads = two.gradients()
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [
        "dcp", "rng-0.safetensors", "rng-1.safetensors", "run.json"
    ]  # fmt: skip
    with DistributedLearner.open(spec, ParallelSettings(ranks=1)) as one:
        assert one.load(str(tmp_path / "a")) == {"version": 1}
        loaded = one.full_state_dict()
        for name, value in saved.items():
            assert torch.equal(loaded[name], value), name
        one.step(second)  # AdamW's moments were restored: the same second step
        resumed = one.full_state_dict()
        for name, value in expected.items():
            steady = grads[name].abs() > 1e-5
            diff = (resumed[name] - value)[steady].abs().max()
            assert float(diff) <= 1e-5 * float(value.abs().max()), name
        one.save(str(tmp_path / "b"), {"version": 2})
        exported = one.export(str(tmp_path / "out"))
    model = load_model(exported + ".safetensors")
    for name, value in model.state_dict().items():
        assert torch.equal(value, resumed[name]), name
    with DistributedLearner.open(spec, ParallelSettings(ranks=2)) as again:
        assert again.load(str(tmp_path / "b")) == {"version": 2}
        back = again.full_state_dict()
    for name, value in resumed.items():
        assert torch.equal(back[name], value), name
