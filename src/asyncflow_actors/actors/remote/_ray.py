"""``RayLauncher``: start nodes as Ray actors on a cluster that Ray already manages.

Ray places and starts the process, with the resources asked for (CPUs, GPUs, custom resources
such as ``NPU``, a bundle of a placement group), and reports its death. Everything else is ours:
the Ray actor runs ``serve_node`` (its own trio loop, in a thread of the Ray worker), binds tcp on
its Ray node's IP and answers on our zmq links; messages never go through Ray's object store.
Ray only carries the launch arguments (plain strings and numbers) and the node's endpoints back.

Security: the node binds beyond loopback, so it requires CURVE unless ``insecure=True`` (a
trusted network). By default (the node key model) every Ray node gets a keypair of its own and
admits the driver's key as its supervisor's; the driver binds the node's name to its key and
tells the other nodes, so a node can neither speak as another nor re-point one. A driver that
listens in the cluster key model (``system.listen(curve=..., key_model="cluster")`` by hand)
gives every node its keypair instead, as before. The driver's system listens on its Ray IP with
CURVE too, so actors on nodes can reach the driver's actors. The node's secret key and owner
token reach it as arguments of a Ray call: whoever may submit work to the Ray cluster can run
code on it anyway.

Death: the Ray method that runs the node returns (or fails) when the node ends or its actor dies
(``ray.kill``, a lost host, OOM); ``Launched.wait_exit`` waits for that without a thread, and the
``NodeActor`` turns it into ``NodeLost``. The zmq link's own monitor detects a lost connection
independently. Ray never restarts the actor (``max_restarts=0``): our supervisor does.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import logging
import os
import secrets
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import trio

from .._actor import ActorContext
from . import _protocol as P
from ._curve import CurveClient, CurveKeypair, CurveServer, KeyModel, curve_keypair
from ._endpoints import is_loopback
from ._launch import Launched, NodeOptions, _str_tuple
from ._mesh import Mesh
from ._system import mesh_of

log = logging.getLogger("asyncflow_actors.node")

# seconds removing a Ray actor may take before we stop waiting for Ray: within the node's stop
# budget (the 3 s a child process gets for SIGTERM, then SIGKILL)
KILL_TIMEOUT = 3.0
# Ray actor options the launcher sets itself (``ray_options`` may not override them)
_OWN_OPTIONS = frozenset(
    {
        "name",
        "lifetime",  # not detached: Ray removes the node when the driver dies
        "get_if_exists",
        "max_concurrency",
        "concurrency_groups",
        "max_restarts",
        "max_task_retries",
        "num_cpus",
        "num_gpus",
        "resources",
        "memory",
        "runtime_env",
        "scheduling_strategy",
    }
)


def _non_negative(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and not value >= 0:
        raise ValueError(f"{attribute.name} must be >= 0, got {value!r}")


def _check_ray_options(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    taken = sorted(_OWN_OPTIONS.intersection(value))
    if taken:
        raise ValueError(f"ray_options may not set {taken}: use the RayLauncher fields")


@attrs.frozen
class RayLauncher:
    """Start each node as a Ray actor (``system.launch_node(name, RayLauncher(...))``).

    ``allow``: module prefixes actors may be spawned from on the node (imported in the Ray
    worker: ship the code with Ray, e.g. ``runtime_env={"working_dir": ...}``). ``num_cpus``,
    ``num_gpus``, ``resources`` (custom ones, e.g. ``{"NPU": 1}`` on Ascend) and ``memory``
    (bytes) are the actor's Ray resource requests; Ray sets ``CUDA_VISIBLE_DEVICES`` (or its
    NPU counterpart) so the node's actors see only theirs. ``placement_group`` and
    ``bundle_index`` place it in a bundle of a Ray placement group (roles to co-locate; the
    group stays yours to remove). ``runtime_env`` and ``ray_options`` (e.g. ``label_selector``)
    go to Ray as they are. ``insecure``: no CURVE (a trusted network only). ``start_timeout``:
    how long Ray may take to place and start the actor (pending resources, autoscaling).
    """

    allow: tuple[str, ...] = attrs.field(converter=_str_tuple)
    num_cpus: float = attrs.field(default=1.0, validator=_non_negative)
    num_gpus: float = attrs.field(default=0.0, validator=_non_negative)
    resources: Mapping[str, float] = attrs.field(factory=dict, converter=dict)
    memory: int | None = attrs.field(default=None, validator=_non_negative)
    placement_group: Any = None
    bundle_index: int = -1
    runtime_env: Mapping[str, Any] | None = None
    ray_options: Mapping[str, Any] = attrs.field(
        factory=dict, converter=dict, validator=_check_ray_options
    )
    insecure: bool = False
    start_timeout: float = attrs.field(default=300.0, validator=_non_negative)

    def __attrs_post_init__(self) -> None:
        if self.bundle_index != -1 and self.placement_group is None:
            raise ValueError(f"bundle_index={self.bundle_index} needs a placement_group")

    def _actor_options(self, actor_name: str) -> dict[str, Any]:
        options: dict[str, Any] = dict(self.ray_options)
        options.update(
            name=actor_name,
            num_cpus=self.num_cpus,
            num_gpus=self.num_gpus,
            resources=dict(self.resources),
            max_concurrency=2,  # ``serve`` runs the node while ``ready`` answers
            max_restarts=0,  # restarts are our supervisor's: a node Ray restarted is unknown
            max_task_retries=0,
        )
        if self.memory is not None:
            options["memory"] = self.memory
        if self.runtime_env is not None:
            options["runtime_env"] = dict(self.runtime_env)
        if self.placement_group is not None:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                self.placement_group, placement_group_bundle_index=self.bundle_index
            )
        return options

    async def launch(self, ctx: ActorContext[Any], name: str, options: NodeOptions) -> Launched:
        import ray

        mesh = mesh_of(ctx.system)
        host = await trio.to_thread.run_sync(ray.util.get_node_ip_address)
        identity = await _prepare_driver(mesh, host, insecure=self.insecure)
        keypair = supervisor = None  # the node's keys; the driver's, in the node key model
        if identity is not None:
            driver, model = identity
            keypair = curve_keypair() if model == "node" else driver
            supervisor = driver if model == "node" else None
        token = secrets.token_hex(16)
        actor_name = f"afa-node:{name}:{secrets.token_hex(4)}"
        kwargs: dict[str, Any] = {
            "name": name,
            "allow": list(self.allow),
            "owner_token": token,
            "insecure": self.insecure,
            "curve_public": keypair.public.decode() if keypair is not None else "",
            "curve_secret": keypair.secret.decode() if keypair is not None else "",
            "supervisor_public": supervisor.public.decode() if supervisor is not None else "",
            "heartbeat_interval": options.heartbeat_interval,
            "heartbeat_timeout": options.heartbeat_timeout,
            "max_message_bytes": options.max_message_bytes,
            "shutdown_grace": options.shutdown_grace,
            "connect_timeout": options.connect_timeout,
        }
        ray_options = self._actor_options(actor_name)

        def submit() -> tuple[Any, Any, Any]:
            # creating an actor may export its class to the cluster: not on the trio thread
            handle = _remote_node_class().options(**ray_options).remote()
            return handle, handle.serve.remote(**kwargs), handle.ready.remote()

        with trio.CancelScope(shield=True):  # a cancellation must find the handle to kill
            handle, serve_ref, ready_ref = await trio.to_thread.run_sync(submit)

        async def kill() -> None:
            await _kill(handle, actor_name)

        try:
            with trio.move_on_after(self.start_timeout) as placing:
                ready = (await _resolved(ready_ref)).result()
            if placing.cancelled_caught:
                raise P.NodeLost(
                    f"Ray did not start node {name!r} within {self.start_timeout}s: are "
                    f"{self._request_text()} free on the cluster (or in the placement group)?"
                )
        except BaseException as exc:
            with trio.CancelScope(shield=True):
                await kill()
            if isinstance(exc, Exception) and not isinstance(exc, P.NodeLost):
                why = _summary(exc)
                raise P.NodeLost(f"node {name!r} failed to start as a Ray actor: {why}") from exc
            raise

        async def wait_exit() -> str:
            try:
                (await _resolved(serve_ref)).result()
            except Exception as exc:
                return f"its Ray actor {actor_name!r} died: {_summary(exc)}"
            return f"its Ray actor {actor_name!r} ended"

        curve = None
        if identity is not None and keypair is not None:
            curve = CurveClient(keypair.public, identity[0])
        return Launched(
            ready["endpoints"][0],
            curve=curve,
            owner_token=token,
            pid=ready["pid"],
            wait_exit=wait_exit,
            cleanup=kill,
        )

    def _request_text(self) -> str:
        wanted = {"CPU": self.num_cpus, "GPU": self.num_gpus, **self.resources}
        return ", ".join(f"{k}={v:g}" for k, v in wanted.items() if v)


def _summary(error: BaseException) -> str:
    """Ray's error in one line: what happened, and why (its first and last lines)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if not lines:
        return repr(error)
    return lines[0] if len(lines) == 1 else f"{lines[0]} {lines[-1]}"


