"""Ranks 1..N-1 of a trainer as Ray actors in one placement group (``train.rank_launcher =
"ray"``).

Rank 0 stays the Trainer's own process, placed by the run's ``placement``; the other ranks are
Ray actors, one bundle of a placement group each (``PACK`` keeps them on few Ray nodes, ``SPREAD``
puts them on as many as it can). Ray only places and starts them: each actor runs the same
rank loop as a child process would (``_rank_main``: join the group at rank 0's store, serve its
commands) and the group's traffic is torch.distributed's, never Ray's object store. Ray carries
the launch arguments (strings and numbers) and reports each actor's end, which ``RankGroup``
reads through the same ``poll``/``wait``/``kill`` it uses for child processes, so a dead Ray rank
fails the leader's command with ``RankFailed`` naming it, like a dead child.
"""

from __future__ import annotations

import functools
import subprocess
from collections.abc import Callable, Mapping
from typing import Any

import attrs

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
# seconds Ray may take to confirm removing an actor or the group before we stop waiting
KILL_TIMEOUT = 5.0


def _as_dict(value: Mapping[str, float]) -> dict[str, float]:
    return dict(value)


@attrs.frozen
class RayRanks:
    """Where Ray puts the ranks: a placement ``strategy``, each rank's bundle (``num_cpus``,
    ``num_gpus``, custom ``resources`` such as ``{"NPU": 1}``), the cluster's ``address``
    (``"auto"``: the running cluster; ignored when this process already joined one) and how
    long Ray may take to place the group (``start_timeout``: pending resources, autoscaling)."""

    strategy: str = "PACK"
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    resources: Mapping[str, float] = attrs.field(factory=dict, converter=_as_dict)
    address: str = "auto"
    start_timeout: float = 300.0

    def __attrs_post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {list(STRATEGIES)}, got {self.strategy!r}")
        if self.num_cpus < 0 or self.num_gpus < 0 or any(v < 0 for v in self.resources.values()):
            raise ValueError("a rank's Ray resources must be >= 0")

    def bundle(self) -> dict[str, float]:
        wanted = {"CPU": self.num_cpus, "GPU": self.num_gpus, **self.resources}
        return {key: value for key, value in wanted.items() if value}


class RayRank:
    """One rank's Ray actor, seen as ``RankGroup`` sees a child process: ``poll`` (its exit
    status once its rank loop ended: 0, or 1 if it raised, -9 once killed), ``wait`` and
    ``kill``."""

    def __init__(self, rank: int, handle: Any, done: Any) -> None:
        self.rank = rank
        self.handle = handle
        self.done = done  # the ObjectRef of the rank loop's call
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self._settle(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None and not self._settle(timeout):
            raise subprocess.TimeoutExpired(f"ray rank {self.rank}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        import ray

        try:
            ray.kill(self.handle, no_restart=True)
        except Exception:  # already gone, or Ray shut down
            pass
        if self.returncode is None:
            self.returncode = -9

    def _settle(self, timeout: float | None) -> bool:
        import ray

        ready, _ = ray.wait([self.done], timeout=timeout)
        if not ready:
            return False
        try:
            ray.get(self.done)
            self.returncode = 0
        except Exception:  # the loop raised, or the actor died (RayActorError)
            self.returncode = 1
        return True


def start_ray_ranks(
    placement: RayRanks,
    *,
    host: str,
    port: int,
    world_size: int,
    backend: str,
    timeout_s: float,
    threads: int,
    env: Mapping[str, str],
) -> tuple[list[RayRank], Callable[[], None]]:
    """Place a group of ``world_size - 1`` bundles and start ranks 1..N-1 in them, pointed at
    rank 0's store on ``host:port``; the ranks and the function that removes the group.
    Raises ``RuntimeError`` naming the bundle if Ray cannot place the group in time."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if not ray.is_initialized():
        ray.init(address=placement.address, log_to_driver=False)
    bundle = placement.bundle()
    group = placement_group([bundle] * (world_size - 1), strategy=placement.strategy)

    def remove() -> None:
        try:
            remove_placement_group(group)
        except Exception:  # Ray already shut down
            pass

    ready, _ = ray.wait([group.ready()], timeout=placement.start_timeout)
    if not ready:
        remove()
        raise RuntimeError(
            f"Ray did not place {world_size - 1} bundle(s) of {bundle} ({placement.strategy}) "
            f"within {placement.start_timeout}s: are they free on the cluster?"
        )
    ranks: list[RayRank] = []
    try:
        for rank in range(1, world_size):
            options: dict[str, Any] = {
                "num_cpus": placement.num_cpus,
                "num_gpus": placement.num_gpus,
                "resources": dict(placement.resources),
                "max_concurrency": 2,  # ``where`` answers while ``run`` serves
                "max_restarts": 0,  # a rank that died is the group's end, not Ray's to redo
                "max_task_retries": 0,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=rank - 1
                ),
                "runtime_env": {"env_vars": dict(env)},
            }
            handle = _remote_rank_class().options(**options).remote()
            done = handle.run.remote(host, port, rank, world_size, backend, timeout_s, threads)
            ranks.append(RayRank(rank, handle, done))
    except BaseException:
        for started in ranks:
            started.kill()
        remove()
        raise
    return ranks, remove


def ray_host() -> str:
    """This process's address on the Ray cluster (where its ranks reach rank 0's store)."""
    import ray.util

    ray_util: Any = ray.util  # (not fully typed)
    return str(ray_util.get_node_ip_address())


@functools.cache
def _remote_rank_class() -> Any:
    import ray

    return ray.remote(_RayRankActor)


class _RayRankActor:
    """The Ray actor of one rank: ``run`` is the rank's whole life (join, serve, leave);
    ``where`` says where Ray put it (process id, placement group, bundle, Ray node)."""

    def where(self) -> dict[str, Any]:
        import os

        import ray

        context = ray.get_runtime_context()
        return {
            "pid": os.getpid(),
            "placement_group": context.get_placement_group_id(),
            "node": context.get_node_id(),
        }

    def run(
        self, host: str, port: int, rank: int, world: int, backend: str, timeout: float,
        threads: int,
    ) -> int:  # fmt: skip
        from ._rank_main import main

        return main([host, str(port), str(rank), str(world), backend, str(timeout), str(threads)])
