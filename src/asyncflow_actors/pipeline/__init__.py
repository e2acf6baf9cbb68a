"""The AsyncFlow pipeline: compose the roles into a run (``docs/pipeline.md``).

Modes: ``sync`` (the six stages in sequence: the baseline), ``colocated`` (rollout and training
share one model in one process and take turns), ``one_step_off`` (whole-batch stages, rollout one
version ahead) and ``async`` (streaming stations, rollout up to ``staleness`` versions ahead;
``staleness = 0`` is on-policy by construction). Placement is configuration: every role in this
process, one node process per role (the CPU default), or nodes started by hand.

    config = PipelineConfig.from_toml("run.toml")
    result = trio.run(run_pipeline, config)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._config import MODES as MODES
from ._config import PipelineConfig as PipelineConfig
from ._config import PipelineConfigError as PipelineConfigError
from ._config import PlacementConfig as PlacementConfig

if TYPE_CHECKING:
    from ._placement import RunFailed as RunFailed
    from ._plot import plot_run as plot_run
    from ._preflight import preflight as preflight
    from ._report import StepRecord as StepRecord
    from ._report import read_steps as read_steps
    from ._run import Pipeline as Pipeline
    from ._run import PipelineResult as PipelineResult
    from ._run import open_pipeline as open_pipeline
    from ._run import run_pipeline as run_pipeline
    from ._samples import SampleCheck as SampleCheck
    from ._samples import SampleRecord as SampleRecord
    from ._samples import SamplesFileError as SamplesFileError
    from ._samples import check_samples as check_samples
    from ._samples import read_samples as read_samples

# Lazy: the configuration loads (and fails) without torch, which the run itself imports.
_LAZY = {
    "RunFailed": "._placement",
    "preflight": "._preflight",
    "StepRecord": "._report",
    "plot_run": "._plot",
    "read_steps": "._report",
    "Pipeline": "._run",
    "PipelineResult": "._run",
    "open_pipeline": "._run",
    "run_pipeline": "._run",
    "SampleCheck": "._samples",
    "SampleRecord": "._samples",
    "SamplesFileError": "._samples",
    "check_samples": "._samples",
    "read_samples": "._samples",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module, __name__), name)
