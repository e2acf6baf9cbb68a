"""Our pipeline against TRL's ``GRPOTrainer`` (``trl==1.16.0``) on the same model, prompts and
reward: the wall time from the start of a process to the first step whose mean reward over the
last 10 steps reaches a threshold.

``nox -s bench_peer_trl`` (its own venv: ``torch==2.13.0`` installed first, then
``trl==1.16.0`` and this project with the ``hf`` and ``datasets`` extras), or in a venv with
both: ``python benchmarks/peer_trl.py [--seeds 3] [--tasks addition longtail] [--quick]``.

**The model** (built here, shared by both sides): a ``LlamaForCausalLM`` of two layers
(d_model 64, 4 heads), a character-level tokenizer from ``tokenizers`` (BOS prepended by its
post-processor, so both sides feed ``<bos>`` + prompt), after a short supervised warm-up
(``rl.sft_warmup``, greedy exact answers on ``WARM_ACCURACY`` of held-out problems) so that the
reward is not zero. Saved once per task as a local folder; each run loads it.

**The tasks.** ``addition``: 2-digit operands, the sum reversed (``rl.AdditionTask``): answers
of 2-3 characters, overhead-bound. ``longtail``: reverse a string whose length is Pareto
distributed up to ``max_length`` (``rl.LongTailTask``): response lengths heavy-tailed up to the
token budget, generation-bound (the seeds' long-sequence scenario). The same prompts in the
same order on both sides (a dataset of ``task.sample`` problems, no shuffling); the same reward
function (this file's ``reward``: 1 for the exact answer, at the right length half a point
times the share of right characters; TRL calls it, our node processes import it by path).

**Matched settings**, side by side (TRL's default in brackets where we override it):

| setting | TRL ``GRPOConfig`` | ours (``PipelineConfig``) |
| --- | --- | --- |
| group size | ``num_generations = 8`` | ``rollout.group_size = 8`` |
| prompts per step | ``per_device_train_batch_size = 8 x prompts``, ``gradient_accumulation_steps = 1`` (one generation batch, one optimizer step) | ``train.prompts_per_step``, ``mini_batches = epochs = 1`` |
| max new tokens | ``max_completion_length`` [512] | ``rollout.max_new_tokens`` |
| sampling | ``temperature = 1``, ``top_p = 1``, ``top_k = 0`` | the same |
| optimizer | AdamW, ``learning_rate = LR`` [1e-6], betas (0.9, 0.999), ``weight_decay = 0``, ``max_grad_norm = 1`` | AdamW, ``train.lr = LR``, the same |
| lr schedule | ``lr_scheduler_type = "constant"`` [linear decay], no warm-up | constant |
| KL | ``beta = 0`` | ``algorithm.kl_coef = 0`` |
| clip | ``epsilon = 0.2`` (``epsilon_high`` = epsilon) | ``clip_low = clip_high = 0.2`` |
| loss aggregation | ``loss_type = "dapo"`` (token mean over the batch) | ``algorithm.agg = "token-mean"`` |
| advantages | ``scale_rewards = "group"``: (r - mean) / (std + 1e-4) | ``advantage = "grpo"``: (r - mean) / (std + 1e-6), std Bessel-corrected as TRL's |
| updates per batch | ``num_iterations = 1`` | one |
| precision | fp32 (``bf16 = False`` [True], ``fp16 = False``) | fp32 |
| gradient checkpointing | off [on] | none |
| dataset order | ``shuffle_dataset = False`` [True] | ``task.dataset.shuffle = false`` |
| mode | on-policy (generate, then train) | ``async``, ``--staleness`` (0: on-policy, the stages still stream within a step: the trainer's forward and backward of the groups already complete overlap the generation of the others); ``--staleness 1`` (the default): one version ahead, PPO's ratio taken against the engine's log-probs of the one-version-stale samples (``algorithm.anchor = "auto"``: ``"behaviour"``; TRL's ratio is 1, on-policy) |
| model implementation and rollout engine | transformers' ``LlamaForCausalLM``; ``model.generate`` | ``--impl native`` (the default): ``model.impl = "native"``, the folder read into the built-in ``TinyDecoder`` (same logits as transformers within 1e-5, ``tests/models/test_native_hf.py``), served by the built-in engine (continuous batching, rows reused as they free, a group's prompt prefilled once), its tokenizer through ``tokenizers`` alone (no transformers import); ``--impl hf``: transformers' model, the ``hf`` engine (static waves through the model's forward) |
| processes and threads | one process, its best torch thread count (1 or 2), measured in this sitting | two processes, one torch thread each: the rollout in the driver's process next to the TransferQueue, the trainer (old log-probs and advantages folded in) in a node process; the reward function runs in the rollout's process (``--placement local``: all in one process) |

**Thresholds**: addition 0.5 (the warm model starts near 0.32; TRL reached 0.5 in about 150
steps in a trial); long tail: the warm model's mean reward (512 problems sampled as in
training) + 0.1, written with the model.

**The figure**: per task, ``peer_trl_time_to_reward_<task>``: ``value`` ours (s), ``baseline``
TRL (s), ``ratio``; each the median over ``--seeds`` seeds (the seed of sampling and of the
prompt order), the two sides alternating (TRL first on odd seeds) in one sitting, each run a
fresh process whose clock starts when it is launched (imports, model load and start-up
included). A ``#`` line gives every run's seconds and steps to the threshold (the per-step
learning parity: steps ours vs TRL) and seconds to the first step, and the load average.
Targets (issue 28): ratio <= 0.8 on addition, <= 0.5 on the long tail; async needing no more
than 10% more steps than TRL.

**Our settings** (``--staleness``, ``--placement process|local``, ``--impl native|hf``):
``model.impl = "native"`` by default (benchmarks/RESULTS.md, ``peer_trl``, "The native fast
path": the first step 2.8 s in one process against 3.7 with ``hf``); staleness 1 by default
(benchmarks/RESULTS.md, ``peer_trl``, "Staleness 1: the anchor"): the rollout of the next
batch overlaps the trainer's step, and with PPO's ratio taken against the engine's log-probs
(``algorithm.anchor = "auto"``) a run needs fewer steps than at staleness 0 (addition: 58
against 113, TRL 158, medians of 3 seeds). With the ratio against the trainer's own forward
(the clip never bound) staleness 1 needed about twice the steps of staleness 0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.abspath(__file__)
WINDOW = 10  # steps the mean reward is taken over
STOP_S = 60  # a run stopped at its threshold ends within this (else it is killed)
GROUP = 8


def _tasks() -> dict[str, dict[str, Any]]:
    """Each task's settings (plain values: a run's process imports no torch for them)."""
    return {
        "addition": {
            "prompts": 16, "max_new_tokens": 4, "lr": 5e-4, "threshold": 0.5,
            "warm_accuracy": 0.3, "max_seq_len": 16, "max_steps": 600,
        },
        "longtail": {
            "prompts": 8, "max_new_tokens": 17, "lr": 5e-4, "gain": 0.1,
            "warm_accuracy": 0.3, "max_seq_len": 40, "max_steps": 600,
        },
    }  # fmt: skip


def _task(name: str) -> Any:
    """The task's problems and alphabet (``rl``: imports torch)."""
    from asyncflow_actors.rl import AdditionTask, LongTailTask

    if name == "addition":
        return AdditionTask(min_digits=2, max_digits=2)
    return LongTailTask(op="reverse", distribution="pareto", min_length=2, max_length=16)


