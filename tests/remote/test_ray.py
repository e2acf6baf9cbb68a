"""The RayLauncher against a local Ray instance: nodes are Ray actors, data flows over our links."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import trio

import asyncflow_actors as afa
from asyncflow_actors.actors.remote import RayLauncher
from tests.remote.ray_actors import AskPeer, Ear, Env, Heard, Placed, Size, Where

ray = pytest.importorskip("ray", reason="ray is not installed (the `ray` extra)")

pytestmark = pytest.mark.slow

ALLOW = ["tests.remote"]
OPTIONS = afa.NodeOptions(shutdown_grace=2.0)


@pytest.fixture(scope="module")
def local_ray(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A fresh local Ray instance with 2 CPUs (never a cluster named by RAY_ADDRESS)."""
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=80 << 20,  # the minimum: our messages never use it
        _temp_dir=str(tmp_path_factory.mktemp("ray")),  # its logs, not in /tmp/ray
    )
    try:
        yield ray.util.get_node_ip_address()
    finally:
        ray.shutdown()


async def node_actors() -> list[str]:
    """The live Ray actors the launcher created (it names them ``afa-node:<node>:<id>``)."""
    names = await trio.to_thread.run_sync(ray.util.list_named_actors)
    return sorted(name for name in names if name.startswith("afa-node:"))


async def no_node_actors_left() -> None:
    with trio.fail_after(10):  # Ray forgets a killed actor asynchronously
        while await node_actors():
            await trio.sleep(0.05)


async def heard(ear: afa.ActorRef[Heard], text: str, times: int = 1) -> tuple[str, ...]:
    """What ``ear`` has heard once it heard ``text`` ``times`` times (sent from a node: it may
    still be in flight)."""
    with trio.fail_after(10):
        while (got := await ear.ask(Heard())).count(text) < times:
            await trio.sleep(0.02)
    return got


async def test_actors_on_a_ray_node_talk_over_our_links_and_stop_removes_it(
    local_ray: str,
) -> None:
    async with afa.open_actor_system() as system:
        node = await system.launch_node("r", RayLauncher(ALLOW), options=OPTIONS)
        [actor_name] = await node_actors()
        assert actor_name.startswith("afa-node:r:")
        # bound on the Ray node's IP, with CURVE: the driver listens there too, with the key
        assert node.address.startswith(f"tcp://{local_ray}:")
        assert all(e.startswith(f"tcp://{local_ray}:") for e in system.mesh.endpoints)
        assert system.mesh.curve is not None
        ear = await system.spawn(Ear, name="ear")
        placed = await node.spawn(Placed, name="p", kwargs={"ear": ear})
        pid, ray_node, group = await placed.ask(Where())
        assert pid == node.pid != os.getpid()  # the Ray worker's process hosts the node
        assert ray_node == ray.get_runtime_context().get_node_id()
        assert group == ""
        assert await heard(ear, "p started") == ("p started",)  # node -> driver, over CURVE
        # a peer without the cluster key gets no answer from the node
        async with afa.open_actor_system() as stranger:
            with pytest.raises(afa.ActorCrashed) as info:
                quick = afa.NodeOptions(connect_timeout=1.0)
                await stranger.connect_node(node.address, name="r", options=quick)
            assert isinstance(info.value.error, afa.NodeLost)
        # data goes over our link to the node, not through Ray
        before = system.mesh.statistics().bytes_total
        assert await placed.ask(Size(bytes(4 << 20))) == 4 << 20
        assert system.mesh.statistics().bytes_total - before >= 4 << 20
        await node.stop()  # polite: the node stops its actors before Ray removes the actor
        assert await heard(ear, "p stopped") == ("p started", "p stopped")
        await no_node_actors_left()


