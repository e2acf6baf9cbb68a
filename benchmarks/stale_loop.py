"""Steps to the threshold of ``peer_trl``'s addition task in a plain one-process GRPO loop with
an exact rollout delay: what one version of staleness costs the algorithm itself, with no
pipeline in between (issue 28).

``python benchmarks/stale_loop.py FOLDER --delay 1 --anchor behaviour --seeds 1 2 3``, where
``FOLDER`` is a model folder ``peer_trl.build("addition", FOLDER, False)`` wrote. The loop has
``peer_trl``'s settings (16 prompts x 8, 4 new tokens, AdamW lr 5e-4, ``max_grad_norm`` 1,
token-mean, clip 0.2, no KL, the prompts in order, the same reward); each step generates
batch ``k + delay`` with the current weights before it trains on batch ``k``, so every batch
after the first ``delay`` is exactly ``delay`` versions stale (as the pipeline's rollout runs
when it is the faster side). ``--anchor``: the PPO ratio against the trainer's current weights
(``proximal``, ratio 1) or the sampler's log-probs (``behaviour``); ``--is``: importance
weights for the proximal anchor (``none``, ``token``, ``sequence``, truncated at 2). Prints one
JSON line per seed: the step whose 10-step mean reward reached the threshold (null: not in the
prompts' 600 steps).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import peer_trl

from asyncflow_actors.rl import (
    OffPolicyCorrection,
    PPOLossConfig,
    grpo_advantages,
    policy_loss,
)

GROUP, PROMPTS, NEW_TOKENS, STEPS = 8, 16, 4, 600


def _logprobs(model: Any, ids: torch.Tensor, start: int) -> torch.Tensor:
    logits = model(input_ids=ids).logits[:, start - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, start:, None]).squeeze(-1)


def run(folder: str, seed: int, delay: int, anchor: str, level: str) -> int | None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    with open(os.path.join(folder, "threshold.json")) as f:
        threshold = json.load(f)
    with open(os.path.join(folder, "prompts.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-4, weight_decay=0.0)
    eos = model.config.eos_token_id
    generator = torch.Generator().manual_seed(seed)
    groups = torch.arange(PROMPTS).repeat_interleave(GROUP)

    @torch.no_grad()
    def rollout(k: int) -> tuple[torch.Tensor, int, torch.Tensor, torch.Tensor, torch.Tensor]:
        batch = rows[k * PROMPTS : (k + 1) * PROMPTS]
        prompts = [tokenizer(r["prompt"])["input_ids"] for r in batch]
        start = len(prompts[0])  # 2-digit operands: every prompt has one length
        ids = torch.tensor(prompts).repeat_interleave(GROUP, 0)
        done = torch.zeros(len(ids), dtype=torch.bool)
        lengths = torch.zeros(len(ids), dtype=torch.long)
        for _ in range(NEW_TOKENS):
            probs = torch.softmax(model(input_ids=ids).logits[:, -1].float(), -1)
            token = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
            token = torch.where(done, torch.zeros_like(token), token)
            lengths += (~done).long()
            done |= token == eos
            ids = torch.cat([ids, token[:, None]], 1)
        mask = (torch.arange(NEW_TOKENS)[None] < lengths[:, None]).float()
        texts = [
            tokenizer.decode([t for t in ids[i, start : start + int(n)].tolist() if t != eos])
            for i, n in enumerate(lengths)
        ]
        answers = [r["answer"] for r in batch for _ in range(GROUP)]
        rewards = torch.tensor(peer_trl.reward([], texts, answers), dtype=torch.float32)
        return ids, start, mask, rewards, _logprobs(model, ids, start) * mask

    correction = None if level == "none" else OffPolicyCorrection(is_level=level)  # type: ignore[arg-type]
    config = PPOLossConfig(agg="token-mean", correction=correction, anchor=anchor)  # type: ignore[arg-type]
    queue = [rollout(k) for k in range(delay)]
    rewards_seen: list[float] = []
    for k in range(STEPS - delay):
        queue.append(rollout(k + delay))  # the current weights, before this step's update
        ids, start, mask, rewards, behaviour = queue.pop(0)
        advantages = grpo_advantages(rewards, groups, mask).advantages
        logp = _logprobs(model, ids, start)
        out = policy_loss(logp, logp.detach(), advantages, mask, config,
                          behaviour_logprobs=behaviour)  # fmt: skip
        optimizer.zero_grad()
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        rewards_seen.append(float(rewards.mean()))
        if len(rewards_seen) >= 10 and statistics.mean(rewards_seen[-10:]) >= threshold:
            return k + 1
    return None


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder")
    parser.add_argument("--delay", type=int, default=1)
    parser.add_argument("--anchor", choices=["proximal", "behaviour"], default="behaviour")
    parser.add_argument("--is", dest="level", choices=["none", "token", "sequence"],
                        default="none")  # fmt: skip
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    args = parser.parse_args()
    for seed in args.seeds:
        steps = run(args.folder, seed, args.delay, args.anchor, args.level)
        print(json.dumps({"seed": seed, "delay": args.delay, "anchor": args.anchor,
                          "is": args.level, "steps": steps}), flush=True)  # fmt: skip
