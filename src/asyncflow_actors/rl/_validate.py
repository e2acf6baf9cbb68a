"""Boundary checks shared by the RL functions (private)."""

from __future__ import annotations

import torch
from torch import Tensor

from ._errors import RLInputError


def check_mask(name: str, mask: Tensor, dims: int = 2) -> Tensor:
    """Return `mask` as float; raise unless it is a bool/float tensor with `dims` dimensions."""
    if not isinstance(mask, Tensor) or mask.dim() != dims:
        raise RLInputError(
            f"{name} must be a {dims}-D tensor, got "
            f"{tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__}"
        )
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise RLInputError(f"{name} must be bool or floating point, got {mask.dtype}")
    return mask.float() if mask.dtype == torch.bool else mask


def check_float(name: str, tensor: Tensor, shape: torch.Size | tuple[int, ...]) -> Tensor:
    """Raise unless `tensor` is floating point with exactly `shape`."""
    if not isinstance(tensor, Tensor):
        raise RLInputError(f"{name} must be a tensor, got {type(tensor).__name__}")
    if tuple(tensor.shape) != tuple(shape):
        raise RLInputError(f"{name} has shape {tuple(tensor.shape)}, expected {tuple(shape)}")
    if not tensor.is_floating_point():
        raise RLInputError(f"{name} must be floating point, got {tensor.dtype}")
    return tensor


def check_finite(name: str, tensor: Tensor) -> None:
    if not bool(torch.isfinite(tensor).all()):
        bad = tensor[~torch.isfinite(tensor)][:5].tolist()
        raise RLInputError(f"{name} must be finite, found {bad}")


def check_group_ids(group_ids: Tensor, batch: int) -> Tensor:
    """Raise unless `group_ids` is an integer [B] tensor; return it as int64."""
    if not isinstance(group_ids, Tensor) or tuple(group_ids.shape) != (batch,):
        shape = tuple(group_ids.shape) if isinstance(group_ids, Tensor) else type(group_ids)
        raise RLInputError(f"group_ids has shape {shape}, expected ({batch},)")
    if group_ids.is_floating_point() or group_ids.is_complex() or group_ids.dtype == torch.bool:
        raise RLInputError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
    return group_ids.long()


def check_positive(name: str, value: float, *, allow_zero: bool = False) -> None:
    ok = value >= 0 if allow_zero else value > 0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise RLInputError(f"{name} must be a number {bound}, got {value!r}")
