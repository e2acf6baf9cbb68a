"""What the shared engine core asks of a model backend, and weight loading for torch modules.

A backend owns the model and its KV cache. The core calls it only from its decode thread, or
from the event loop while no decode runs, never both at once, so a backend needs no locks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import attrs
import torch
from torch import Tensor, nn

from ._types import WeightLoadError

__all__ = ["Backend", "PreparedWeights", "prepare_module_weights"]


@attrs.frozen
class PreparedWeights:
    """Validated weights, converted to their targets' dtype and device: ``(target, new)``."""

    pairs: tuple[tuple[Tensor, Tensor], ...]

    def apply(self) -> None:
        with torch.no_grad():
            for target, new in self.pairs:
                target.copy_(new)


class Backend(Protocol):
    """A model that prefills and decodes rows of a batch (slots ``0 .. max_batch-1``)."""

    @property
    def max_batch(self) -> int: ...

    @property
    def max_seq_len(self) -> int:
        """Longest prompt + response the model can hold."""
        ...

    @property
    def vocab_size(self) -> int: ...

    def admission_limit(self, running: int) -> int:
        """How many new requests may join now, with ``running`` slots in use."""
        ...

    def prefill(self, rows: Sequence[tuple[int, Sequence[int]]]) -> Tensor:
        """Start sequences in empty slots; logits [k, V] of the next token of each."""
        ...

    def decode(self, rows: Sequence[tuple[int, int]]) -> Tensor:
        """Feed one token to each running slot; logits [k, V] of the next token of each."""
        ...

    def release(self, slots: Sequence[int]) -> None:
        """Forget the sequences of ``slots`` (finished, aborted or cancelled)."""
        ...

    def kv_usage(self) -> float:
        """Fraction of the KV cache holding live tokens (0 when unknown)."""
        ...

    def prepare(self, weights: Mapping[str, Tensor]) -> PreparedWeights:
        """Check and convert new weights without touching the model (``WeightLoadError``)."""
        ...


def prepare_module_weights(module: nn.Module, weights: Mapping[str, Tensor]) -> PreparedWeights:
    """Match ``weights`` to ``module.state_dict()`` names; check shapes; convert dtype/device.

    Any subset of names may be given. Raises ``WeightLoadError`` naming every unknown name,
    wrong shape or non-floating tensor for a floating target; nothing is changed then.
    """
    targets = module.state_dict(keep_vars=True)
    unknown = sorted(set(weights) - set(targets))
    if unknown:
        shown = ", ".join(repr(n) for n in unknown[:5])
        raise WeightLoadError(
            f"{len(unknown)} unknown weight names ({shown}{', ...' if len(unknown) > 5 else ''}); "
            f"the model has e.g. {sorted(targets)[:3]}"
        )
    pairs: list[tuple[Tensor, Tensor]] = []
    problems: list[str] = []
    for name, tensor in weights.items():
        target = targets[name]
        if tuple(tensor.shape) != tuple(target.shape):
            problems.append(
                f"{name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
            )
            continue
        if target.is_floating_point() and not tensor.is_floating_point():
            problems.append(f"{name!r} has dtype {tensor.dtype}, expected a floating dtype")
            continue
        pairs.append((target.data, tensor.detach().to(device=target.device, dtype=target.dtype)))
    if problems:
        raise WeightLoadError("weights do not match the model: " + "; ".join(problems))
    return PreparedWeights(tuple(pairs))
