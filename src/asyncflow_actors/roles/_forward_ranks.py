"""``ForwardGroup``: a forward station's model sharded over N ranks, driven from rank 0.

Rank 0 is the station's own process; ranks 1..N-1 start through the same ``RankGroup`` as the
trainer's (child processes, or Ray actors with ``train.rank_launcher = "ray"``). A forward
broadcasts the batch's rows, every rank computes its partition and rank 0 gathers the rows back
in order (``_rank_forward``); a weight load broadcasts the full tensors and each rank keeps its
shard. Every call is synchronous and long (run it in a worker thread) and raises ``RankFailed``
naming a rank that died, within the collective timeout.
"""

from __future__ import annotations

import atexit
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch.distributed as dist
from torch import Tensor

from ._distributed import open_group
from ._rank_forward import RankForward, forward_parallel
from ._rank_host import RankHost, encode_batch, spec_to_wire
from ._ranks import RankGroup
from ._settings import RunSpec, SettingsError


class ForwardGroup:
    """A forward station's ranks (module docstring). ``open`` starts them."""

    def __init__(self, group: RankGroup) -> None:
        self.group = group
        self.host = RankHost()

    @classmethod
    def open(
        cls, spec: RunSpec, *, path: str | None = None, env: Mapping[str, str] | None = None
    ) -> ForwardGroup:
        """Start ``spec.train.forward_ranks`` ranks and build the policy's shards on each
        (from ``path``, a checkpoint, when given; else the run's initial policy)."""
        if dist.is_initialized():
            raise SettingsError(
                "train.forward_ranks: this process holds a rank group already; place the "
                "station on a node of its own (placement.roles)"
            )
        parallel = forward_parallel(spec.train)
        group = open_group(spec, parallel, env)
        forward = cls(group)
        try:
            header = {
                "op": "forward_setup",
                "spec": spec_to_wire(spec),
                "parallel": attrs.asdict(parallel),
                "path": path,
            }
            forward._command(header, [])
        except BaseException:
            group.closed = True
            group._kill()
            group.close()
            raise
        atexit.register(forward.terminate)  # no rank outlives this process
        return forward

    def _command(self, header: dict[str, Any], tensors: list[Tensor]) -> Any:
        return self.group.command(header, tensors, lambda: self.host.run(header, tensors))

    @property
    def ranks(self) -> RankForward:
        assert self.host.forward is not None
        return self.host.forward

    @property
    def tokenizer(self) -> Any:
        return self.ranks.tokenizer

    def logprobs(
        self,
        prompts: Sequence[Tensor],
        responses: Sequence[Tensor],
        *,
        pad_id: int,
        temperature: float,
    ) -> list[Tensor]:
        """Each response's token log-probs, in order (``compute.sequence_logprobs``'s)."""
        layout, tensors = encode_batch({"prompt_ids": prompts, "response_ids": responses})
        header = {"op": "forward", "layout": layout, "pad_id": pad_id, "temperature": temperature}
        rows: list[Tensor] = self._command(header, tensors)
        return rows

    def load(self, weights: Mapping[str, Tensor]) -> None:
        """Load full tensors into the sharded model (names not given keep their values)."""
        names = list(weights)
        self._command({"op": "forward_load", "names": names}, [weights[n] for n in names])

    def close(self) -> None:
        """Stop the other ranks (a stop command) and leave the process group."""
        self.group.close()

    def terminate(self) -> None:
        """Kill the other ranks at once and leave the process group (the station stops: a
        forward may still be in flight in its thread)."""
        self.group.terminate()

    def __enter__(self) -> ForwardGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.group.__exit__(*exc)