# -- the driver's side ---------------------------------------------------------------------------


@attrs.define(eq=False)
class _DriverState:
    lock: trio.Lock = attrs.Factory(trio.Lock)
    keypair: CurveKeypair | None = None  # the driver's key, when it listens without CURVE
    warned: bool = False


_DRIVERS: weakref.WeakKeyDictionary[Mesh, _DriverState] = weakref.WeakKeyDictionary()


async def _prepare_driver(
    mesh: Mesh, host: str, *, insecure: bool
) -> tuple[CurveKeypair, KeyModel] | None:
    """Make the driver reachable from its Ray nodes; return its CURVE keypair and key model
    (``None``: insecure).

    A system that does not listen yet listens on ``tcp://<its Ray IP>:*``, with CURVE in the
    node key model under a new key unless ``insecure``. One that already listens keeps its
    sockets and its key model; without CURVE it gets a client key for its links to its nodes,
    which get keys of their own (they still reach each other, but not the driver's actors:
    listen with CURVE first for that).
    """
    state = _DRIVERS.setdefault(mesh, _DriverState())
    async with state.lock:  # concurrent launches must not both bind
        if mesh.server is None:
            bind = f"tcp://{host}:*"
            if insecure:
                await mesh.listen(bind, insecure=True)
            else:
                key = curve_keypair()
                await mesh.listen(bind, curve=CurveServer(key), key_model="node")
    if insecure:
        if all(is_loopback(e) for e in mesh.endpoints):
            _warn_unreachable(mesh, state, "only on loopback")
        return None
    if mesh.keys is not None:
        return mesh.keys.keypair, mesh.keys.model
    _warn_unreachable(mesh, state, "without CURVE")
    if state.keypair is None:
        state.keypair = curve_keypair()
    return state.keypair, "node"