async def test_a_killed_ray_actor_is_a_lost_node_and_restarts_with_its_actors(
    local_ray: str,
) -> None:
    async with afa.open_actor_system() as system:
        launcher = RayLauncher(ALLOW, insecure=True)  # a trusted network: no CURVE
        node = await system.launch_node("k", launcher, options=OPTIONS)
        assert system.mesh.curve is None
        ear = await system.spawn(Ear, name="ear")
        placed = await node.spawn(Placed, name="p", kwargs={"ear": ear})
        old_pid, _, _ = await placed.ask(Where())
        [old_name] = await node_actors()
        lost = trio.Event()
        async with trio.open_nursery() as nursery:

            async def pending() -> None:
                with pytest.raises(afa.ActorCrashed) as info:
                    await placed.ask(AskPeer(placed))  # asks itself: waits forever on its loop
                assert isinstance(info.value.error, afa.NodeLost)
                lost.set()

            nursery.start_soon(pending)
            handle = await trio.to_thread.run_sync(ray.get_actor, old_name)
            await trio.to_thread.run_sync(lambda: ray.kill(handle, no_restart=True))
            with trio.fail_after(5):
                await lost.wait()
        with trio.fail_after(60):  # the same ref, respawned on a new Ray actor
            new_pid, _, _ = await placed.ask(Where())
        assert new_pid == node.pid != old_pid
        [new_name] = await node_actors()
        assert new_name != old_name
        assert node.ref.statistics().restarts == 1
        assert await heard(ear, "p started", times=2) == ("p started", "p started")
    await no_node_actors_left()


async def test_two_nodes_share_a_placement_group_and_reach_each_other(local_ray: str) -> None:
    from ray.util.placement_group import placement_group, remove_placement_group

    group = placement_group([{"CPU": 1}, {"CPU": 1}], strategy="STRICT_PACK")
    try:
        async with afa.open_actor_system() as system:
            ear = await system.spawn(Ear, name="ear")
            nodes: dict[str, afa.Node] = {}
            refs: dict[str, afa.ActorRef[Where | AskPeer]] = {}

            async def start(name: str, bundle: int) -> None:
                launcher = RayLauncher(ALLOW, placement_group=group, bundle_index=bundle)
                nodes[name] = await system.launch_node(name, launcher, options=OPTIONS)
                refs[name] = await nodes[name].spawn(Placed, name="p", kwargs={"ear": ear})

            async with trio.open_nursery() as nursery:  # launched concurrently
                nursery.start_soon(start, "a", 0)
                nursery.start_soon(start, "b", 1)
            assert len(await node_actors()) == 2
            where_a = await refs["a"].ask(Where())
            where_b = await refs["a"].ask(AskPeer(refs["b"]))  # node a asks node b directly
            assert where_b == await refs["b"].ask(Where())
            assert where_a[0] != where_b[0]  # two processes ...
            assert where_a[1:] == where_b[1:] == (where_a[1], group.id.hex())  # ... co-located
            await heard(ear, "p started", times=2)
        await no_node_actors_left()
    finally:
        remove_placement_group(group)


async def test_a_node_ray_cannot_place_fails_to_start_and_leaves_nothing(local_ray: str) -> None:
    async with afa.open_actor_system() as system:
        launcher = RayLauncher(ALLOW, num_gpus=1, start_timeout=1.0)  # no GPU here
        with pytest.raises(afa.ActorCrashed) as info:
            await system.launch_node("gpu", launcher)
        assert isinstance(info.value.error, afa.NodeLost)
        assert "GPU=1" in str(info.value.error)
        await no_node_actors_left()


@pytest.fixture
def ray_gpu(local_ray: str) -> None:
    if ray.cluster_resources().get("GPU", 0) < 1:
        pytest.skip("the local Ray instance sees no GPU")


@pytest.mark.usefixtures("ray_gpu")
async def test_a_gpu_node_sees_only_the_gpu_ray_gave_it() -> None:
    async with afa.open_actor_system() as system:
        node = await system.launch_node("g", RayLauncher(ALLOW, num_gpus=1), options=OPTIONS)
        ear = await system.spawn(Ear, name="ear")
        placed = await node.spawn(Placed, name="p", kwargs={"ear": ear})
        visible = await placed.ask(Env("CUDA_VISIBLE_DEVICES"))
        assert visible.isdigit(), visible  # exactly one device, the one Ray assigned
    await no_node_actors_left()


def test_launcher_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="placement_group"):
        RayLauncher(ALLOW, bundle_index=1)
    with pytest.raises(ValueError, match="num_gpus"):
        RayLauncher(ALLOW, num_gpus=-1)
    with pytest.raises(ValueError, match=r"\['max_restarts'\]"):
        RayLauncher(ALLOW, ray_options={"max_restarts": 3, "label_selector": {}})
