"""Topic and column specs: what a topic stores and who consumes it.

Specs are frozen, validated values. They are built in Python or loaded from a TOML table (already
parsed into a dict) with :meth:`TopicSpec.from_dict`; every problem raises :class:`SchemaError`
naming the offending key and what was expected.
"""

from __future__ import annotations

import math
import types
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from ._errors import SchemaError, UnknownColumn

#: dtype names a column may declare (torch's names, without the ``torch.`` prefix).
DTYPES = frozenset(
    {
        "bool",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "int8",
        "int16",
        "int32",
        "int64",
        "float16",
        "bfloat16",
        "float32",
        "float64",
        "complex64",
        "complex128",
        "float8_e4m3fn",
        "float8_e5m2",
    }
)


def _to_dtype(value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise SchemaError(f"column dtype must be a string such as 'int64', got {value!r}")
    name = value.removeprefix("torch.")
    if name not in DTYPES:
        raise SchemaError(f"column dtype {value!r} is not one of {sorted(DTYPES)}")
    return name


def _to_shape(value: object) -> tuple[int | None, ...] | None:
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise SchemaError(f"column shape must be a sequence of dimensions, got {value!r}")
    dims: list[int | None] = []
    for dim in value:
        if dim is None:
            dims.append(None)
        elif isinstance(dim, int) and not isinstance(dim, bool) and dim >= 0:
            dims.append(dim)
        else:
            raise SchemaError(
                f"column shape {value!r}: each dimension must be an int >= 0 or None "
                f"(variable), got {dim!r}"
            )
    return tuple(dims)


@attrs.frozen
class ColumnSpec:
    """One column of a topic.

    ``dtype`` and ``shape`` (per sample, without the batch dimension; ``None`` for a variable
    dimension) are checked by the client before data is sent; ``None`` accepts anything.
    ``shared=True`` makes the column group-shared: stored once per group (e.g. ``prompt_ids`` of a
    GRPO group), written with ``commit_shared`` and freed with the group's last member.
    """

    dtype: str | None = attrs.field(default=None, converter=_to_dtype)
    shape: tuple[int | None, ...] | None = attrs.field(default=None, converter=_to_shape)
    shared: bool = attrs.field(default=False)

    @shared.validator
    def _check_shared(self, _attr: attrs.Attribute[bool], value: bool) -> None:
        if not isinstance(value, bool):
            raise SchemaError(f"column 'shared' must be a bool, got {value!r}")

    def check(self, dtype: str, shape: Sequence[int], *, column: str = "?") -> None:
        """Raise :class:`SchemaError` unless a per-sample tensor of ``dtype``/``shape`` fits."""
        if self.dtype is not None and dtype.removeprefix("torch.") != self.dtype:
            raise SchemaError(f"column {column!r}: expected dtype {self.dtype}, got {dtype}")
        if self.shape is None:
            return
        fits = len(shape) == len(self.shape) and all(
            want is None or want == got for want, got in zip(self.shape, shape, strict=True)
        )
        if not fits:
            want_s = "(" + ", ".join("*" if d is None else str(d) for d in self.shape) + ")"
            raise SchemaError(f"column {column!r}: expected shape {want_s}, got {tuple(shape)}")


def _name_ok(kind: str, value: object) -> str:
    if not isinstance(value, str) or not value or value != value.strip():
        raise SchemaError(
            f"{kind} must be a non-empty string without surrounding spaces, got {value!r}"
        )
    return value


def _to_columns(value: object) -> Mapping[str, ColumnSpec]:
    if not isinstance(value, Mapping):
        raise SchemaError(f"topic columns must be a mapping of name to ColumnSpec, got {value!r}")
    out: dict[str, ColumnSpec] = {}
    for name, spec in value.items():
        _name_ok("column name", name)
        if not isinstance(spec, ColumnSpec):
            raise SchemaError(f"column {name!r} must be a ColumnSpec, got {spec!r}")
        out[name] = spec
    if not out:
        raise SchemaError("a topic must declare at least one column")
    return types.MappingProxyType(out)


def _to_consumers(value: object) -> tuple[str, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise SchemaError(f"topic consumers must be a sequence of names, got {value!r}")
    names = tuple(_name_ok("consumer name", v) for v in value)
    if not names:
        raise SchemaError("a topic must declare at least one consumer")
    if len(set(names)) != len(names):
        raise SchemaError(f"topic consumers must be unique, got {list(names)}")
    return names


def _int_at_least(kind: str, low: int, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise SchemaError(f"{kind} must be an int >= {low}, got {value!r}")


@attrs.frozen
class TopicSpec:
    """A topic: its columns, its consumers, its staleness window, capacity and lease TTL.

    Each consumer (``actor_fwd``, ``ref_fwd``, ``advantage``, ``trainer``...) has its own
    consumption state over the same samples; a sample is freed once every consumer acked it.
    ``staleness`` is the number of versions a sample may lag the latest (0: exactly the latest).
    ``capacity`` bounds live samples plus reserved group slots (``None``: unbounded); allocation
    past it is refused so the writer waits. ``lease_ttl`` (seconds) bounds how long a claim may be
    held before it returns to the pool. ``write_ttl`` (seconds, ``None``: never) bounds how long
    a writer may take between allocating samples and committing them, and how long an open
    group may wait for its next member: past it the writer is presumed dead, its uncommitted
    samples are dropped and the group's unfilled slots given up (reported as abandoned).
    """

    name: str = attrs.field()
    columns: Mapping[str, ColumnSpec] = attrs.field(converter=_to_columns, hash=False)
    consumers: tuple[str, ...] = attrs.field(converter=_to_consumers)
    staleness: int = attrs.field(default=0)
    capacity: int | None = attrs.field(default=None)
    lease_ttl: float = attrs.field(default=60.0)
    write_ttl: float | None = attrs.field(default=600.0)

    @name.validator
    def _check_name(self, _attr: attrs.Attribute[str], value: str) -> None:
        _name_ok("topic name", value)

    @staleness.validator
    def _check_staleness(self, _attr: attrs.Attribute[int], value: int) -> None:
        _int_at_least(f"topic {self.name!r} staleness", 0, value)

    @capacity.validator
    def _check_capacity(self, _attr: attrs.Attribute[int | None], value: int | None) -> None:
        if value is not None:
            _int_at_least(f"topic {self.name!r} capacity", 1, value)

    @lease_ttl.validator
    def _check_ttl(self, _attr: attrs.Attribute[float], value: float) -> None:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not ok or not math.isfinite(value) or value <= 0:
            raise SchemaError(
                f"topic {self.name!r} lease_ttl must be a finite number of seconds > 0, got {value!r}"
            )

    @write_ttl.validator
    def _check_write_ttl(self, _attr: attrs.Attribute[float | None], value: float | None) -> None:
        if value is None:
            return
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not ok or not math.isfinite(value) or value <= 0:
            raise SchemaError(
                f"topic {self.name!r} write_ttl must be a finite number of seconds > 0 or None, "
                f"got {value!r}"
            )

    @property
    def shared_columns(self) -> frozenset[str]:
        """Names of the group-shared columns."""
        return frozenset(n for n, c in self.columns.items() if c.shared)

    @property
    def sample_columns(self) -> frozenset[str]:
        """Names of the per-sample columns."""
        return frozenset(n for n, c in self.columns.items() if not c.shared)

    def column(self, name: str) -> ColumnSpec:
        """The spec of column ``name``; raises :class:`UnknownColumn`."""
        try:
            return self.columns[name]
        except KeyError:
            raise UnknownColumn(
                f"topic {self.name!r} has no column {name!r} (declared: {sorted(self.columns)})"
            ) from None

    def check_column(self, name: str, dtype: str, shape: Sequence[int]) -> None:
        """Check one per-sample tensor against column ``name`` (:class:`UnknownColumn`,
        :class:`SchemaError`)."""
        self.column(name).check(dtype, shape, column=name)

    @classmethod
    def from_dict(cls, table: Mapping[str, Any], *, name: str | None = None) -> TopicSpec:
        """Build a spec from a parsed TOML table (or any dict).

        Keys: ``name`` (or the ``name`` argument, e.g. the TOML table key), ``consumers``,
        ``staleness``, ``capacity``, ``lease_ttl``, ``write_ttl`` and ``columns``: a table of column tables with
        ``dtype``, ``shape`` (a list; ``-1`` or ``None`` marks a variable dimension) and ``shared``.
        Unknown keys are errors. Raises :class:`SchemaError` naming the offending key.
        """
        where = f"topic {name!r}" if name is not None else "topic"
        if not isinstance(table, Mapping):
            raise SchemaError(f"{where}: expected a table, got {table!r}")
        allowed = {
            "name",
            "consumers",
            "staleness",
            "capacity",
            "lease_ttl",
            "write_ttl",
            "columns",
        }
        _no_extra(where, table, allowed)
        if name is not None and "name" in table and table["name"] != name:
            raise SchemaError(f"{where}: 'name' is {table['name']!r} but the table is {name!r}")
        topic = table.get("name", name)
        if topic is None:
            raise SchemaError("topic: missing 'name'")
        where = f"topic {topic!r}"
        for key in ("consumers", "columns"):
            if key not in table:
                raise SchemaError(f"{where}: missing {key!r}")
        raw_cols = table["columns"]
        if not isinstance(raw_cols, Mapping):
            raise SchemaError(f"{where}.columns: expected a table of columns, got {raw_cols!r}")
        columns: dict[str, ColumnSpec] = {}
        for col, ctable in raw_cols.items():
            cwhere = f"{where}.columns.{col}"
            if not isinstance(ctable, Mapping):
                raise SchemaError(f"{cwhere}: expected a table, got {ctable!r}")
            _no_extra(cwhere, ctable, {"dtype", "shape", "shared"})
            shape = ctable.get("shape")
            if isinstance(shape, Sequence) and not isinstance(shape, (str, bytes)):
                shape = [None if d == -1 else d for d in shape]
            try:
                columns[col] = ColumnSpec(
                    dtype=ctable.get("dtype"), shape=shape, shared=ctable.get("shared", False)
                )
            except SchemaError as exc:
                raise SchemaError(f"{cwhere}: {exc}") from None
        kwargs: dict[str, Any] = {
            k: table[k] for k in ("staleness", "capacity", "lease_ttl", "write_ttl") if k in table
        }
        try:
            return cls(name=topic, columns=columns, consumers=table["consumers"], **kwargs)
        except SchemaError as exc:
            raise SchemaError(f"{where}: {exc}") from None


def _no_extra(where: str, table: Mapping[str, Any], allowed: set[str]) -> None:
    extra = sorted(set(table) - allowed)
    if extra:
        raise SchemaError(f"{where}: unknown keys {extra} (allowed: {sorted(allowed)})")


def topic_specs_from_dict(table: Mapping[str, Any]) -> tuple[TopicSpec, ...]:
    """Load every topic of a ``[topics.<name>]`` TOML section (the dict under ``topics``)."""
    if not isinstance(table, Mapping):
        raise SchemaError(f"topics: expected a table of topic tables, got {table!r}")
    return tuple(TopicSpec.from_dict(t, name=n) for n, t in table.items())
