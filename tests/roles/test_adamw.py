"""``DirectAdamW`` is ``torch.optim.AdamW`` bit for bit, reads and writes its ``state_dict``,
and imports no ``torch._dynamo`` (what it is for)."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch
from torch import nn

from asyncflow_actors.roles._adamw import DirectAdamW


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    model[0].bias.requires_grad_(False)  # a frozen parameter: never updated, no state
    return model


def _train(model: nn.Module, optimizer: torch.optim.Optimizer | DirectAdamW, steps: int) -> None:
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        x = torch.randn(8, 6, generator=generator)
        model(x).pow(2).mean().backward()
        optimizer.step()


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_its_updates_are_torchs_adamw_bit_for_bit(weight_decay: float) -> None:
    ours, theirs = _model(0), _model(0)
    _train(ours, DirectAdamW(ours.parameters(), lr=1e-2, weight_decay=weight_decay), 5)
    _train(theirs, torch.optim.AdamW(theirs.parameters(), lr=1e-2, weight_decay=weight_decay), 5)
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(ours[0].bias, _model(0)[0].bias)  # the frozen one did not move


def test_its_state_dict_is_torchs_and_loads_either_way() -> None:
    ours, theirs = _model(0), _model(0)
    mine = DirectAdamW(ours.parameters(), lr=1e-2, weight_decay=0.1)
    torchs = torch.optim.AdamW(theirs.parameters(), lr=1e-2, weight_decay=0.1)
    _train(ours, mine, 3)
    _train(theirs, torchs, 3)
    # (copies: a state_dict holds the live moments, and loading one aliases them, in torch too)
    a, b = copy.deepcopy(mine.state_dict()), copy.deepcopy(torchs.state_dict())
    assert a["state"].keys() == b["state"].keys()  # the frozen bias (index 1) has none
    for index, state in b["state"].items():
        assert state.keys() == a["state"][index].keys()
        for key, value in state.items():
            assert torch.equal(value, a["state"][index][key]), (index, key)
    assert a["param_groups"][0]["params"] == b["param_groups"][0]["params"]
    # torch's state continues in ours, ours in torch's: the same parameters as one run
    crossed, back = _model(0), _model(0)
    crossed.load_state_dict(theirs.state_dict())
    back.load_state_dict(ours.state_dict())
    into_ours = DirectAdamW(crossed.parameters(), lr=0.0, weight_decay=0.0)
    into_ours.load_state_dict(b)
    into_torch = torch.optim.AdamW(back.parameters(), lr=1e-2, weight_decay=0.1)
    into_torch.load_state_dict(a)
    _train(crossed, into_ours, 2)
    _train(back, into_torch, 2)
    _train(theirs, torchs, 2)
    for x, y, z in zip(crossed.parameters(), back.parameters(), theirs.parameters(), strict=True):
        assert torch.equal(x, z) and torch.equal(y, z)


def test_a_state_of_other_parameters_is_refused() -> None:
    model = _model(0)
    optimizer = DirectAdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    other = torch.optim.AdamW(nn.Linear(2, 2).parameters(), lr=1e-2)
    with pytest.raises(ValueError, match="does not fit one group of 4 parameters"):
        optimizer.load_state_dict(other.state_dict())


def test_it_imports_no_dynamo() -> None:
    code = (
        "import sys, torch\n"
        "from asyncflow_actors.roles._adamw import DirectAdamW\n"
        "p = torch.nn.Parameter(torch.ones(3))\n"
        "o = DirectAdamW([p], lr=0.1, weight_decay=0.0)\n"
        "p.sum().backward(); torch.nn.utils.clip_grad_norm_([p], 1.0); o.step(); o.zero_grad()\n"
        "print('torch._dynamo' in sys.modules, float(p[0]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    dynamo, value = out.stdout.split()
    assert dynamo == "False"
    assert float(value) == pytest.approx(0.9)  # Adam's first step: lr times the sign
