"""Weight sync from a sharded trainer, without a rank-0 funnel of the whole model.

``ShardedSyncEngine`` is a ``CheckpointEngine`` (same targets, transports, pause → … → commit →
resume protocol; receivers never see a mix of versions) for a ``DistributedLearner``. Where it
can (``_shard_plan``), every rank packs and sends the buckets of its own shards to the
receivers itself, all at once (``_rank_send``: its ``RankTransport``). Elsewhere (merged LoRA
weights, another transport, ranks that may be on other hosts, receivers the ranks cannot
reach) its bucket source gathers the parameters one group at a time, as the buckets are
packed: rank 0 packs bucket *k+1* (a bucket's worth of parameters with one all-gather of
their shards' bytes, every rank taking part) while bucket *k* is in flight. Either way no
process ever holds the whole model twice. When gathering, the other ranks are told the gather
order first (one command); whatever the sync's outcome, rank 0 finishes the order (``drain``)
so that no rank is left waiting in a collective.

``merged`` (LoRA for engines that cannot load adapters): each adapted weight is sent under the
base model's name as ``W + alpha / r * B @ A``, gathered and merged one module at a time.
"""

from __future__ import annotations

import secrets
import subprocess
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch
import trio

from ..checkpoint import (
    ActorTransport,
    BucketSource,
    CheckpointEngine,
    ManifestError,
    SyncResult,
    SyncSession,
)
from ..checkpoint._buckets import resolve_checksum
from ._distributed import DistributedLearner
from ._rank_learner import gather_many
from ._rank_send import RankTransport, ShardPlan, addresses_of, local_parts, plan_shards

if TYPE_CHECKING:
    from ..checkpoint import Manifest


@attrs.frozen
class Recipe:
    """One tensor of a sync: its ``name`` and the parameters it is made of (``sources``, in
    gather order), combined by ``make`` (``None``: the one source itself)."""

    name: str
    sources: tuple[str, ...]
    make: Callable[[list[torch.Tensor]], torch.Tensor] | None = None


def recipes(learner: DistributedLearner, *, merged: bool = False) -> list[Recipe]:
    """What a sync of ``learner`` sends: its parameters by their state-dict names; with
    ``merged`` and LoRA, the base model's weights with the adapters folded in."""
    names = [name for name, _ in learner.learner.named_parameters()]
    lora = learner.learner.lora
    if not merged or lora is None:
        return [Recipe(name, (name,)) for name in names]
    from ._lora import PREFIX, is_adapter

    scale = lora.alpha / lora.r
    present = set(names)
    out = []
    for name in names:
        if is_adapter(name):
            continue
        base = name.removeprefix(PREFIX)
        if ".base_layer." in base:
            stem = name.rsplit(".base_layer.", 1)[0]
            a, b = f"{stem}.lora_A.default.weight", f"{stem}.lora_B.default.weight"
            if a in present and b in present and base.endswith(".weight"):

                def make(parts: list[torch.Tensor], scale: float = scale) -> torch.Tensor:
                    w, a_, b_ = parts
                    return (w.float() + scale * (b_.float() @ a_.float())).to(w.dtype)

                out.append(Recipe(base.replace(".base_layer.", "."), (name, a, b), make))
                continue
            base = base.replace(".base_layer.", ".")
        out.append(Recipe(base, (name,)))
    return out


def groups_of(plan: Sequence[Recipe], sizes: Sequence[int], most: int) -> list[list[int]]:
    """Consecutive recipes in groups of at most ``most`` bytes (one recipe at least): each
    group's parameters are gathered with one all-gather."""
    groups: list[list[int]] = []
    used = most
    for index, size in enumerate(sizes):
        if used + size > most or not groups:
            groups.append([])
            used = 0
        groups[-1].append(index)
        used += size
    return groups


class GatheringSource(BucketSource):
    """A ``BucketSource`` whose tensors are gathered when first packed, a group of
    consecutive ones (about a bucket's bytes) with one all-gather; each recipe's sources are
    combined; a group is dropped once a later one is packed."""

    def __init__(
        self,
        learner: DistributedLearner,
        plan: Sequence[Recipe],
        groups: Sequence[Sequence[int]],
        manifest: Manifest,
        *,
        algorithm: str,
    ) -> None:
        super().__init__([], manifest, algorithm=algorithm)
        self.params = dict(learner.learner.named_parameters())
        self.plan = list(plan)
        self.groups = [list(g) for g in groups]
        self.group_of = {index: g for g, group in enumerate(self.groups) for index in group}
        self.next = 0  # the next group to gather
        self.held: dict[int, torch.Tensor] = {}  # the bytes of the last group's tensors
        self.lock = threading.Lock()

    def _gather(self, g: int) -> dict[int, torch.Tensor]:
        from ..checkpoint._manifest import tensor_bytes

        group = self.groups[g]
        names = [name for index in group for name in self.plan[index].sources]
        full = iter(gather_many([self.params[name] for name in names]))
        out = {}
        for index in group:
            recipe = self.plan[index]
            parts = [next(full).detach() for _ in recipe.sources]
            tensor = parts[0] if recipe.make is None else recipe.make(parts)
            out[index] = tensor_bytes(tensor.contiguous())
        return out

    def _bytes_of(self, index: int) -> torch.Tensor:
        with self.lock:
            if index in self.held:
                return self.held[index]
            g = self.group_of[index]
            if g < self.next:
                raise RuntimeError(f"tensor {index} was packed already (gathered in order)")
            while self.next <= g:
                self.held = {}  # the last group is packed: drop it before gathering
                held = self._gather(self.next)  # an all-gather every rank takes part in
                self.next += 1
            self.held = held
            return self.held[index]

    def direct(self, index: int, device: str) -> torch.Tensor | None:
        return None  # always packed: the tensor exists only while its group is packed

    def drain(self) -> None:
        """Gather whatever the sync did not pack (it failed, or it skipped empty tensors): the
        other ranks gather every group, whatever happens here."""
        with self.lock:
            while self.next < len(self.groups):
                self._gather(self.next)
                self.next += 1
            self.held = {}


