"""``ForwardGroup``: a forward station's model sharded over N ranks, driven from rank 0.

Rank 0 is the station's own process; ranks 1..N-1 start through the same ``RankGroup`` as the
trainer's (child processes, or Ray actors with ``train.rank_launcher = "ray"``). A forward
has each rank fetch its own rows of the batch's lease from the TQ (``logprobs_leased``,
``_forward_fetch``), or, where the ranks cannot (``broadcast_rows``), broadcasts the rows
(``logprobs``); every rank computes its partition and rank 0 gathers the log-probs back in
order (``_rank_forward``); a weight load broadcasts the full tensors and each rank keeps its
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
from ._rank_fetch import RankLeases, RowSource
from ._rank_forward import RankForward, forward_parallel
from ._rank_host import RankHost, encode_batch, spec_to_wire
from ._ranks import RankGroup
from ._settings import RunSpec, SettingsError


class ForwardGroup:
    """A forward station's ranks (module docstring). ``open`` starts them."""

    def __init__(self, group: RankGroup) -> None:
        self.group = group
        self.host = RankHost()
        self.rows = RowSource(group, "train.forward_ranks: rank 0 fetches each batch")

    @property
    def rank_fetch(self) -> bool:
        """Whether each rank may fetch its own rows of a batch (else rank 0 broadcasts them)."""
        return self.rows.ranks_fetch

    def broadcast_rows(self, reason: str) -> None:
        """From now on rank 0 fetches every row and broadcasts them (``reason``: logged)."""
        self.rows.broadcast(reason)

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

    def logprobs_leased(
        self, leases: RankLeases, positions: Sequence[int], *, pad_id: int, temperature: float
    ) -> tuple[list[Tensor], float]:
        """The log-probs of the lease's rows at ``positions``, each rank fetching its own
        (``_forward_fetch``), and the most bytes a rank fetched. Raises ``StorageUnavailable``
        naming the unit a rank could not fetch from (before any forward: the group stays in
        step; the caller nacks the lease)."""
        from ._forward_fetch import failure, header_of

        header = header_of(leases, positions, pad_id=pad_id, temperature=temperature)

        def local() -> Any:
            self.host.fetch = leases.fetch
            try:
                return self.host.run(header, [])
            finally:
                self.host.fetch = None

        result: dict[str, Any] = self.group.command(header, [], local)
        if "failed" in result:
            leases.on_failure()  # the controller checks its units
            raise failure(result)
        return result["rows"], result["fetched_bytes"]

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
