"""The two topics of a run and the columns each station reads and writes.

``prompts``: one sample per prompt to generate (the Driver writes, Rollout consumes); it names
the ``rollout`` group the Driver opened for it, so a lost or evicted group can be re-injected,
and the policy version it was admitted for: no rollout worker starts its group on older weights.
``rollout``: one sample per response, grouped (the prompt stored once per group, with its
``prompt_key``: the prompt's index, attempt and admitted version, which the Trainer reports for
the sample ledger); stations add their columns and the Trainer consumes samples that have them
all.
"""

from __future__ import annotations

from typing import Final

from ..transfer_queue import TopicSpec
from ._settings import RunSpec

PROMPTS: Final = "prompts"
ROLLOUT: Final = "rollout"

# prompts
PROMPT_TEXT: Final = "prompt"
# (the prompt's token ids, ``PROMPT_IDS`` below: tokenized once, by the Driver, for both topics)
ANSWER: Final = "answer"
GROUP: Final = "group"  # the rollout group id opened for this prompt
PROMPT_INDEX: Final = "prompt_index"  # the prompt's position in the run's prompt stream
MIN_VERSION: Final = "min_version"  # the version it was admitted for: its oldest token's, at least
RECORD: Final = "record"  # the prompt's columns as JSON, for the reward functions

# rollout
PROMPT_IDS: Final = "prompt_ids"  # shared by the group
# shared by the group: (prompt index, attempt, admitted version), the sample ledger's key
PROMPT_KEY: Final = "prompt_key"
RESPONSE_IDS: Final = "response_ids"
BEHAVIOUR: Final = "behaviour_logprobs"  # the engine's logprobs of its own tokens
TOKEN_VERSIONS: Final = "token_versions"  # the policy version of each token
REWARDS: Final = "rewards"
REWARD_PARTS: Final = "reward_parts"  # each reward function's value (nan: no score)
RESUMES: Final = "resumes"  # partial-rollout resubmissions of the sample
OLD: Final = "old_logprobs"  # ActorForward: recomputed with the trainer's weights
REF: Final = "ref_logprobs"  # RefForward
ADVANTAGES: Final = "advantages"

_NEVER_STALE: Final = 1 << 40  # prompts carry no policy version worth evicting for


def topic_specs(spec: RunSpec) -> tuple[TopicSpec, TopicSpec]:
    """The ``prompts`` and ``rollout`` topics of a run."""
    consumers = ([] if spec.trainer_forward else ["actor_fwd"]) + (
        ["ref_fwd"] if spec.use_ref else []
    )
    consumers += (["advantage"] if spec.advantage_station else []) + ["trainer"]
    prompts = TopicSpec.from_dict(
        {
            "consumers": ["rollout"],
            "staleness": _NEVER_STALE,
            "lease_ttl": 3600.0,  # a long-tail generation holds its prompt for a while
            "columns": {
                PROMPT_TEXT: {},
                PROMPT_IDS: {"dtype": "int64", "shape": [None]},
                ANSWER: {},
                GROUP: {"dtype": "int64", "shape": []},
                PROMPT_INDEX: {"dtype": "int64", "shape": []},
                MIN_VERSION: {"dtype": "int64", "shape": []},
                RECORD: {},
            },
        },
        name=PROMPTS,
    )
    rollout = TopicSpec.from_dict(
        {
            "consumers": consumers,
            "staleness": spec.staleness,
            "lease_ttl": 600.0,
            "columns": {
                PROMPT_IDS: {"dtype": "int64", "shape": [None], "shared": True},
                PROMPT_KEY: {"dtype": "int64", "shape": [3], "shared": True},
                RESPONSE_IDS: {"dtype": "int64", "shape": [None]},
                BEHAVIOUR: {"dtype": "float32", "shape": [None]},
                TOKEN_VERSIONS: {"dtype": "int64", "shape": [None]},
                REWARDS: {"dtype": "float32", "shape": []},
                REWARD_PARTS: {"dtype": "float32", "shape": [max(1, len(spec.task.reward))]},
                RESUMES: {"dtype": "int64", "shape": []},
                OLD: {"dtype": "float32", "shape": [None]},
                REF: {"dtype": "float32", "shape": [None]},
                ADVANTAGES: {"dtype": "float32", "shape": [None]},
            },
        },
        name=ROLLOUT,
    )
    return prompts, rollout


def station_columns(spec: RunSpec) -> dict[str, tuple[str, ...]]:
    """The columns each station waits for.

    Streaming (async): each station needs only the rollout's columns, so the forwards and the
    advantage run in parallel on the same samples. With stage barriers (sync, colocated,
    one-step-off) each stage also waits for the previous one's column: the six stages of a
    synchronous step run in sequence. With ``fused_advantage`` ActorForward also reads the
    rewards (it computes the advantages too) and there is no ``advantage`` station. What the
    trainer computes itself (``trainer_forward``, ``trainer_advantage``) it does not wait for.
    """
    fwd = (PROMPT_IDS, RESPONSE_IDS)
    old = () if spec.trainer_forward else (OLD,)
    ref = fwd + (old if spec.stage_barrier else ())
    adv: tuple[str, ...] = (REWARDS, RESPONSE_IDS)
    if spec.stage_barrier:
        adv += (REF,) if spec.use_ref else old
    train: tuple[str, ...] = (PROMPT_IDS, RESPONSE_IDS, BEHAVIOUR, TOKEN_VERSIONS, REWARDS, RESUMES)
    train += (PROMPT_KEY,)  # the sample ledger's (``_ledger``)
    train += old + (() if spec.trainer_advantage else (ADVANTAGES,))
    if spec.use_ref:
        train += (REF,)
    if spec.task.reward:  # per-function figures (``reward/<name>``)
        train += (REWARD_PARTS,)
    if spec.fused_advantage:
        return {"actor_fwd": (*fwd, REWARDS), "ref_fwd": ref, "trainer": train}
    return {"actor_fwd": fwd, "ref_fwd": ref, "advantage": adv, "trainer": train}