class ShardedSyncEngine(CheckpointEngine):
    """A ``CheckpointEngine`` for a ``DistributedLearner`` (module docstring): ``await
    engine.sync(version)`` sends its weights."""

    def __init__(
        self, learner: DistributedLearner, *args: Any, merged: bool = False, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.learner = learner
        self.merged = merged
        self._source: GatheringSource | None = None
        self._recipes: list[Recipe] = []
        self._groups: list[list[int]] = []
        if type(self.transport) is ActorTransport:  # the ranks send their own buckets
            self.transport = RankTransport(learner)
        self._shards: tuple[Any, ShardPlan | None] | None = None  # the last layout, its key

    async def sync(
        self,
        version: int,
        weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] = (),
    ) -> SyncResult:
        """Send the learner's weights tagged ``version`` (``weights`` is ignored: they are
        sent from the ranks' shards, or gathered from them); the learner must not step
        meanwhile."""
        keep = self.config.tensor_filter()
        plan = [r for r in recipes(self.learner, merged=self.merged) if keep(r.name)]
        shards = await self._shard_plan(plan)
        if shards is not None:
            assert isinstance(self.transport, RankTransport)
            self.transport.shards = shards
            try:
                return await super().sync(version, ())
            finally:
                self.transport.shards = None
                await self.transport.finish()  # the other ranks are done: the group in step
        specs = await trio.to_thread.run_sync(self._specs, plan)
        sizes = [specs[r.name].numel() * specs[r.name].element_size() for r in plan]
        groups = groups_of(plan, sizes, self.config.bucket_bytes)
        order = [[name for index in group for name in plan[index].sources] for group in groups]
        await trio.to_thread.run_sync(self.learner.start_gather, order)
        self._recipes, self._groups = plan, groups
        try:
            return await super().sync(version, specs)
        finally:
            source, self._source = self._source, None
            if source is None:  # the plan failed: gather the groups all the same
                source = GatheringSource(self.learner, plan, groups, _EMPTY, algorithm="")
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(source.drain)

    async def _shard_plan(self, plan: Sequence[Recipe]) -> ShardPlan | None:
        """The layout for each rank to send the buckets of its shards (``_rank_send``), or None
        where rank 0 gathers and sends them all: merged LoRA weights (made of several
        parameters), another transport than the actor one, ranks that may be on other hosts
        (Ray, torchrun), receivers the ranks cannot reach, parameters not sharded by rows."""
        transport = self.transport
        world = self.learner.group.world_size
        if not isinstance(transport, RankTransport) or any(r.make is not None for r in plan):
            return None
        if world > 1:
            children = self.learner.group.children
            if len(children) != world - 1 or not all(
                isinstance(c, subprocess.Popen) for c in children
            ):
                return None
            receivers = await addresses_of(self.targets)
            if receivers is None:
                return None
            transport.receivers = receivers
        params = dict(self.learner.learner.named_parameters())
        named = [(r.name, r.sources[0], params[r.sources[0]]) for r in plan]
        key = (
            world,
            self.config.bucket_bytes,
            [(name, source, p.dtype, p.shape) for name, source, p in named],
        )
        if self._shards is None or self._shards[0] != key:
            shards = plan_shards(named, world, self.config.bucket_bytes)
            self._shards = (key, shards)
        return self._shards[1]

    def _fusable(self, session: SyncSession) -> bool:
        # one fused request from rank 0 carries a bucket rank 0 packs: not one of another rank's
        transport = self.transport
        shards = transport.shards if isinstance(transport, RankTransport) else None
        if shards is not None and shards.world > 1:
            return False
        return super()._fusable(session)

    def _specs(self, plan: Sequence[Recipe]) -> dict[str, torch.Tensor]:
        """Placeholders (meta tensors) of each sent tensor's dtype and shape: the plan's."""
        params = dict(self.learner.learner.named_parameters())
        out = {}
        for recipe in plan:
            first = params[recipe.sources[0]]
            out[recipe.name] = torch.empty(first.shape, dtype=first.dtype, device="meta")
        return out

    def _plan(
        self,
        version: int,
        weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    ) -> SyncSession:
        transport = self.transport
        if isinstance(transport, RankTransport) and transport.shards is not None:
            return self._shard_session(version, transport.shards)
        session = super()._plan(version, weights)
        self._source = GatheringSource(
            self.learner, self._recipes, self._groups, session.manifest,
            algorithm=session.source.algorithm,
        )  # fmt: skip
        session.source = self._source
        return session

    def _shard_session(self, version: int, shards: ShardPlan) -> SyncSession:
        """The session of a sync from every rank: rank 0's source packs its own shards."""
        manifest = shards.manifest
        if not manifest.tensors:
            raise ManifestError(f"no tensor to sync: none matched {self.config.tensor_filter()}")
        self.transport.check(manifest)
        params = dict(self.learner.learner.named_parameters())
        tensors, offsets = local_parts(params, shards, 0)
        algorithm = resolve_checksum(self.config.checksum)
        source = BucketSource(tensors, manifest, algorithm=algorithm, offsets=offsets)
        sync_id = f"{version}-{secrets.token_hex(4)}"
        return SyncSession(sync_id, version, manifest, self.targets, self.config, source)


class _Empty:
    buckets: tuple[Any, ...] = ()


_EMPTY: Any = _Empty()
