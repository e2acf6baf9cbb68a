"""The pipeline end to end: asynchronous against synchronous, learning speed and quality.

- ``pipeline_async_vs_sync``: trained samples/s of ``async(staleness=1)`` (value) over ``sync``
  (baseline) on the long-tail task (a policy warmed up to answer with the task's heavy-tailed
  lengths), same model, same placement (one process per role), rounds interleaved, 48 steps a
  run (a run's samples/s counts its first steps, before generation runs ahead: 16 steps, as
  before the eighth session, weighed them three times as much). Target >= 1.5.
  ``pipeline_async_vs_sync_folded``: the same with the placement ``docs/pipeline.md``
  recommends for long generations on a small model (``FOLDED_ROLES``, below: the trainer
  computes the old log-probs and advantages, the rollout has a process of its own); both arms
  are faster, the ratio about the same.
- ``pipeline_time_to_reward``: seconds of training until the mean batch reward (over the last 3
  batches) reaches 0.8 on addition, for async (value) against a plain single-loop synchronous
  GRPO written below (generate, score, update; no actors; baseline), from the same warmed-up
  policy with the same batch and learning rate; the mean over ``--seeds`` task seeds (one
  seed moves the steps needed by about 1.4x). The plain loop runs on its best torch thread
  count (1 or 2), measured before each seed's pair in the same sitting (with 2 threads its
  step was 11-33% faster in three sittings); the step cap (1200) leaves a wide margin over the
  193-382 steps either arm needed, so both arms reach the threshold. The async run folds the old log-probs and the
  advantages into the trainer and runs the rollout in the driver process, next to the
  TransferQueue (``placement.roles``): the placement ``docs/pipeline.md`` recommends for small
  models, two processes, generation and training in parallel; it corrects its one-version-stale
  samples with token-level importance weights (``algorithm.is_level = "token"``): with the old
  log-probs the trainer's own, nothing else does. Target ratio < 1.
- ``pipeline_final_reward_gap_s1`` / ``_s2``: held-out reward (512 problems) after the same
  number of trained samples, async at staleness 1 and 2 minus sync, in percentage points.
  Target: within 2.
- ``pipeline_staleness0_offpolicy_samples``: trained samples whose oldest token's version
  differed from the trainer's in async at staleness 0. Target 0.
- ``pipeline_cpu_per_step`` (no target: what the time-to-reward ratio is made of): CPU seconds
  per training step over every process of the async run (this one and its node processes,
  from ``/proc``), against the plain loop's CPU per step. On a shared machine the wall-clock
  figures move with the load; these move much less.

``PYTHONPATH=benchmarks python benchmarks/bench_pipeline.py [--rounds N] [--seeds N] [--quick]
[--only throughput|time_to_reward|gap|staleness0 ...]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import trio
from common import emit

import asyncflow_actors as afa
from asyncflow_actors.models import (
    CharTokenizer,
    SamplingParams,
    TinyConfig,
    TinyDecoder,
    load_model,
    save_model,
    token_logprobs,
)
from asyncflow_actors.pipeline import PipelineConfig, StepRecord, open_pipeline, run_pipeline
from asyncflow_actors.rl import (
    AdditionTask,
    LongTailTask,
    evaluate,
    grpo_advantages,
    policy_loss,
    sample_groups,
    sft_warmup,
)

ADDITION = AdditionTask(min_digits=1, max_digits=2)
LONGTAIL = LongTailTask(op="reverse", distribution="pareto", min_length=2, max_length=40)
TARGET = 0.8
# lr 2e-4 for both arms: at 5e-4 Adam's steps on this model are dominated by the policy
# gradient's noise (128 samples a step). The plain loop reached reward 0.8 in 293, 349 and 346
# steps at 5e-4, in 193, 214 and 292 at 2e-4 (three seeds each; never at 1e-3), and 60 steps at
# 5e-4 lowered the held-out reward of every arm, so the reward gap measured noise.
PROMPTS, GROUP, LR = 16, 8, 2e-4
EVAL_CHUNKS, EVAL_CHUNK = 8, 256


def warm(task: Any, path: str, *, max_seq_len: int, accuracy: float, steps: int) -> None:
    tokenizer = CharTokenizer(task.alphabet)
    torch.manual_seed(0)
    model = TinyDecoder(
        TinyConfig(vocab_size=tokenizer.vocab_size, d_model=64, n_heads=4, max_seq_len=max_seq_len)
    )
    sft_warmup(model, task, tokenizer, target_accuracy=accuracy, max_steps=steps, eval_every=20,
               eval_size=64, seed=0)  # fmt: skip
    save_model(path, model, tokenizer=tokenizer)


# the stations folded into the trainer (one forward pass less on the rollout's critical path)
FOLDED_ROLES = {"actor_fwd": "trainer", "advantage": "trainer"}
# ... and the rollout's queue traffic in-process calls (short generations: less CPU a step)
SMALL_MODEL_ROLES = {**FOLDED_ROLES, "rollout": "driver"}


def config(mode: str, init: str, **over: Any) -> PipelineConfig:
    table: dict[str, Any] = {
        "mode": mode,
        "progress": "none",
        "plot": False,
        "model": {"init": init},
        "task": {"kind": "addition", "options": {"min_digits": 1, "max_digits": 2}, "seed": 1},
        "rollout": {"group_size": GROUP, "max_new_tokens": 4},
        "train": {"steps": 30, "prompts_per_step": PROMPTS, "lr": LR},
        "placement": {"default": "local"},
    }
    for key, value in over.items():
        table[key] = {**table.get(key, {}), **value} if isinstance(value, dict) else value
    return PipelineConfig.from_dict(table)


async def throughput(init: str, rounds: int, steps: int) -> None:
    """Both modes in both placements, rounds interleaved: one process per role (the headline
    figure, as in every session before) and the stations folded into the trainer
    (``FOLDED_ROLES``)."""
    longtail = {
        "task": {
            "kind": "longtail",
            "options": {"op": "reverse", "min_length": 2, "max_length": 40},
        },
        "rollout": {"group_size": 4, "max_new_tokens": 44},
        "train": {"steps": steps, "prompts_per_step": 8},
    }
    placements = {
        "": {"default": "process"},
        "_folded": {"default": "process", "roles": FOLDED_ROLES},
    }
    rates: dict[tuple[str, str], list[float]] = {}
    for i in range(rounds):
        for mode in ("sync", "async") if i % 2 == 0 else ("async", "sync"):
            for suffix, placement in placements.items():
                extra = {"staleness": 1} if mode == "async" else {}
                cfg = config(mode, init, **longtail, placement=placement, **extra)
                result = await run_pipeline(cfg)
                rates.setdefault((suffix, mode), []).append(result.samples_per_s)
    for suffix in placements:
        emit(f"pipeline_async_vs_sync{suffix}", statistics.median(rates[suffix, "async"]),
             "samples/s", statistics.median(rates[suffix, "sync"]))  # fmt: skip
        print(f"# samples/s{suffix or ' (one process per role)'}: async "
              f"{[round(r) for r in rates[suffix, 'async']]} sync "
              f"{[round(r) for r in rates[suffix, 'sync']]}", file=sys.stderr)  # fmt: skip


def process_cpu_seconds() -> float:
    """CPU seconds (user + system) of this process and every live descendant (Linux)."""
    tick = os.sysconf("SC_CLK_TCK")
    total, todo = 0.0, [os.getpid()]
    while todo:
        pid = todo.pop()
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
            # children are listed per thread that spawned them (node processes are started
            # from worker threads too): every thread's list
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/children") as f:
                    todo += [int(child) for child in f.read().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue  # gone meanwhile
    return total


def plain_grpo_time_to_reward(
    init: str, max_steps: int, seed: int, threads: int = 1, *, stop: bool = True
) -> tuple[float, int, float]:
    """The baseline: one loop, one process: sample groups, score, one PPO update, on
    ``threads`` torch threads. Returns the seconds and steps to the target (``stop``: else it
    runs ``max_steps``) and the CPU seconds per step."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _plain_grpo(init, max_steps, seed, stop)
    finally:
        torch.set_num_threads(previous)


