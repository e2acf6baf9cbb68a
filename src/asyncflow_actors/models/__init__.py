"""The tiny policy model: a small LLaMA-style decoder, its tokenizer, sampling and I/O.

Pure torch, free of actors and I/O except the explicit save/load functions. It is the policy of
the CPU examples and tests and the model that the built-in generation engine serves.
"""

from __future__ import annotations

from ._batch import BatchLayoutError as BatchLayoutError
from ._batch import PackedBatch as PackedBatch
from ._batch import left_pad as left_pad
from ._batch import pack_batch as pack_batch
from ._config import ModelConfigError as ModelConfigError
from ._config import TinyConfig as TinyConfig
from ._hf_folder import NativeConfigError as NativeConfigError
from ._hf_folder import NativeModelInfo as NativeModelInfo
from ._hf_folder import load_native_model as load_native_model
from ._hf_folder import native_model_info as native_model_info
from ._hf_folder import tiny_weights_from_llama as tiny_weights_from_llama
from ._hf_tokenizer import NativeTokenizer as NativeTokenizer
from ._hf_tokenizer import NativeTokenizerError as NativeTokenizerError
from ._io import load_model as load_model
from ._io import load_tokenizer as load_tokenizer
from ._io import save_model as save_model
from ._kv_cache import KVCache as KVCache
from ._kv_cache import KVCacheError as KVCacheError
from ._logprobs import TokenLogprobs as TokenLogprobs
from ._logprobs import entropy_from_logits as entropy_from_logits
from ._logprobs import token_logprobs as token_logprobs
from ._model import ModelInputError as ModelInputError
from ._model import TinyDecoder as TinyDecoder
from ._model import decode_step as decode_step
from ._safetensors import SafetensorsError as SafetensorsError
from ._safetensors import SafetensorsFile as SafetensorsFile
from ._safetensors import deserialize_safetensors as deserialize_safetensors
from ._safetensors import load_safetensors as load_safetensors
from ._safetensors import save_safetensors as save_safetensors
from ._safetensors import serialize_safetensors as serialize_safetensors
from ._sampling import GenerationOutput as GenerationOutput
from ._sampling import SamplingError as SamplingError
from ._sampling import SamplingParams as SamplingParams
from ._sampling import generate as generate
from ._sampling import sample_next as sample_next
from ._tokenizer import DEFAULT_ALPHABET as DEFAULT_ALPHABET
from ._tokenizer import CharTokenizer as CharTokenizer
from ._tokenizer import TokenizerError as TokenizerError
