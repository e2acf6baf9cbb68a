"""Everything about a run that can be checked before a process starts.

``PipelineConfig`` checks its own values (types, ranges, choices, consistency); ``preflight``
adds what needs the filesystem or the task: the model's files exist and load their config, the
task's options match its signature and build it, prompts plus ``max_new_tokens`` fit the
model's ``max_seq_len``, the trackers of ``report.report_to`` are installed, the checkpoint
to resume exists, lies before ``train.steps`` and
holds the same ``[model]``, a new run's ``run_dir`` holds no run.
Each problem raises ``PipelineConfigError`` naming the key, within a second or two: the
cheapest checks (paths) come first, those that import torch (the task) last.

``preflight`` is ``check_paths`` (milliseconds: files, directories, the checkpoint to resume,
no import) then ``check_contents`` (seconds: transformers loads the model's config, the task
and its dataset build). ``open_pipeline`` starts the run's node processes after the first and
beside the second (they spend those seconds importing torch), and stops them on its error.
"""

from __future__ import annotations

import inspect
import json
import os
import struct
from typing import Any

from ..roles._settings import SettingsError
from ._config import PipelineConfig, PipelineConfigError
from ._rundir import check_model, check_run_dir, checkpoint_version, resolve_resume
from ._tracker_check import check_trackers
from ._warmup import check_warmup

_SAMPLED_PROMPTS = 1024  # prompts drawn to bound a task's prompt length


def preflight(
    config: PipelineConfig, *, resume: str | None = None, overwrite: bool = False
) -> str | None:
    """Check ``config`` (and ``resume``) as far as possible without starting anything; returns
    the checkpoint directory ``resume`` means (``None`` without one). A new run's ``run_dir``
    must not hold a run unless ``overwrite``."""
    checkpoint = check_paths(config, resume=resume, overwrite=overwrite)
    check_contents(config, checkpoint)
    return checkpoint


def check_paths(
    config: PipelineConfig, *, resume: str | None = None, overwrite: bool = False
) -> str | None:
    """The first, quick half of ``preflight`` (no import, no file read beyond a few small
    JSON files): the checkpoint ``resume`` means, the ``run_dir``, the optional packages and
    trackers, the model's files; returns the checkpoint directory (``None`` without one)."""
    checkpoint = resolve_resume(resume) if resume else None
    _check_vllm_lora(config, checkpoint)
    check_run_dir(config, resume=checkpoint, overwrite=overwrite)
    _check_extras(config)
    check_trackers(config)
    _check_model_files(config)
    if checkpoint is not None:
        check_model(config, checkpoint)
        version = checkpoint_version(checkpoint)
        assert version is not None
        if config.train.steps <= version:
            raise PipelineConfigError(
                f"train.steps: {config.train.steps} is not beyond the checkpoint's step "
                f"{version} ({checkpoint}): give more steps, e.g. --steps {version * 2}"
            )
    return checkpoint


def check_contents(config: PipelineConfig, checkpoint: str | None) -> None:
    """The second, slower half of ``preflight`` (after ``check_paths``, whose checkpoint it
    takes): the model's config loads, the task builds and its prompts fit."""
    max_seq_len = _check_model(config)
    task = _check_task(config)
    check_warmup(config, task, resume=checkpoint)
    # a dataset's prompts are held to its own max_prompt_length (filtered, truncated or
    # refused when read, by task.dataset.overlong)
    if max_seq_len is not None and config.task.kind != "dataset":
        _check_lengths(config, task, max_seq_len)


def _check_extras(config: PipelineConfig) -> None:
    """The optional packages the settings need are installed (found, not imported)."""
    import importlib.util

    train = config.train
    if train.ranks > 1 and train.rank_launcher == "ray" and importlib.util.find_spec("ray") is None:
        raise PipelineConfigError(
            "train.rank_launcher: 'ray' needs ray, which is not installed (the 'ray' extra)"
        )
    if config.model.native and importlib.util.find_spec("tokenizers") is None:
        raise PipelineConfigError(
            "model.impl: 'native' reads tokenizer.json with tokenizers, which is not installed "
            "(the 'hf' extra)"
        )


def _check_model_files(config: PipelineConfig) -> None:
    """The model's files exist (``_check_model`` loads them)."""
    model = config.model
    if model.hf is not None:
        if not os.path.isdir(model.hf):
            raise PipelineConfigError(f"model.hf: no such directory: {model.hf}")
        if not os.path.isfile(os.path.join(model.hf, "config.json")):
            raise PipelineConfigError(
                f"model.hf: {model.hf} is not a Hugging Face model folder (no config.json)"
            )
    elif model.init is not None and not os.path.isfile(model.init):
        raise PipelineConfigError(f"model.init: no such file: {model.init}")


def _check_native_folder(folder: str | None) -> None:
    """``model.impl="native"``: the folder's config and tokenizer are representable
    (``NativeConfigError`` names the field). Prompt lengths are in its tokenizer's tokens,
    checked as an ``hf`` run's are."""
    from ..models import native_model_info
    from ..models._config import ModelConfigError
    from ..roles._native_policy import native_tokenizer

    assert folder is not None
    try:
        native_model_info(folder)
        native_tokenizer(folder)
    except (ModelConfigError, ValueError, OSError) as exc:
        raise PipelineConfigError(f"model.hf: {_line(exc)}") from exc