def best_plain_threads(init: str, seed: int, steps: int = 12) -> tuple[int, dict[int, float]]:
    """The plain loop's fastest torch thread count on this machine now (1 or 2, the cores the
    async arm's two processes use), from ``steps`` steps on each, twice, alternated: the
    baseline gets its best, measured in the same sitting as the runs it is compared with."""
    times: dict[int, list[float]] = {1: [], 2: []}
    for _ in range(2):
        for threads in times:
            seconds, _, _ = plain_grpo_time_to_reward(init, steps, seed, threads, stop=False)
            times[threads].append(seconds / steps)
    per_step = {n: min(v) for n, v in times.items()}
    return min(per_step, key=lambda n: per_step[n]), per_step


def _plain_grpo(init: str, max_steps: int, seed: int, stop: bool) -> tuple[float, int, float]:
    model = load_model(init)
    tokenizer = CharTokenizer(ADDITION.alphabet)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    generator = torch.Generator().manual_seed(seed)
    history: list[float] = []
    started, cpu = time.perf_counter(), time.process_time()
    for step in range(max_steps):
        problems = ADDITION.sample(PROMPTS, seed=10_000 * seed + step)
        groups = sample_groups(model, ADDITION, tokenizer, problems, group_size=GROUP,
                               params=SamplingParams(4), generator=generator)  # fmt: skip
        batch = groups.batch
        advantages = grpo_advantages(groups.rewards, groups.group_ids, batch.response_mask)
        logp = token_logprobs(model, batch).logprobs
        loss = policy_loss(logp, logp.detach(), advantages.advantages, batch.response_mask).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        history.append(float(groups.rewards.mean()))
        if stop and statistics.mean(history[-3:]) >= TARGET:
            return time.perf_counter() - started, step + 1, (time.process_time() - cpu) / (step + 1)
    if not stop:
        return time.perf_counter() - started, max_steps, (time.process_time() - cpu) / max_steps
    return float("inf"), max_steps, (time.process_time() - cpu) / max_steps


