"""Configuration of weight sync: buckets, transport, pause mode, deadlines, which tensors.

Frozen, validated values; ``CheckpointConfig.from_dict`` / ``from_toml`` load them from TOML
(``[checkpoint]`` with a ``[checkpoint.deadlines]`` table). Every problem raises
``ManifestError`` (a ``ValueError``) naming the key and what was expected.
"""

from __future__ import annotations

import math
import os
import re
import sys
from collections.abc import Iterable, Mapping
from typing import Any, Final, Literal

import attrs

from ._errors import ManifestError
from ._manifest import ALIGNMENT
from ._target import PauseMode

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

MiB: Final = 1 << 20

#: Tensor names of LoRA adapters as PEFT names them (``...q_proj.lora_A.default.weight``).
LORA_PATTERNS: Final = (r"(^|\.)lora_(A|B|embedding_A|embedding_B|magnitude_vector)(\.|$)",)

TransportKind = Literal["actor", "gloo", "nccl", "hccl", "file"]
TRANSPORTS: Final = ("actor", "gloo", "nccl", "hccl", "file")

CHECKSUMS: Final = ("auto", "xxh3", "crc32", "none")

PHASES: Final = ("pause", "prepare", "topology", "broadcast", "finalize", "resume")


def _positive(inst: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise ManifestError(f"{attribute.name} must be a number of seconds > 0, got {value!r}")


@attrs.frozen
class PhaseDeadlines:
    """Seconds each phase of a sync may take (``math.inf``: no limit, not recommended).

    ``resume`` bounds the shielded resume that runs after every sync, failed or not.
    """

    pause: float = attrs.field(default=120.0, validator=_positive)
    prepare: float = attrs.field(default=60.0, validator=_positive)
    topology: float = attrs.field(default=60.0, validator=_positive)
    broadcast: float = attrs.field(default=600.0, validator=_positive)
    finalize: float = attrs.field(default=120.0, validator=_positive)
    resume: float = attrs.field(default=60.0, validator=_positive)

    @property
    def total(self) -> float:
        return float(sum(getattr(self, phase) for phase in PHASES))


def _strs(values: Iterable[str]) -> tuple[str, ...]:
    if isinstance(values, str):
        return (values,)
    return tuple(values)


@attrs.frozen
class TensorFilter:
    """Which tensors a sync sends: names matching any ``include`` regex (all if empty), no
    ``exclude`` regex, and (``lora_only``) ``LORA_PATTERNS`` (``re.search`` semantics)."""

    include: tuple[str, ...] = attrs.field(default=(), converter=_strs)
    exclude: tuple[str, ...] = attrs.field(default=(), converter=_strs)
    lora_only: bool = False

    def __attrs_post_init__(self) -> None:
        for pattern in (*self.include, *self.exclude):
            try:
                re.compile(pattern)
            except (re.error, TypeError) as exc:
                raise ManifestError(f"tensor filter pattern {pattern!r} is invalid: {exc}") from exc

    def __call__(self, name: str) -> bool:
        if self.lora_only and not any(re.search(p, name) for p in LORA_PATTERNS):
            return False
        if self.include and not any(re.search(p, name) for p in self.include):
            return False
        return not any(re.search(p, name) for p in self.exclude)


def _deadlines(value: Any) -> PhaseDeadlines:
    if isinstance(value, PhaseDeadlines):
        return value
    if not isinstance(value, Mapping):
        raise ManifestError(f"deadlines must be a table of seconds per phase, got {value!r}")
    unknown = sorted(set(value) - set(PHASES))
    if unknown:
        raise ManifestError(f"deadlines: unknown phases {unknown} (known: {list(PHASES)})")
    return PhaseDeadlines(**dict(value))


def _pause_mode(value: Any) -> PauseMode:
    if isinstance(value, PauseMode):
        return value
    try:
        return PauseMode(value)
    except ValueError:
        raise ManifestError(
            f"pause_mode {value!r} is not one of {[m.value for m in PauseMode]}"
        ) from None


@attrs.frozen
class CheckpointConfig:
    """How the ``CheckpointEngine`` syncs (``docs/weight_sync.md``).

    - ``bucket_bytes``: size of a bucket (and of each of the sender's two buffers).
    - ``transport``: ``"actor"`` (bucket messages to the receivers' refs: in-process for local
      refs, zmq ipc/tcp for remote ones), ``"gloo"`` / ``"nccl"`` / ``"hccl"`` (a
      ``torch.distributed`` broadcast in a process group built for the sync), ``"file"``
      (safetensors files in ``directory``).
    - ``pause_mode``: how rollout engines pause (forward workers treat every mode alike).
    - ``eager``: make every receiver load at once, before it resumes, instead of letting lazy
      receivers load at their next batch boundary.
    - ``lora_only`` / ``include`` / ``exclude``: which tensors are sent (``TensorFilter``).
    - ``checksum``: each bucket's digest, verified by every receiver: ``"xxh3"`` (XXH3-64, the
      ``xxhash`` package), ``"crc32"`` (zlib, about three times slower), ``"auto"`` (XXH3-64
      where ``xxhash`` is importable, else CRC-32) or ``"none"``. The sender names the
      algorithm in the sync's prepare; a receiver that cannot compute it refuses the sync.
    - ``host``: the address receivers reach the sender at for a collective's rendezvous.
    - ``directory`` / ``keep_versions``: the file transport's directory and how many complete
      versions it keeps there.
    - ``offload``: copy and checksum in worker threads so no event loop blocks (``False`` runs
      them inline: deterministic tests under a mock clock, tiny models).
    - ``fused_bytes``: with the actor transport, weights that fit in one bucket of at most this
      many bytes travel in one fused request (pause, manifest, the bucket and its checksum),
      answered once the receiver verified them: a sync of two round trips instead of five
      (``docs/weight_sync.md``). ``0`` always runs the five phases.
    """

    bucket_bytes: int = 64 * MiB
    transport: TransportKind = "actor"
    pause_mode: PauseMode = attrs.field(default=PauseMode.DRAIN, converter=_pause_mode)
    eager: bool = False
    lora_only: bool = False
    include: tuple[str, ...] = attrs.field(default=(), converter=_strs)
    exclude: tuple[str, ...] = attrs.field(default=(), converter=_strs)
    checksum: Literal["auto", "xxh3", "crc32", "none"] = "auto"
    deadlines: PhaseDeadlines = attrs.field(factory=PhaseDeadlines, converter=_deadlines)
    host: str = "127.0.0.1"
    directory: str | None = None
    keep_versions: int = 2
    offload: bool = True
    fused_bytes: int = 4 * MiB

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.bucket_bytes, int) or self.bucket_bytes < ALIGNMENT:
            raise ManifestError(
                f"bucket_bytes must be an int >= {ALIGNMENT}, got {self.bucket_bytes!r}"
            )
        if self.transport not in TRANSPORTS:
            raise ManifestError(f"transport {self.transport!r} is not one of {list(TRANSPORTS)}")
        if self.checksum not in CHECKSUMS:
            raise ManifestError(f"checksum {self.checksum!r} is not one of {list(CHECKSUMS)}")
        if self.transport == "file" and not self.directory:
            raise ManifestError("the file transport needs a directory")
        if (
            not isinstance(self.fused_bytes, int)
            or isinstance(self.fused_bytes, bool)
            or self.fused_bytes < 0
        ):
            raise ManifestError(f"fused_bytes must be an int >= 0, got {self.fused_bytes!r}")
        if not isinstance(self.keep_versions, int) or self.keep_versions < 1:
            raise ManifestError(f"keep_versions must be an int >= 1, got {self.keep_versions!r}")
        self.tensor_filter()  # validates the patterns

    def tensor_filter(self) -> TensorFilter:
        return TensorFilter(self.include, self.exclude, self.lora_only)

    @property
    def lease(self) -> float:
        """Seconds a receiver stays paused without hearing the end of the sync before it resumes
        on its own (the sender died): every phase's deadline, plus a margin."""
        total = self.deadlines.total
        return total + 30.0 if math.isfinite(total) else math.inf

    @classmethod
    def from_dict(cls, table: Mapping[str, Any]) -> CheckpointConfig:
        """From a parsed TOML table (unknown keys are refused)."""
        known = {f.name for f in attrs.fields(cls)}
        extra = sorted(set(table) - known)
        if extra:
            raise ManifestError(f"checkpoint config: unknown keys {extra} (known: {sorted(known)})")
        return cls(**dict(table))

    @classmethod
    def from_toml(
        cls, path: str | os.PathLike[str], *, table: str | None = "checkpoint"
    ) -> CheckpointConfig:
        """Load from a TOML file (``table``: the dotted key holding the config; ``None``: root)."""
        with open(path, "rb") as f:
            data: Any = tomllib.load(f)
        for key in table.split(".") if table else ():
            data = data[key]
        return cls.from_dict(data)
