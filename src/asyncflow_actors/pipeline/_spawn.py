"""A run's roles: spawning them in start order where the placement puts them, and the
watchdog that reads their state (``_run`` calls these once its queue and nodes are up)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..actors import ActorRef, Restart
from ..roles._driver_state import DriverState
from ._driver_resumer import spawn_driver
from ._placement import Placement
from ._role_classes import ROLE_MODULES, role_class
from ._warmup import roles_spec
from ._watchdog import RunStalled, gather_diagnosis

if TYPE_CHECKING:
    from ._run import Pipeline


def role_modules() -> dict[str, str]:
    """The module of each role's class (what a node hosting it preloads)."""
    return dict(ROLE_MODULES)


async def spawn_roles(
    place: Placement,
    spec: Any,
    controller: ActorRef[Any],
    run: Pipeline,
    spawned: list[ActorRef[Any]],
) -> None:
    from ..roles._driver import Driver

    config = place.config
    resume = DriverState.read(spec.resume_from) if spec.resume_from else None
    hooks = run.hooks
    # The Driver keeps the run's own [model] (what a checkpoint records, a resume compares);
    # the roles start from the warmed-up policy of a run that warms up.
    driver_spec, spec = spec, roles_spec(config, spec)
    driver, stop, run.driver_resumer = await spawn_driver(
        place, lambda previous: Driver(driver_spec, controller, hooks, resume, previous), hooks
    )
    spawned.append(stop)
    run.refs["driver"] = driver
    reward: ActorRef[Any] | None = None
    targets: list[ActorRef[Any]] = []
    for role, worker in config.instances():
        common = {"spec": spec, "worker": worker}
        cls: Any = role_class(role)
        if role == "reward":
            kwargs: dict[str, Any] = common
        elif role == "trainer":
            kwargs = {
                **common,
                "controller": controller,
                "driver": driver,
                "targets": tuple(targets),
            }
        elif role == "rollout":
            kwargs = {**common, "controller": controller, "reward": reward, "driver": driver}
        else:
            kwargs = {**common, "controller": controller}
        restart = Restart.TEMPORARY if role == "trainer" else Restart.PERMANENT
        ref = await place.spawn(cls, role=role, worker=worker, kwargs=kwargs, restart=restart)
        spawned.append(ref)
        run.refs[worker] = ref
        if role == "reward":
            reward = ref
        if role in ("rollout", "actor_fwd"):
            targets.append(ref)
        if role == "trainer":
            hooks.trainer = ref
            run.trainer = (worker, kwargs)
        if role == "rollout":
            hooks.rollouts.append(ref)


async def watch(run: Pipeline, controller: ActorRef[Any]) -> None:
    """The run's watchdog: its diagnosis from the queue, the roles and the Driver's hooks; a
    stall fails the run as a role's termination does (``wait`` raises it)."""

    async def gather(stalled_s: float) -> Any:
        return await gather_diagnosis(
            stalled_s,
            step=run.watchdog.version,
            answer_s=run.config.watchdog.answer_s,
            controller=controller,
            roles=run.refs,
            hooks=run.hooks,
        )

    def fail(error: RunStalled) -> None:
        run.errors.append(error)
        run.failed.set()

    await run.watchdog.run(gather, fail)