def _check_model(config: PipelineConfig) -> int | None:
    """The model's files (``_check_model_files``) load their config; its ``max_seq_len`` if
    known."""
    _check_model_files(config)
    model = config.model
    if model.native:
        _check_native_folder(model.hf)
        return None
    if model.hf is not None:
        try:
            from transformers import AutoConfig

            AutoConfig.from_pretrained(model.hf, local_files_only=True)
        except ImportError as exc:
            raise PipelineConfigError(
                f"model.hf: transformers is not installed (the 'hf' extra): {exc}"
            ) from exc
        except Exception as exc:
            raise PipelineConfigError(f"model.hf: {model.hf} does not load: {_line(exc)}") from exc
        return None  # prompt lengths are in its tokenizer's tokens: known once it loads
    if model.init is not None:
        meta = _safetensors_metadata(model.init)
        try:
            return int(json.loads(meta["config"])["max_seq_len"])
        except (KeyError, ValueError, TypeError) as exc:
            raise PipelineConfigError(
                f"model.init: {model.init} is not a model saved by models.save_model "
                "(no config in its metadata)"
            ) from exc
    return model.max_seq_len


def _safetensors_metadata(path: str) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file, read from its header (no torch)."""
    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > 100_000_000:
                raise ValueError(f"a header of {size} bytes")
            header = json.loads(f.read(size))
        meta = header.get("__metadata__", {})
        if not isinstance(meta, dict):
            raise ValueError("__metadata__ is not a map")
        return {str(k): str(v) for k, v in meta.items()}
    except (OSError, ValueError, struct.error) as exc:
        raise PipelineConfigError(
            f"model.init: {path} is not a safetensors file: {_line(exc)}"
        ) from exc


def _check_task(config: PipelineConfig) -> Any:
    """The task's options match its constructor, and it builds; the task."""
    from .. import rl

    settings = config.task
    if settings.kind == "dataset":  # its own settings (task.dataset) were checked when read
        try:
            return settings.build()
        except (SettingsError, ValueError, TypeError, OSError) as exc:
            message = str(exc)
            raise PipelineConfigError(
                message if message.startswith("task.") else f"task.dataset: {message}"
            ) from exc
    make: Any = {
        "addition": rl.AdditionTask,
        "longtail": rl.LongTailTask,
        "jsonl": rl.load_jsonl_task,
    }[settings.kind]
    known = {
        name
        for name, p in inspect.signature(make).parameters.items()
        if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
    }
    for key in settings.options:
        if key not in known:
            raise PipelineConfigError(
                f"task.options.{key}: not an option of the {settings.kind} task "
                f"(options: {sorted(known)})"
            )
    if settings.kind == "jsonl":
        path = settings.options.get("path")
        if isinstance(path, str) and not os.path.isfile(path):
            raise PipelineConfigError(f"task.options.path: no such file: {path}")
    try:
        return settings.build()
    except (SettingsError, ValueError, TypeError, OSError) as exc:
        message = str(exc)
        raise PipelineConfigError(
            message if message.startswith("task.") else f"task.options: {message}"
        ) from exc


def _check_lengths(config: PipelineConfig, task: Any, max_seq_len: int) -> None:
    """The longest prompt (BOS included) plus ``max_new_tokens`` fits ``max_seq_len`` (the
    built-in character tokenizer: a token per character)."""
    longest = max(len(p.prompt) for p in task.sample(_SAMPLED_PROMPTS, config.task.seed)) + 1
    bound = getattr(task, "max_length", None)  # LongTailTask: "r:" + the string + "="
    if isinstance(bound, int) and config.task.kind == "longtail":
        longest = max(longest, bound + 4)
    new = config.rollout.max_new_tokens
    if longest + new > max_seq_len:
        raise PipelineConfigError(
            f"rollout.max_new_tokens: prompts of up to {longest} tokens + {new} new tokens "
            f"exceed the model's max_seq_len = {max_seq_len}"
        )


def _line(exc: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _check_vllm_lora(config: PipelineConfig, checkpoint: str | None) -> None:
    """``rollout.vllm_lora``: what an adapters-only sync into vLLM needs (docs/training.md)."""
    if not config.rollout.vllm_lora:
        return
    problem = None
    if config.rollout.engine != "vllm":
        problem = f"needs rollout.engine = 'vllm', not {config.rollout.engine!r}"
    elif not config.model.lora.enabled:
        problem = "needs model.lora (r > 0): there is no adapter to sync"
    elif config.train.forward_ranks > 1:
        problem = "forward stations on ranks (train.forward_ranks > 1) load merged weights only"
    elif unsynced := [m for m in config.model.lora.target_modules if m in _UNSYNCED]:
        problem = f"the sync carries linear projections' adapters, not {unsynced}"
    elif checkpoint is not None and not os.path.isfile(
        os.path.join(checkpoint, "adapter", "adapter_model.safetensors")
    ):
        problem = (
            f"the checkpoint holds no adapter/ ({checkpoint}: written before LoRA checkpoints "
            "kept it), only the merged policy: resume with rollout.vllm_lora = false"
        )
    if problem is not None:
        raise PipelineConfigError(f"rollout.vllm_lora: {problem}")


# vLLM serves these as embeddings / a padded vocabulary: not carried by its LoRA-only sync
_UNSYNCED = ("embed_tokens", "lm_head")
