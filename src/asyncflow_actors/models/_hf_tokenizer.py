"""A Hugging Face folder's ``tokenizer.json`` through the ``tokenizers`` package alone.

``NativeTokenizer`` gives the ids transformers' generic fast tokenizer (``tokenizer_class``
``PreTrainedTokenizerFast`` / ``TokenizersBackend``) gives for the same folder: the same
backend file, special tokens named by ``tokenizer_config.json`` (or ``special_tokens_map.json``),
the BOS/EOS template rebuilt as transformers rebuilds it when the config sets ``add_bos_token``
/ ``add_eos_token`` (else the file's post-processor as it is), and decoding with the same
clean-up. A folder naming a model-specific class (``LlamaTokenizer``, ``Qwen2Tokenizer``...)
raises ``NativeTokenizerError``: transformers may rebuild those, so only transformers can
tokenize them exactly.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["NativeTokenizer", "NativeTokenizerError", "native_tokenizer_class"]

_GENERIC = (None, "PreTrainedTokenizerFast", "TokenizersBackend")
_CLEAN_UP = (
    (" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
    (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"),
)  # fmt: skip  # transformers' ``clean_up_tokenization``, in its order


class NativeTokenizerError(ValueError):
    """The folder's tokenizer cannot be reproduced without transformers."""


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _token(value: object) -> str | None:
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def native_tokenizer_class(folder: str | os.PathLike[str]) -> str | None:
    """``tokenizer_class`` of ``folder/tokenizer_config.json`` (``None`` when not set)."""
    cls = _read_json(os.path.join(os.fspath(folder), "tokenizer_config.json")).get(
        "tokenizer_class"
    )
    return str(cls) if cls is not None else None


class NativeTokenizer:
    """The roles' tokenizer calls (``encode``, ``decode``, ``eos_id``, ``pad_id``,
    ``vocab_size``) over a folder's ``tokenizer.json``; see the module docstring."""

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        from tokenizers import Tokenizer, processors

        self.folder = os.fspath(folder)
        config = _read_json(os.path.join(self.folder, "tokenizer_config.json"))
        cls = config.get("tokenizer_class")
        if cls not in _GENERIC:
            raise NativeTokenizerError(
                f"model.impl='native': tokenizer_class={cls!r} is tokenized by transformers "
                "only; the generic PreTrainedTokenizerFast is native"
            )
        path = os.path.join(self.folder, "tokenizer.json")
        if not os.path.isfile(path):
            raise NativeTokenizerError(f"model.impl='native': no tokenizer.json in {self.folder}")
        self.backend = Tokenizer.from_file(path)
        specials = _read_json(os.path.join(self.folder, "special_tokens_map.json"))
        names = {k: _token(config.get(k, specials.get(k))) for k in ("bos_token", "eos_token",
                                                                     "pad_token")}  # fmt: skip
        ids: dict[str, int | None] = {}
        for key, token in names.items():
            ids[key] = None if token is None else self.backend.token_to_id(token)
            if token is not None and ids[key] is None:
                raise NativeTokenizerError(
                    f"model.impl='native': {key}={token!r} is not in tokenizer.json"
                )
        self.bos_id = ids["bos_token"]
        eos = ids["eos_token"]
        self.eos_id = int(eos if eos is not None else 0)  # as ``HFTokenizer``
        pad = ids["pad_token"]
        self.pad_id = int(pad if pad is not None else self.eos_id)
        explicit = "add_bos_token" in config or "add_eos_token" in config
        if explicit or self.backend.post_processor is None:
            # transformers' ``update_post_processor``: BOS / EOS around the text as configured
            bos, eos_name = names["bos_token"] or "", names["eos_token"] or ""
            add_bos = bool(config.get("add_bos_token", False)) and self.bos_id is not None
            add_eos = bool(config.get("add_eos_token", False)) and eos is not None
            single = (
                f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos_name + ':0' if add_eos else ''}"
            )
            pair = f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1"
            pair += f" {eos_name}:1" if add_eos else ""
            special: list[tuple[str, int]] = []
            if add_bos and self.bos_id is not None:
                special.append((bos, self.bos_id))
            if add_eos:
                special.append((eos_name, self.eos_id))
            self.backend.post_processor = processors.TemplateProcessing(
                single=single, pair=pair, special_tokens=special
            )
        clean = bool(config.get("clean_up_tokenization_spaces", False))
        is_bpe = type(self.backend.model).__name__ == "BPE"
        self.clean_up = clean and not is_bpe
        self.vocab_size = self.backend.get_vocab_size(with_added_tokens=True)
        self._inner: Any = None

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Ids of ``text``; ``add_bos``: with the folder's special tokens (its template)."""
        ids = list(self.backend.encode(text, add_special_tokens=add_bos).ids)
        return [*ids, self.eos_id] if add_eos else ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` up to the first EOS, special tokens skipped."""
        ids = [int(i) for i in ids]
        if self.eos_id in ids:
            ids = ids[: ids.index(self.eos_id)]
        text: str = self.backend.decode(ids, skip_special_tokens=True)
        if self.clean_up:
            for old, new in _CLEAN_UP:
                text = text.replace(old, new)
        return text

    @property
    def inner(self) -> Any:
        """transformers' tokenizer of the folder, loaded on first use: the chat template of a
        conversational dataset is rendered by it (the one place native imports transformers)."""
        if self._inner is None:
            from transformers import AutoTokenizer

            self._inner = AutoTokenizer.from_pretrained(self.folder, local_files_only=True)
        return self._inner
