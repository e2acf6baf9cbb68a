"""The Trainer's learner when it is a rank group (``train.ranks`` and friends): the
``Learner`` interface the Trainer uses, over a ``DistributedLearner`` of which this process is
rank 0 (the other ranks are its child processes).

The Trainer overlaps a step's first forward and backward, and a streamed batch's pieces, with
the previous version's weight sync. A rank group cannot: its sync is a sequence of collectives
on the same group as the step's. So ``updates`` yields before computing anything and
``accumulate`` only keeps its piece; the whole global batch then trains in one ``step`` once the
sync finished (the same update: the loss is normalised over the global batch either way).
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Generator, Mapping, Sequence
from typing import Any

import torch

from ._compute import PaddedRows, pad_rows
from ._distributed import DistributedLearner
from ._lora import ADAPTER_DIR
from ._rank_fetch import RANK_FETCH, RankLeases, RowSource
from ._rank_settings import RANKS_DIR, parallel_of
from ._settings import RunSpec, SettingsError

_COLUMNS = (
    "prompt_ids", "response_ids", "advantages", "old_logprobs", "behaviour_logprobs",
    "ref_logprobs",
)  # fmt: skip
_LEASED = ("prompt_ids", "token_versions", "advantages")  # what ``step_leased`` reads of rank 0's


class _Piece:
    def __init__(self, data: Mapping[str, Any]) -> None:
        self.data = data


def _rows(column: Any) -> list[Any]:
    return column.rows() if isinstance(column, PaddedRows) else list(column)


class RankedLearner:
    """A ``Learner`` whose model and optimizer live on a rank group (module docstring)."""

    def __init__(
        self,
        spec: RunSpec,
        task: Any = None,
        *,
        resume: str | None = None,
        shared: Any = None,
    ) -> None:
        if shared is not None or spec.colocated:
            raise SettingsError("train.ranks: a colocated run shares one model; use another mode")
        self.spec = spec
        lora = spec.model.lora if spec.model.lora.enabled else None
        self.dist = DistributedLearner.open(spec, parallel_of(spec.train), lora)
        atexit.register(self.close)
        if resume:
            self.dist.load(os.path.join(resume, RANKS_DIR))
        self.tokenizer = self.dist.learner.tokenizer
        self.model = self.dist.learner.policy
        self.rng_state = (torch.get_rng_state(), self.dist.learner.generator.get_state())
        # one rank has no rows to split: it fetches them all in one go, as a trainer does
        self.rows = RowSource(
            self.dist.group, "train.ranks: rank 0 fetches each step",
            plain="one rank" if self.dist.group.world_size == 1 else None,
        )  # fmt: skip

    def _data(self, data: Mapping[str, Any]) -> dict[str, Any]:
        if RANK_FETCH in data:
            names: tuple[str, ...] = (*_LEASED, RANK_FETCH)
            return {name: data[name] for name in names if name in data}
        return {name: data[name] for name in _COLUMNS if name in data}

    def step(self, data: Mapping[str, Any]) -> dict[str, float]:
        if RANK_FETCH in data:  # each rank fetches its rows (``_rank_fetch``)
            return self.dist.step_leased(self._data(data))
        return self.dist.step(self._data(data))

    @property
    def rank_fetch(self) -> bool:
        """Whether each rank may fetch its own rows of a step (else rank 0 broadcasts them)."""
        return self.rows.ranks_fetch

    def broadcast_rows(self, reason: str) -> None:
        """From now on rank 0 fetches every row and broadcasts them (``reason``: logged)."""
        self.rows.broadcast(reason)

    def updates(self, data: Mapping[str, Any]) -> Generator[None, None, dict[str, float]]:
        yield  # nothing runs before the sync of the last version is over (module docstring)
        return self.step(data)

    def accumulate(self, data: Mapping[str, Any], *, first: bool) -> Any:
        return _Piece(self._data(data))

    def apply(self, pieces: Sequence[Any]) -> dict[str, float]:
        names = [name for name in pieces[0].data if name != RANK_FETCH]
        data: dict[str, Any] = {
            name: [row for p in pieces for row in _rows(p.data[name])] for name in names
        }
        if RANK_FETCH in pieces[0].data:
            data[RANK_FETCH] = RankLeases.join([p.data[RANK_FETCH] for p in pieces])
            if "advantages" in data:
                data["advantages"] = PaddedRows(*pad_rows(data["advantages"], torch.float32, 0))
        metrics = self.step(data)
        metrics["pieces"] = float(len(pieces))
        return metrics

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}  # the ShardedSyncEngine sends the weights from the ranks itself

    def save(self, directory: str, meta: Mapping[str, Any]) -> None:
        """A DCP checkpoint of every rank (``ranks/``) and the whole policy where the other
        roles load it on resume; with LoRA also the adapter alone (``adapter/``, PEFT's
        folder: what a resumed ``rollout.vllm_lora`` run serves on the base)."""
        self.dist.save(os.path.join(directory, RANKS_DIR), meta)
        self.dist.export(directory)
        if self.spec.model.lora.enabled:
            self.dist.export(directory, merge=False, name=ADAPTER_DIR)

    def close(self) -> None:
        """Stop the other ranks at once (the Trainer stops: a step may still be in flight in
        its compute thread) and leave the process group."""
        self.dist.group.terminate()
