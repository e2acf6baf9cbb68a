"""RL algorithms as pure torch functions: advantages, PPO-family losses, off-policy
corrections, KL estimators, verifiable tasks and an SFT warm-up.

No actors and no I/O (beyond the explicit task loaders). Every per-token function takes [B, T]
tensors with an explicit `response_mask`; groups are given by `group_ids`. Formulas:
docs/algorithms.md.
"""

from __future__ import annotations

from ._advantages import AdvantageOutput as AdvantageOutput
from ._advantages import dr_grpo_advantages as dr_grpo_advantages
from ._advantages import gae_advantages as gae_advantages
from ._advantages import grpo_advantages as grpo_advantages
from ._advantages import reinforce_pp_advantages as reinforce_pp_advantages
from ._advantages import rloo_advantages as rloo_advantages
from ._advantages import terminal_rewards as terminal_rewards
from ._aggregate import AGG_MODES as AGG_MODES
from ._aggregate import AggMode as AggMode
from ._aggregate import aggregate as aggregate
from ._aggregate import masked_mean as masked_mean
from ._aggregate import masked_sum as masked_sum
from ._aggregate import masked_whiten as masked_whiten
from ._corrections import IS_LEVELS as IS_LEVELS
from ._corrections import REJECTION_LEVELS as REJECTION_LEVELS
from ._corrections import ISLevel as ISLevel
from ._corrections import OffPolicyCorrection as OffPolicyCorrection
from ._corrections import RejectionLevel as RejectionLevel
from ._corrections import importance_log_ratio as importance_log_ratio
from ._corrections import importance_metrics as importance_metrics
from ._corrections import rejection_mask as rejection_mask
from ._corrections import truncated_is_weights as truncated_is_weights
from ._errors import RLInputError as RLInputError
from ._errors import TaskError as TaskError
from ._evaluate import EvalResult as EvalResult
from ._evaluate import decode_responses as decode_responses
from ._evaluate import encode_answers as encode_answers
from ._evaluate import encode_prompts as encode_prompts
from ._evaluate import evaluate as evaluate
from ._file_task import FileTask as FileTask
from ._file_task import exact_match_score as exact_match_score
from ._file_task import load_jsonl_task as load_jsonl_task
from ._file_task import load_parquet_task as load_parquet_task
from ._groups import ScoredGroups as ScoredGroups
from ._groups import sample_groups as sample_groups
from ._groups import score_group as score_group
from ._kl import KL_ESTIMATORS as KL_ESTIMATORS
from ._kl import KLEstimator as KLEstimator
from ._kl import kl_estimate as kl_estimate
from ._losses import ANCHORS as ANCHORS
from ._losses import Anchor as Anchor
from ._losses import ClippedSurrogate as ClippedSurrogate
from ._losses import PolicyLossOutput as PolicyLossOutput
from ._losses import PPOLossConfig as PPOLossConfig
from ._losses import ValueLossOutput as ValueLossOutput
from ._losses import clipped_surrogate as clipped_surrogate
from ._losses import policy_loss as policy_loss
from ._losses import value_loss as value_loss
from ._rewards import RewardValueError as RewardValueError
from ._rewards import check_reward_values as check_reward_values
from ._rewards import pass_at_k as pass_at_k
from ._rewards import weighted_rewards as weighted_rewards
from ._sft import SFTResult as SFTResult
from ._sft import sft_warmup as sft_warmup
from ._tasks import AdditionTask as AdditionTask
from ._tasks import LongTailTask as LongTailTask
from ._tasks import Problem as Problem
from ._tasks import Task as Task
from ._tasks import position_match_score as position_match_score
from ._tasks import score_responses as score_responses
