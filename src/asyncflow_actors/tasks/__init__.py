"""Bring your own task: reward functions by import path, datasets (jsonl, parquet, Hugging
Face ``datasets``) with chat-templated prompts, evaluation settings (``docs/tasks.md``).

Above ``rl`` (which stays pure) and below ``roles`` (which call it): this layer imports the
user's modules, reads files and runs the user's functions off the event loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._dataset import DatasetTask as DatasetTask
    from ._dataset import PreparedPrompts as PreparedPrompts
    from ._dataset import read_records as read_records
    from ._dataset import render_prompt as render_prompt
    from ._functions import RewardImportError as RewardImportError
    from ._functions import function_name as function_name
    from ._functions import function_path as function_path
    from ._functions import import_roots as import_roots
    from ._functions import load_function as load_function
    from ._functions import module_prefixes as module_prefixes
    from ._scoring import GroupScore as GroupScore
    from ._scoring import RewardFailed as RewardFailed
    from ._scoring import RewardRunner as RewardRunner
    from ._scoring import ToScore as ToScore
    from ._settings import DatasetSettings as DatasetSettings
    from ._settings import EvalSettings as EvalSettings
    from ._settings import RewardSettings as RewardSettings
    from ._settings import TaskSettingsError as TaskSettingsError

__all__ = [
    "DatasetSettings",
    "DatasetTask",
    "EvalSettings",
    "GroupScore",
    "PreparedPrompts",
    "RewardFailed",
    "RewardImportError",
    "RewardRunner",
    "RewardSettings",
    "TaskSettingsError",
    "ToScore",
    "function_name",
    "function_path",
    "import_roots",
    "load_function",
    "module_prefixes",
    "read_records",
    "render_prompt",
]

_LAZY = {
    "DatasetTask": "._dataset",
    "PreparedPrompts": "._dataset",
    "read_records": "._dataset",
    "render_prompt": "._dataset",
    "RewardImportError": "._functions",
    "function_name": "._functions",
    "function_path": "._functions",
    "import_roots": "._functions",
    "load_function": "._functions",
    "module_prefixes": "._functions",
    "GroupScore": "._scoring",
    "RewardFailed": "._scoring",
    "RewardRunner": "._scoring",
    "ToScore": "._scoring",
    "DatasetSettings": "._settings",
    "EvalSettings": "._settings",
    "RewardSettings": "._settings",
    "TaskSettingsError": "._settings",
}


def __getattr__(name: str) -> Any:
    # lazy: the settings are imported by the configuration, which must not import torch
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module, __name__), name)
