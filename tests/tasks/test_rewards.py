"""Reward functions: their values checked and weighted, loaded by import path, called off the
event loop within limits, and what a failing one does under each ``on_error``."""

from __future__ import annotations

import math

import pytest
import trio

from asyncflow_actors.rl import RewardValueError, check_reward_values, pass_at_k, weighted_rewards
from asyncflow_actors.roles import TaskSettings
from asyncflow_actors.tasks import (
    RewardFailed,
    RewardImportError,
    RewardRunner,
    RewardSettings,
    ToScore,
    function_path,
    load_function,
)

from . import rewards


def groups(n: int = 2, size: int = 3) -> list[ToScore]:
    return [
        ToScore(f"{i}+1=", {"prompt": f"{i}+1=", "answer": str(i + 1), "level": i}, ("1",) * size)
        for i in range(n)
    ]


def test_values_are_numbers_or_none_one_per_sample() -> None:
    assert check_reward_values("f", [1, None, -2.5], 3) == [1.0, None, -2.5]
    for bad in ([1.0], [math.nan, 1, 1], ["x", 1, 1], 3.0):
        with pytest.raises(RewardValueError, match="'f'"):
            check_reward_values("f", bad, 3)


def test_weighted_sum_skips_none_like_trl() -> None:
    assert weighted_rewards([[1.0, None, None], [2.0, 3.0, None]], [1.0, -0.5]) == [0.0, -1.5, 0.0]


def test_pass_at_k_is_the_unbiased_estimator() -> None:
    assert pass_at_k(4, 0, 2) == 0.0
    assert pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)


def test_a_function_becomes_its_import_path_and_back() -> None:
    path = function_path(rewards.exact)
    assert path == "tests.tasks.rewards:exact"
    assert load_function(path) is rewards.exact
    assert TaskSettings(reward=[rewards.exact, "tests.tasks.rewards:length"]).reward == (
        path,
        "tests.tasks.rewards:length",
    )
    with pytest.raises(RewardImportError, match="lambda"):
        function_path(lambda completions, **kw: [])
    with pytest.raises(RewardImportError, match="cannot import"):
        load_function("tests.tasks.rewards:missing")


def test_a_file_path_is_made_absolute_and_loads(tmp_path: object) -> None:
    import os

    file = os.path.join(str(tmp_path), "my_rewards.py")
    with open(file, "w") as f:
        f.write("def ok(completions, **kw):\n    return [2.0] * len(completions)\n")
    path = function_path(os.path.relpath(file) + ":ok")
    assert path == f"{file}:ok"
    assert load_function(path)(completions=["a"]) == [2.0]


async def test_columns_arrive_by_name_and_functions_are_weighted() -> None:
    runner = RewardRunner(
        ["tests.tasks.rewards:columns_seen", "tests.tasks.rewards:length"],
        [2.0, 1.0],
        RewardSettings(),
    )
    scores = await runner.score(groups())
    assert scores[1].rewards == (2.0 * 1 - 1.0,) * 3
    assert scores[0].parts[0] == (0.0, -1.0)
    assert runner.names == ("columns_seen", "length")


async def test_sync_rewards_run_in_threads_and_async_ones_off_the_trio_loop() -> None:
    runner = RewardRunner(
        ["tests.tasks.rewards:trio_free", "tests.tasks.rewards:slow_async"],
        None,
        RewardSettings(concurrency=1),
    )
    try:
        scores = await runner.score(groups())
    finally:
        runner.close()
    assert scores[0].rewards == (1.5,) * 3


async def test_a_call_that_outlives_its_timeout_is_an_error() -> None:
    runner = RewardRunner(
        ["tests.tasks.rewards:hangs"], None, RewardSettings(on_error="zero", timeout=0.05)
    )
    try:
        with trio.fail_after(5):
            (score,) = await runner.score(groups(1))
    finally:
        runner.close()
    assert score.rewards == (0.0,) * 3 and score.errors == 1


@pytest.mark.parametrize("on_error", ["raise", "zero", "drop"])
async def test_a_reward_raising_at_20_percent(on_error: str) -> None:
    rewards._flaky.seed(1)
    runner = RewardRunner(["tests.tasks.rewards:flaky"], None, RewardSettings(on_error=on_error))
    outcomes = {"ok": 0, "zero": 0, "dropped": 0, "raised": 0}
    messages: list[str] = []
    for _ in range(40):
        try:
            (score,) = await runner.score(groups(1))
        except RewardFailed as exc:
            messages.append(str(exc))
            outcomes["raised"] += 1
            continue
        if score.dropped is not None:
            outcomes["dropped"] += 1
        elif score.errors:
            assert score.rewards == (0.0,) * 3
            outcomes["zero"] += 1
        else:
            outcomes["ok"] += 1
    for message in messages:
        assert "reward 'flaky' raised ValueError('flaky reward failed')" in message
        assert "prompt '0+1='" in message
    failed = {"raise": "raised", "zero": "zero", "drop": "dropped"}[on_error]
    assert 2 <= outcomes[failed] <= 16 and outcomes["ok"] + outcomes[failed] == 40
