"""Torch tensors met by several layers, without importing torch (internal).

torch loads lazily: a node hosting storage units imports this package without it, so the
client's batches and the units' blocks recognise tensors through ``sys.modules``.
"""

from __future__ import annotations

import sys
from typing import Any


def torch_module() -> Any:
    import torch

    return torch


def is_tensor(value: Any) -> bool:
    # torch loads lazily: a node hosting storage units imports this package without it
    # (or half imported by another thread: no ``Tensor`` yet, and no tensor to meet either)
    tensor = getattr(sys.modules.get("torch"), "Tensor", None)
    return tensor is not None and isinstance(value, tensor)


def dtype_name(t: Any) -> str:
    return str(t.dtype).removeprefix("torch.")