def reward(prompts: list[Any], completions: list[Any], answer: list[str], **_: Any) -> list[float]:
    """The reward of both sides: ``rl.position_match_score`` with partial credit 0.5."""
    from asyncflow_actors.rl import position_match_score

    return [
        position_match_score(a, str(c), partial_credit=0.5)
        for c, a in zip(completions, answer, strict=True)
    ]


# -- the shared model and prompts --------------------------------------------------------------


def build(name: str, folder: str, quick: bool) -> None:
    """Warm the tiny model up on the task, save it as a Hugging Face folder whose tokenizer
    prepends BOS, and write the prompts (``prompts.jsonl``, the order both sides take)."""
    import torch
    from tokenizers import processors
    from transformers import AutoTokenizer

    from asyncflow_actors.models import CharTokenizer, TinyConfig, TinyDecoder
    from asyncflow_actors.rl import sft_warmup
    from asyncflow_actors.rollout import export_hf

    spec = _tasks()[name]
    task = _task(name)
    tokenizer = CharTokenizer(task.alphabet)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TinyDecoder(
        TinyConfig(vocab_size=tokenizer.vocab_size, d_model=64, n_heads=4, n_layers=2,
                   max_seq_len=spec["max_seq_len"])
    )  # fmt: skip
    sft_warmup(model, task, tokenizer, target_accuracy=spec["warm_accuracy"],
               max_steps=40 if quick else 1500, eval_every=20, eval_size=64, seed=0)  # fmt: skip
    # the threshold: fixed, or the warm model's mean reward (sampled as in training) + gain
    threshold = spec.get("threshold")
    if threshold is None:
        from asyncflow_actors.models import SamplingParams
        from asyncflow_actors.rl import evaluate

        held = task.sample(512, seed=999)
        params = SamplingParams(spec["max_new_tokens"])
        start = evaluate(model, task, tokenizer, held, params,
                         generator=torch.Generator().manual_seed(0)).mean_reward  # fmt: skip
        threshold = round(start + spec["gain"], 3)
        print(f"# {name}: the warm model's mean reward {start:.3f}", file=sys.stderr)
    export_hf(folder, model, tokenizer)
    with open(os.path.join(folder, "threshold.json"), "w") as f:
        json.dump(threshold, f)
    hf = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    hf.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", tokenizer.bos_id)]
    )
    hf.save_pretrained(folder)
    problems = task.sample(spec["max_steps"] * spec["prompts"], seed=12345)
    with open(os.path.join(folder, "prompts.jsonl"), "w", encoding="utf-8") as f:
        for p in problems:
            f.write(json.dumps({"prompt": p.prompt, "answer": p.answer}) + "\n")