async def pipeline_time_to_reward(init: str, max_steps: int, seed: int) -> tuple[float, int, float]:
    """Seconds and steps to the target, and CPU seconds per step over every process from the
    first step to the last (the start-up of the node processes left out)."""
    # Whole batches (``stream`` off): every answer is a few tokens, so a batch's groups finish
    # together and pieces would only add their own overhead on the saturated cores.
    cfg = config("async", init, staleness=1, train={"steps": max_steps, "seed": seed,
                 "stream": False}, task={"seed": seed},
                 placement={"default": "process", "roles": SMALL_MODEL_ROLES},
                 algorithm={"is_level": "token"})  # fmt: skip
    reached: list[StepRecord] = []
    async with afa.open_actor_system() as system, open_pipeline(system, cfg) as run:
        seen, first = 0, None
        while not reached and seen < max_steps:
            await trio.sleep(0.05)
            seen = len(run.records)
            if first is None and seen:
                first = (seen, process_cpu_seconds())
            tail = [r.reward_mean for r in run.records[-3:]]
            if tail and statistics.mean(tail) >= TARGET:
                reached.append(run.records[-1])
        assert first is not None
        cpu = (process_cpu_seconds() - first[1]) / max(1, len(run.records) - first[0])
    if not reached:
        return float("inf"), max_steps, cpu
    return reached[0].seconds, reached[0].step, cpu


def held_out(path: str) -> list[float]:
    """Mean reward on each of ``EVAL_CHUNKS`` disjoint chunks of held-out problems, sampled as in
    training. Every policy sees the same problems and the same sampling seeds (common random
    numbers), so a difference between two policies is not eval-sampling noise drawn twice."""
    model = load_model(path)
    tokenizer = CharTokenizer(ADDITION.alphabet)
    problems = ADDITION.sample(EVAL_CHUNKS * EVAL_CHUNK, seed=777)
    means = []
    for k in range(EVAL_CHUNKS):
        generator = torch.Generator().manual_seed(123 + k)
        chunk = problems[k * EVAL_CHUNK : (k + 1) * EVAL_CHUNK]
        result = evaluate(model, ADDITION, tokenizer, chunk, SamplingParams(4), generator=generator)
        means.append(result.mean_reward)
    return means


