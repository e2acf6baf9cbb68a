"""Rollout: the ``GenerationEngine`` interface and its engines (``docs/engines.md``).

- ``open_torch_engine``: the built-in engine, continuous batching of a ``TinyDecoder``.
- ``open_hf_engine`` (extra ``hf``): a Hugging Face ``AutoModelForCausalLM`` from a local folder.
- ``open_vllm_engine`` (extra ``vllm``; vllm-ascend on Ascend): vLLM's ``AsyncLLM``.

Every engine is a weight-sync target (``checkpoint.SyncTarget``) and records, for every token,
the version of the weights that produced it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._config import EngineConfig as EngineConfig
from ._config import EngineConfigError as EngineConfigError
from ._core import CompletionStream as CompletionStream
from ._protocol import CompletionStreamLike as CompletionStreamLike
from ._protocol import GenerationEngine as GenerationEngine
from ._protocol import generate_samples as generate_samples
from ._protocol import generate_with_resume as generate_with_resume
from ._torch_engine import TorchEngine as TorchEngine
from ._torch_engine import open_torch_engine as open_torch_engine
from ._types import Completion as Completion
from ._types import CompletionDelta as CompletionDelta
from ._types import EngineClosed as EngineClosed
from ._types import EngineError as EngineError
from ._types import EngineStatistics as EngineStatistics
from ._types import FinishReason as FinishReason
from ._types import GenerationRequest as GenerationRequest
from ._types import RequestError as RequestError
from ._types import ResumeLimitError as ResumeLimitError
from ._types import SamplingConfig as SamplingConfig
from ._types import WeightLoadError as WeightLoadError

if TYPE_CHECKING:
    from ._hf_engine import HFEngine as HFEngine
    from ._hf_engine import open_hf_engine as open_hf_engine
    from ._hf_export import export_hf as export_hf
    from ._hf_export import llama_config_from_tiny as llama_config_from_tiny
    from ._hf_export import llama_weights_from_tiny as llama_weights_from_tiny
    from ._hf_load import load_causal_lm as load_causal_lm
    from ._vllm_engine import VLLMEngine as VLLMEngine
    from ._vllm_lora import VLLMLora as VLLMLora
    from ._vllm_open import close_vllm_engine as close_vllm_engine
    from ._vllm_open import open_vllm_engine as open_vllm_engine
    from ._vllm_open import start_vllm_engine as start_vllm_engine

# The optional backends import transformers / vllm, so they load on first use.
_LAZY = {
    "HFEngine": "._hf_engine",
    "open_hf_engine": "._hf_engine",
    "export_hf": "._hf_export",
    "llama_config_from_tiny": "._hf_export",
    "llama_weights_from_tiny": "._hf_export",
    "load_causal_lm": "._hf_load",
    "VLLMEngine": "._vllm_engine",
    "VLLMLora": "._vllm_lora",
    "open_vllm_engine": "._vllm_open",
    "start_vllm_engine": "._vllm_open",
    "close_vllm_engine": "._vllm_open",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module, __name__), name)