# -- one run (a child process) -----------------------------------------------------------------


def _report(started: float, step: int, value: float) -> None:
    print(json.dumps({"step": step, "t": time.time() - started, "reward": value}), flush=True)


def run_trl(name: str, folder: str, seed: int, threads: int, started: float, steps: int) -> None:
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(threads)
    spec = _tasks()[name]
    data = load_dataset("json", data_files=os.path.join(folder, "prompts.jsonl"), split="train")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    args = GRPOConfig(
        output_dir=os.path.join(os.path.dirname(folder), f"trl-{seed}"),
        per_device_train_batch_size=spec["prompts"] * GROUP,
        gradient_accumulation_steps=1,
        num_generations=GROUP,
        max_completion_length=spec["max_new_tokens"],
        temperature=1.0, top_p=1.0, top_k=0,
        learning_rate=spec["lr"], lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, max_grad_norm=1.0,
        beta=0.0, epsilon=0.2, loss_type="dapo", scale_rewards="group", num_iterations=1,
        bf16=False, fp16=False, gradient_checkpointing=False,
        shuffle_dataset=False, max_steps=steps, logging_steps=1, save_strategy="no",
        report_to="none", use_cpu=True, seed=seed, dataloader_num_workers=0,
        log_completions=False, disable_tqdm=True,
    )  # fmt: skip

    class Report(TrainerCallback):  # type: ignore[misc]
        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **_: Any) -> None:
            if logs and "reward" in logs:
                _report(started, int(state.global_step), float(logs["reward"]))

    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data,
                          processing_class=tokenizer, callbacks=[Report()])  # fmt: skip
    trainer.train()


def run_ours(
    name: str, folder: str, seed: int, started: float, steps: int,
    staleness: int = 1, placement: str = "process", impl: str = "native",
) -> None:  # fmt: skip
    import trio

    from asyncflow_actors.pipeline import PipelineConfig, run_pipeline

    spec = _tasks()[name]
    config = PipelineConfig.from_dict({
        "mode": "async", "staleness": staleness, "progress": "none", "plot": False,
        "model": {"hf": folder, "impl": impl},
        "task": {"kind": "dataset", "reward": f"{HERE}:reward",
                 "dataset": {"path": os.path.join(folder, "prompts.jsonl"), "shuffle": False}},
        "rollout": {"engine": "hf" if impl == "hf" else "builtin", "group_size": GROUP, "max_new_tokens": spec["max_new_tokens"],
                    "temperature": 1.0, "top_p": 1.0, "top_k": 0},
        "algorithm": {"advantage": "grpo", "clip_low": 0.2, "clip_high": 0.2, "agg": "token-mean",
                      "kl_coef": 0.0},  # anchor "auto": the engine's log-probs at staleness 1
        "train": {"steps": steps, "prompts_per_step": spec["prompts"], "lr": spec["lr"],
                  "weight_decay": 0.0, "max_grad_norm": 1.0, "seed": seed, "torch_threads": 1},
        "placement": {"default": placement,
                      "roles": {"actor_fwd": "trainer", "advantage": "trainer",
                                "rollout": "driver"}},
    })  # fmt: skip
    trio.run(
        lambda: run_pipeline(config, on_step=lambda r: _report(started, r.step, r.reward_mean))
    )


# -- the sitting (the parent) ------------------------------------------------------------------