async def reward_gap(init: str, steps: int, workdir: str) -> None:
    """Held-out reward after ``steps`` steps (the same trained samples) of async at staleness 1
    and 2 minus sync; the ``#`` line gives each gap's standard error over the eval chunks."""
    finals: dict[str, list[float]] = {"start": held_out(init)}
    for name, mode, staleness in (("sync", "sync", None), ("s1", "async", 1), ("s2", "async", 2)):
        run_dir = os.path.join(workdir, f"gap-{name}")
        extra: dict[str, Any] = {"staleness": staleness} if staleness is not None else {}
        result = await run_pipeline(config(mode, init, run_dir=run_dir,
                                           train={"steps": steps, "checkpoint_every": steps}, **extra))  # fmt: skip
        finals[name] = held_out(os.path.join(result.checkpoints[-1], "policy.safetensors"))
    notes = []
    for name in ("s1", "s2"):
        diffs = [100 * (a - b) for a, b in zip(finals[name], finals["sync"], strict=True)]
        error = statistics.stdev(diffs) / len(diffs) ** 0.5
        emit(f"pipeline_final_reward_gap_{name}", statistics.mean(diffs), "pp")
        notes.append(f"{name} {statistics.mean(diffs):+.1f} ± {error:.1f} pp")
    means = {name: round(statistics.mean(v), 3) for name, v in finals.items()}
    print(f"# held-out reward ({EVAL_CHUNKS}x{EVAL_CHUNK} problems) after {steps} steps: {means}; "
          f"gaps (± standard error over the eval chunks): {', '.join(notes)}",
          file=sys.stderr)  # fmt: skip


async def offpolicy_at_staleness_zero(init: str, steps: int) -> None:
    result = await run_pipeline(config("async", init, staleness=0, train={"steps": steps}))
    emit("pipeline_staleness0_offpolicy_samples", result.offpolicy_samples, "samples")
    print(f"# staleness 0: {result.samples} samples trained over {steps} steps", file=sys.stderr)


PARTS = ("throughput", "time_to_reward", "gap", "staleness0")


async def main(rounds: int, quick: bool, seeds: int, parts: tuple[str, ...]) -> None:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="bench-pipeline-") as workdir:
        addition = os.path.join(workdir, "addition.safetensors")
        longtail = os.path.join(workdir, "longtail.safetensors")
        if parts != ("throughput",):
            await trio.to_thread.run_sync(lambda: warm(ADDITION, addition, max_seq_len=16,
                                                       accuracy=0.75, steps=3000))  # fmt: skip
        if "throughput" in parts:
            await trio.to_thread.run_sync(lambda: warm(LONGTAIL, longtail, max_seq_len=96,
                                                       accuracy=1.0, steps=40 if quick else 100))  # fmt: skip
            await throughput(longtail, rounds, 4 if quick else 48)
        if "time_to_reward" in parts:
            # the cap: the arms needed 193-382 steps in past sittings; a run that reaches no
            # threshold prints Infinity, so the cap leaves a wide margin
            await time_to_reward(addition, 40 if quick else 1200, seeds)
        if "gap" in parts:
            await reward_gap(addition, 6 if quick else 60, workdir)
        if "staleness0" in parts:
            await offpolicy_at_staleness_zero(addition, 4 if quick else 10)


async def time_to_reward(addition: str, max_steps: int, seeds: int) -> None:
    plain, folded, chosen = [], [], []
    for seed in range(1, seeds + 1):
        # the plain loop's best thread count, measured now (the load moves between sittings)
        threads, per_step = await trio.to_thread.run_sync(best_plain_threads, addition, seed)
        chosen.append((threads, {n: round(t * 1e3, 1) for n, t in per_step.items()}))
        plain.append(await trio.to_thread.run_sync(
            plain_grpo_time_to_reward, addition, max_steps, seed, threads))  # fmt: skip
        folded.append(await pipeline_time_to_reward(addition, max_steps, seed))
    emit("pipeline_time_to_reward", statistics.mean(r[0] for r in folded), "s",
         statistics.mean(r[0] for r in plain))  # fmt: skip
    emit("pipeline_cpu_per_step", statistics.median(r[2] for r in folded), "s",
         statistics.median(r[2] for r in plain))  # fmt: skip
    print(f"# time to reward {TARGET} per task seed (s, steps): async "
          f"{[(round(r[0], 1), r[1]) for r in folded]}, plain loop "
          f"{[(round(r[0], 1), r[1]) for r in plain]}; the plain loop's threads per seed "
          f"(chosen, ms a step on 1 and 2) {chosen}; load average "
          f"{os.getloadavg()[0]:.1f}", file=sys.stderr)  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seeds", type=int, default=3, help="task seeds of the time to reward")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks that it runs")
    parser.add_argument("--only", choices=PARTS, action="append", help="run only these parts")
    args = parser.parse_args()
    trio.run(main, args.rounds, args.quick, args.seeds, tuple(args.only or PARTS))
