"""Batches: what a client puts (checked, normalized) and what a get returns (assembled).

Rows come back exactly as they were put, whatever the mix of puts, units and placements. What a
column reads as depends on its spec, never on the data:

- a column with a fixed shape and a dtype reads as one tensor ``[n, *shape]`` (a view of the
  buffer the rows arrived in when they were stored together, else one copy);
- a column with a variable dimension (``shape = [-1]``) reads as a list of ``n`` tensors, each
  exactly the row that was put (a batch ``[n, L]`` put is read back as rows ``[L]``);
- a column without a declared shape reads as a tensor when its rows are tensors of one dtype and
  shape, else as a list (declare the shape for a type that does not depend on the data).

Text and other plain values (columns without a dtype) always read as lists.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from .._errors import SchemaError
from .._results import Lease
from .._runtime import RawTensor
from .._spec import ColumnSpec, TopicSpec
from .._tensors import dtype_name, is_tensor, torch_module


def fixed(col: ColumnSpec) -> bool:
    """Whether the column's rows all have one known shape and dtype."""
    return col.dtype is not None and col.shape is not None and None not in col.shape


def variable(col: ColumnSpec) -> bool:
    return col.shape is not None and None in col.shape


@attrs.frozen
class Batch:
    """What ``get`` returns: the lease, and the data in the lease's sample order.

    ``data`` maps each per-sample column to a tensor ``[n, ...]`` or a list of ``n`` values (see
    the module docs for which). ``shared`` maps each group-shared column to ``{group_id:
    value}``: sent once per group; ``expand(column)`` repeats it per sample. Tensors that came
    through shared memory are copy-on-write views of the storage unit's pages: valid at least
    until the batch is acked (and as long as they are referenced), and writing to them only
    changes this process's copy. ``incarnations`` and ``located``: the lease's units'
    incarnations and located parts (``Leased``), for readers that fetch rows of it themselves
    (the ranks of a trainer, ``fetch_rows``).
    """

    lease: Lease
    data: dict[str, Any]
    shared: dict[str, dict[int, Any]]
    incarnations: dict[str, str] = attrs.field(factory=dict, eq=False)
    located: dict[str, Any] = attrs.field(factory=dict, eq=False)

    @property
    def indexes(self) -> tuple[int, ...]:
        return self.lease.indexes

    @property
    def versions(self) -> tuple[int, ...]:
        return self.lease.versions

    @property
    def group_ids(self) -> tuple[int, ...]:
        return self.lease.group_ids

    def __len__(self) -> int:
        return len(self.lease.indexes)

    def __getitem__(self, column: str) -> Any:
        return self.data[column]

    def partition(self, rank: int) -> dict[str, Any]:
        """The per-sample columns of data-parallel ``rank``'s share (``Balanced`` sampler:
        ``lease.partitions[rank]``), rows in that partition's order. Ack the batch once."""
        wanted = self.lease.partitions[rank]
        where = {index: k for k, index in enumerate(self.lease.indexes)}
        positions = [where[i] for i in wanted]
        return {name: take(value, positions) for name, value in self.data.items()}

    def expand(self, column: str) -> list[Any]:
        """A shared column repeated for each sample of the batch, in sample order."""
        by_group = self.shared[column]
        return [by_group[g] for g in self.lease.group_ids]


def take(value: Any, positions: Sequence[int] | slice) -> Any:
    """Rows ``positions`` of a batch column: a view for a slice or a contiguous run, else a
    gather."""
    if isinstance(positions, slice):
        return value[positions]
    first = positions[0]
    if list(positions) == list(range(first, first + len(positions))):
        return value[first : first + len(positions)]
    if is_tensor(value):
        torch = torch_module()
        return value.index_select(0, torch.tensor(positions, dtype=torch.long))
    return [value[p] for p in positions]


def nbytes(value: Any) -> int:
    if is_tensor(value):
        return int(value.numel() * value.element_size())
    if isinstance(value, (bytes, str)):
        return len(value)
    return 8


def _cpu(t: Any) -> Any:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous()


def _check_rows(spec: TopicSpec, name: str, col: ColumnSpec, rows: list[Any]) -> list[int]:
    """Check and normalize the rows of a per-sample column in place; their byte sizes.

    A rollout puts a few hundred small tensors a step: a row like the one checked before it (a
    plain CPU tensor, contiguous, not requiring grad, of its dtype and rank, the column's fixed
    dimensions equal) is taken as it is, without the per-row calls of the general path."""
    torch = sys.modules.get("torch")
    tensor = getattr(torch, "Tensor", None)
    like: Any = None  # the last row checked in full
    fixed_dims: list[tuple[int, int]] = []
    sizes: list[int] = []
    for k, row in enumerate(rows):
        if (
            like is not None
            and type(row) is tensor
            and row.dtype is like.dtype
            and row.dim() == like.dim()
            and row.is_cpu
            and not row.requires_grad
            and row.is_contiguous()
            and all(row.shape[d] == n for d, n in fixed_dims)
        ):
            sizes.append(row.numel() * row.element_size())
            continue
        if tensor is not None and isinstance(row, tensor):
            rows[k] = row = _cpu(row)
            spec.check_column(name, dtype_name(row), tuple(row.shape))
            if type(row) is tensor:
                like = row
                shape = col.shape or ()
                fixed_dims = [(d, n) for d, n in enumerate(shape) if n is not None]
        elif col.dtype is not None:
            raise SchemaError(
                f"column {name!r} holds {col.dtype} tensors, got {type(row).__name__}"
            )
        sizes.append(nbytes(row))
    return sizes