def _warn_unreachable(mesh: Mesh, state: _DriverState, why: str) -> None:
    if not state.warned:
        state.warned = True
        log.warning(
            "system %s listens %s (%s): actors on its Ray nodes cannot reach its actors; "
            "call system.listen(...) before starting the first Ray node (docs/remote.md)",
            mesh.name,
            why,
            ", ".join(mesh.endpoints),
        )


async def _resolved(ref: Any) -> concurrent.futures.Future[Any]:
    """Wait until a Ray ``ObjectRef`` is resolved, without holding a thread; its future."""
    future: concurrent.futures.Future[Any] = ref.future()
    token = trio.lowlevel.current_trio_token()
    done = trio.Event()

    def wake(_: object) -> None:  # on a Ray thread (or here, if already done)
        with contextlib.suppress(trio.RunFinishedError):
            token.run_sync_soon(done.set)

    future.add_done_callback(wake)
    await done.wait()
    return future


async def _kill(handle: Any, actor_name: str) -> None:
    """Remove a node's Ray actor (idempotent), bounded: Ray's GCS may be unreachable."""
    import ray

    def kill() -> None:
        with contextlib.suppress(Exception):  # already gone, or Ray is shut down
            ray.kill(handle, no_restart=True)

    with trio.move_on_after(KILL_TIMEOUT) as scope:
        await trio.to_thread.run_sync(kill, abandon_on_cancel=True)
    if scope.cancelled_caught:
        log.warning("Ray did not confirm removing actor %s within %ss", actor_name, KILL_TIMEOUT)


# -- the Ray side --------------------------------------------------------------------------------


@functools.cache
def _remote_node_class() -> Any:
    import ray

    return ray.remote(_RayNode)


class _RayNode:
    """The Ray actor that hosts one node: ``serve`` runs it, ``ready`` reports its endpoints."""

    def __init__(self) -> None:
        self._bound = threading.Event()
        self._endpoints: list[str] = []
        self._error = ""

    def ready(self) -> dict[str, Any]:
        """The node's endpoints and pid once it listens (raises if it failed to start)."""
        self._bound.wait()
        if not self._endpoints:
            raise RuntimeError(self._error or "the node ended before it listened")
        return {"endpoints": self._endpoints, "pid": os.getpid()}

    def serve(
        self,
        *,
        name: str,
        allow: Sequence[str],
        owner_token: str,
        insecure: bool,
        curve_public: str,
        curve_secret: str,
        heartbeat_interval: float,
        heartbeat_timeout: float,
        max_message_bytes: int,
        shutdown_grace: float,
        connect_timeout: float,
        supervisor_public: str = "",
    ) -> None:
        """Run the node until its owner shuts it down (a Ray thread: trio runs in it)."""
        import ray.util

        ray_util: Any = ray.util  # (not fully typed)

        from ._system import serve_node

        curve = None
        authorized = None
        if curve_public:
            keypair = CurveKeypair(curve_public, curve_secret)
            curve = CurveServer(keypair)
            # the node key model admits the driver as supervisor; the cluster model, the key
            authorized = None if supervisor_public else [keypair.public]
        options = NodeOptions(
            connect_timeout=connect_timeout,
            heartbeat_interval=heartbeat_interval,
            heartbeat_timeout=heartbeat_timeout,
            shutdown_grace=shutdown_grace,
            max_message_bytes=max_message_bytes,
        )
        node = functools.partial(
            serve_node,
            f"tcp://{ray_util.get_node_ip_address()}:*",
            allow=allow,
            name=name,
            curve=curve,
            authorized_keys=authorized,
            key_model="node" if supervisor_public else "cluster",
            supervisor_keys=[supervisor_public.encode()] if supervisor_public else [],
            insecure=insecure,
            max_message_bytes=max_message_bytes,
            owner_token=owner_token,
            options=options,
        )

        async def main() -> None:
            async with trio.open_nursery() as nursery:
                self._endpoints = await nursery.start(node)
                self._bound.set()

        try:
            trio.run(main)
        except BaseException as exc:
            self._error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            self._bound.set()