def one_run(
    side: str, name: str, folder: str, seed: int, threads: int, steps: int,
    ours: tuple[str, ...] = (),
) -> dict[str, Any]:  # fmt: skip
    """A fresh process of ``side``; stops it once the threshold is reached. Returns its seconds
    and steps to the threshold (inf if never) and its seconds to the first step."""
    with open(os.path.join(folder, "threshold.json")) as f:
        threshold = json.load(f)
    cmd = [sys.executable, HERE, "--child", side, "--task", name, "--folder", folder,
           "--seed", str(seed), "--threads", str(threads), "--steps", str(steps),
           "--started", repr(time.time()), *(ours if side == "ours" else ())]  # fmt: skip
    rewards: list[float] = []
    result: dict[str, Any] = {"side": side, "seed": seed, "seconds": float("inf"), "steps": None,
                              "first": None}  # fmt: skip
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            if not line.startswith('{"step"'):
                continue
            row = json.loads(line)
            if result["first"] is None:
                result["first"] = row["t"]
            rewards.append(row["reward"])
            if len(rewards) >= WINDOW and statistics.mean(rewards[-WINDOW:]) >= threshold:
                result.update(seconds=row["t"], steps=row["step"])
                # a clean stop (ours: the run stops its node processes), not a kill that
                # would leave them running into the next measured run
                proc.terminate()
                break
        try:
            proc.communicate(timeout=STOP_S)  # (what it still prints is read, not blocked on)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
    result["last_mean"] = statistics.mean(rewards[-WINDOW:]) if rewards else None
    return result


def best_threads(name: str, folder: str) -> int:
    """TRL's fastest torch thread count (1 or 2) now: seconds for 6 steps, each twice."""
    times: dict[int, float] = {}
    for threads in (1, 2, 1, 2):
        started = time.time()
        out = subprocess.run(
            [sys.executable, HERE, "--child", "trl", "--task", name, "--folder", folder,
             "--seed", "0", "--threads", str(threads), "--steps", "6", "--started",
             repr(started)], capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        rows = [json.loads(x) for x in out.splitlines() if x.startswith('{"step"')]
        per_step = (rows[-1]["t"] - rows[0]["t"]) / max(1, len(rows) - 1)
        times[threads] = min(times.get(threads, float("inf")), per_step)
    print(f"# {name}: TRL seconds a step by torch threads {times}", file=sys.stderr)
    return min(times, key=lambda n: times[n])


def main(seeds: int, names: list[str], quick: bool, ours: tuple[str, ...] = ()) -> None:
    from common import emit

    with tempfile.TemporaryDirectory(prefix="peer-trl-") as workdir:
        for name in names:
            folder = os.path.join(workdir, name, "model")
            build(name, folder, quick)
            steps = 12 if quick else _tasks()[name]["max_steps"]
            threads = 1 if quick else best_threads(name, folder)
            runs: dict[str, list[dict[str, Any]]] = {"ours": [], "trl": []}
            for seed in range(1, seeds + 1):
                order = ("trl", "ours") if seed % 2 else ("ours", "trl")
                for side in order:
                    runs[side].append(one_run(side, name, folder, seed, threads, steps, ours))
            ours_s = statistics.median(r["seconds"] for r in runs["ours"])
            trl_s = statistics.median(r["seconds"] for r in runs["trl"])
            emit(f"peer_trl_time_to_reward_{name}", ours_s, "s", trl_s)
            with open(os.path.join(folder, "threshold.json")) as f:
                threshold = json.load(f)
            print(f"# {name}: threshold {threshold} over {WINDOW} steps; "
                  f"TRL on {threads} torch threads; per run (seed, seconds, steps, first step s, "
                  f"last mean): ours {[_row(r) for r in runs['ours']]}, TRL "
                  f"{[_row(r) for r in runs['trl']]}; load average {os.getloadavg()[0]:.1f}",
                  file=sys.stderr)  # fmt: skip


def _row(r: dict[str, Any]) -> tuple[Any, ...]:
    first = None if r["first"] is None else round(r["first"], 1)
    last = None if r["last_mean"] is None else round(r["last_mean"], 3)
    return (r["seed"], round(r["seconds"], 1), r["steps"], first, last)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="time to reward: ours against TRL")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--tasks", nargs="+", default=["addition", "longtail"])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks that it runs")
    parser.add_argument("--staleness", type=int, default=1, help="ours: the async staleness")
    parser.add_argument(
        "--placement",
        choices=["process", "local"],
        default="process",
        help="ours: one process per role (process) or all in one (local)",
    )
    parser.add_argument(
        "--impl",
        choices=["native", "hf"],
        default="native",
        help="ours: model.impl (native: the built-in model and engine; hf: transformers')",
    )
    parser.add_argument("--child", choices=["ours", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--task", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--started", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child == "trl":
        run_trl(args.task, args.folder, args.seed, args.threads, args.started, args.steps)
    elif args.child == "ours":
        run_ours(args.task, args.folder, args.seed, args.started, args.steps, args.staleness,
                 args.placement, args.impl)  # fmt: skip
    else:
        sys.path.insert(0, os.path.dirname(HERE))
        ours = ("--staleness", str(args.staleness), "--placement", args.placement,
                "--impl", args.impl)  # fmt: skip
        print(f"# ours: staleness {args.staleness}, placement {args.placement}, "
              f"impl {args.impl}", file=sys.stderr)  # fmt: skip
        main(args.seeds, args.tasks, args.quick, ours)