@attrs.frozen
class Prepared:
    """Checked columns of a put: per column a batch tensor ``[n, ...]`` or a list of ``n`` rows,
    and their byte sizes per row (one int when every row has the same size)."""

    n: int
    columns: dict[str, Any]
    sizes: dict[str, int | list[int]]


def prepare(spec: TopicSpec, data: Mapping[str, Any], *, shared: bool) -> Prepared:
    """Check ``data`` against the topic's columns and normalize it (raises :class:`SchemaError`
    or :class:`UnknownColumn`, naming the column). A list of tensors for a fixed-shape column is
    stacked into one batch (so readers get it back as one view)."""
    if not data:
        raise SchemaError("no columns given")
    n: int | None = None
    columns: dict[str, Any] = {}
    sizes: dict[str, int | list[int]] = {}
    for name, value in data.items():
        col = spec.column(name)  # UnknownColumn
        if col.shared != shared:
            kind = "group-shared" if col.shared else "per-sample"
            raise SchemaError(
                f"column {name!r} of topic {spec.name!r} is {kind}: "
                + ("write it with open_group(shared=...)" if col.shared else "use put()")
            )
        if shared:
            if is_tensor(value):
                value = _cpu(value)
                spec.check_column(name, dtype_name(value), tuple(value.shape))
            elif col.dtype is not None:
                raise SchemaError(
                    f"column {name!r} holds {col.dtype} tensors, got {type(value).__name__}"
                )
            columns[name] = value
            sizes[name] = nbytes(value)
            continue
        if is_tensor(value):
            if value.dim() == 0:
                raise SchemaError(f"column {name!r}: a batch needs a leading dimension")
            value = _cpu(value)
            spec.check_column(name, dtype_name(value), tuple(value.shape[1:]))
            count = int(value.shape[0])
            sizes[name] = math.prod(value.shape[1:]) * value.element_size() if count else 0
        else:
            rows = list(value)
            row_sizes = _check_rows(spec, name, col, rows)
            count = len(rows)
            if fixed(col) and count:
                value = torch_module().stack(rows)
                sizes[name] = int(rows[0].numel() * rows[0].element_size())
            else:
                value = rows
                sizes[name] = row_sizes
        if n is not None and count != n:
            raise SchemaError(
                f"columns disagree on the number of samples: {n} and {count} ({name!r})"
            )
        n = count
        columns[name] = value
    if not shared and not n:
        raise SchemaError("a put needs at least one sample")
    return Prepared(1 if shared else int(n or 0), columns, sizes)


def materialize(value: Any) -> Any:
    """Torch tensors for what a unit in this process returns: rows a remote writer sent it stay
    ``RawTensor``s there (units never import torch), and a local reply skips wire decoding."""
    if isinstance(value, RawTensor):
        return value.to_torch()
    if isinstance(value, list):
        return [materialize(v) for v in value]
    return value


def assemble(col: ColumnSpec, pieces: list[Any], perm: list[int] | None) -> Any:
    """One column of a batch from its pieces (batch tensors and lists of rows, in arrival
    order; ``perm``: lease position -> arrival position, if they differ)."""
    rows_wanted = variable(col)
    if not rows_wanted:
        tensors = _as_batches(pieces)
        if tensors is not None:
            torch = torch_module()
            value = tensors[0] if len(tensors) == 1 else torch.cat(tensors)
            if perm is not None:
                value = value.index_select(0, torch.tensor(perm, dtype=torch.long))
            return value
    flat: list[Any] = []
    for piece in pieces:
        flat.extend(piece if isinstance(piece, list) else piece.unbind(0))
    return flat if perm is None else [flat[k] for k in perm]


def _as_batches(pieces: list[Any]) -> list[Any] | None:
    """The pieces as batch tensors of one dtype and row shape, or ``None`` if they are not."""
    out = []
    torch = None
    for piece in pieces:
        if isinstance(piece, list):
            if not piece or not all(is_tensor(v) for v in piece):
                return None
            torch = torch or torch_module()
            first = piece[0]
            if any(v.dtype != first.dtype or v.shape != first.shape for v in piece):
                return None
            piece = torch.stack(piece)
        elif not is_tensor(piece):
            return None
        out.append(piece)
    first = out[0]
    if any(p.dtype != first.dtype or p.shape[1:] != first.shape[1:] for p in out):
        return None
    return out
