"""The stations of an AsyncFlow run, as actors (``docs/pipeline.md``).

Every station shares one skeleton (``Station``: fetch → compute → write back → ack, with a
data-parallel dispatch and availability probe, compute in worker threads, leases returned on a
crash) and talks to the others only through the TransferQueue:

- ``Driver``: admission (FlowControl), versions, the weight-sync trigger, re-injection;
- ``Rollout`` (+ ``Reward``): whole scored groups from one or more generation engines;
- ``ActorForward`` / ``RefForward``: old (recomputed) and reference log-probs;
- ``Advantage``: group-relative advantages with ``rl``;
- ``Trainer``: PPO updates on complete, fresh samples; a version per global batch; one
  process or a group of ranks on torch.distributed (``DistributedLearner``, docs/training.md).

The role classes import torch (the weight-sync messages hold tensors) and load lazily; a node
imports them in a worker thread first (``asyncflow_actors.roles.preload``), and stations build
their models and compute in worker threads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._advantage import Advantage as Advantage
    from ._completions import SampleCompletion as SampleCompletion
    from ._distributed import DistributedLearner as DistributedLearner
    from ._driver import Driver as Driver
    from ._driver import DriverHooks as DriverHooks
    from ._driver import DriverState as DriverState
    from ._forward import ActorForward as ActorForward
    from ._forward import PolicyCopy as PolicyCopy
    from ._forward import RefForward as RefForward
    from ._messages import AdoptVersion as AdoptVersion
    from ._messages import GetRoleStats as GetRoleStats
    from ._messages import RoleStatistics as RoleStatistics
    from ._messages import SaveCheckpoint as SaveCheckpoint
    from ._messages import Score as Score
    from ._messages import Scored as Scored
    from ._messages import StepAck as StepAck
    from ._messages import StepDone as StepDone
    from ._messages import Stopped as Stopped
    from ._messages import StopRun as StopRun
    from ._messages import SyncReport as SyncReport
    from ._messages import SyncWeights as SyncWeights
    from ._multi_engine import MultiEngine as MultiEngine
    from ._rank_settings import ParallelSettings as ParallelSettings
    from ._rank_sync import ShardedSyncEngine as ShardedSyncEngine
    from ._ranks import RankFailed as RankFailed
    from ._ranks import Rendezvous as Rendezvous
    from ._report_settings import ReportSettings as ReportSettings
    from ._reward import Reward as Reward
    from ._rollout import Rollout as Rollout
    from ._schema import PROMPTS as PROMPTS
    from ._schema import ROLLOUT as ROLLOUT
    from ._schema import station_columns as station_columns
    from ._schema import topic_specs as topic_specs
    from ._settings import AlgorithmSettings as AlgorithmSettings
    from ._settings import LoraSettings as LoraSettings
    from ._settings import ModelSettings as ModelSettings
    from ._settings import RolloutSettings as RolloutSettings
    from ._settings import RunSpec as RunSpec
    from ._settings import SettingsError as SettingsError
    from ._settings import TaskSettings as TaskSettings
    from ._settings import TrainSettings as TrainSettings
    from ._trainer import StalenessViolation as StalenessViolation
    from ._trainer import Trainer as Trainer
    from ._worker import DataParallel as DataParallel
    from ._worker import Station as Station

# Lazy: a node imports this package to spawn a role; torch loads with the first role class.
_LAZY = {
    "Advantage": "._advantage",
    "Driver": "._driver",
    "DriverHooks": "._driver",
    "DriverState": "._driver",
    "ActorForward": "._forward",
    "PolicyCopy": "._forward",
    "RefForward": "._forward",
    "AdoptVersion": "._messages",
    "GetRoleStats": "._messages",
    "RoleStatistics": "._messages",
    "SaveCheckpoint": "._messages",
    "Stopped": "._messages",
    "StopRun": "._messages",
    "Score": "._messages",
    "Scored": "._messages",
    "StepAck": "._messages",
    "StepDone": "._messages",
    "SyncReport": "._messages",
    "SyncWeights": "._messages",
    "MultiEngine": "._multi_engine",
    "Reward": "._reward",
    "Rollout": "._rollout",
    "PROMPTS": "._schema",
    "ROLLOUT": "._schema",
    "station_columns": "._schema",
    "topic_specs": "._schema",
    "AlgorithmSettings": "._settings",
    "ModelSettings": "._settings",
    "RolloutSettings": "._settings",
    "RunSpec": "._settings",
    "SettingsError": "._settings",
    "TaskSettings": "._settings",
    "TrainSettings": "._settings",
    "ReportSettings": "._report_settings",
    "SampleCompletion": "._completions",
    "StalenessViolation": "._trainer",
    "Trainer": "._trainer",
    "DataParallel": "._worker",
    "Station": "._worker",
    # the trainer's ranks (docs/training.md)
    "DistributedLearner": "._distributed",
    "ParallelSettings": "._rank_settings",
    "ShardedSyncEngine": "._rank_sync",
    "RankFailed": "._ranks",
    "Rendezvous": "._ranks",
    "LoraSettings": "._settings",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module, __name__), name)
