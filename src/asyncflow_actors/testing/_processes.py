"""Node processes for tests: start one by hand, kill -9 one, freeze one, wait for a restart.

These run in *real* time (processes and sockets do not follow a ``MockClock``); every wait has a
bound and fails with ``TimeoutError`` naming what it waited for.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Mapping, Sequence

import attrs
import trio

from ..actors.remote import Node


def alive(pid: int) -> bool:
    """True if process ``pid`` runs (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (not Linux): ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


async def wait_until(
    predicate: Callable[[], bool], *, timeout: float = 10.0, interval: float = 0.02
) -> None:
    """Poll ``predicate`` until it holds; ``TimeoutError`` after ``timeout`` seconds."""
    with trio.move_on_after(timeout):
        while not predicate():  # noqa: ASYNC110 - process state has no event to wait on
            await trio.sleep(interval)
        return
    raise TimeoutError(
        f"{getattr(predicate, '__qualname__', predicate)!r} not true after {timeout}s"
    )


def kill9(pid: int) -> None:
    """``kill -9 pid``: no cleanup, no goodbye; the closest thing to pulling the plug."""
    os.kill(pid, signal.SIGKILL)


def kill_node(node: Node) -> int:
    """``kill -9`` the process of ``node`` now; returns its pid (see ``wait_node_restarted``)."""
    pid = node.pid
    if pid is None:
        raise RuntimeError(f"{node!r} has no process right now (starting, or stopped)")
    if pid == os.getpid():
        raise RuntimeError(f"{node!r} runs in this process (transport='inproc'): nothing to kill")
    kill9(pid)
    return pid


async def wait_node_restarted(node: Node, old_pid: int, *, timeout: float = 30.0) -> int:
    """Wait until ``node`` runs on a process other than ``old_pid``; returns the new pid."""

    def restarted() -> bool:
        return node.pid not in (None, old_pid)

    restarted.__qualname__ = f"{node!r} restarted (old pid {old_pid})"
    await wait_until(restarted, timeout=timeout)
    pid = node.pid
    assert pid is not None
    return pid


@contextlib.asynccontextmanager
async def frozen_process(pid: int) -> AsyncIterator[None]:
    """Stop process ``pid`` (SIGSTOP) for the block, then let it go on (SIGCONT).

    The process is alive but silent: it answers no ping, which is how a peer on a machine under
    heavy swap, or behind a long GC pause, looks from outside.
    """
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGCONT)


@attrs.frozen
class NodeProcess:
    """A node started by ``open_node_process``: where it listens, and its process."""

    address: str
    pid: int
    name: str
    process: trio.Process = attrs.field(repr=False, eq=False)

    def kill(self) -> None:
        """``kill -9`` the node now."""
        if self.process.returncode is None:
            kill9(self.pid)


async def _drain(stream: trio.abc.ReceiveStream) -> None:
    """Keep reading a node's stdout so that a chatty actor never blocks on a full pipe."""
    out = sys.stdout.buffer if hasattr(sys.stdout, "buffer") else None
    while data := await stream.receive_some(65536):
        if out is not None:
            out.write(data)
            out.flush()


@contextlib.asynccontextmanager
async def open_node_process(
    *,
    allow: Sequence[str],
    name: str = "node",
    bind: str = "tcp://127.0.0.1:*",
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    python: str = sys.executable,
    start_timeout: float = 30.0,
) -> AsyncIterator[NodeProcess]:
    """Run ``python -m asyncflow_actors.node`` for the block, as a user would on another host.

    Connect to it with ``system.connect_node(node.address, name=...)`` (or through a
    ``open_link_proxy``). The node is killed (-9) and reaped when the block exits; it also exits
    by itself if this process dies (it watches its stdin). ``args`` are extra command-line
    arguments (``--peer-timeout 2``, CURVE keys...).
    """
    cmd = [python, "-m", "asyncflow_actors.node", "--bind", bind, "--name", name]
    cmd += ["--exit-on-stdin-eof", *args]
    for prefix in allow:
        cmd += ["--allow", prefix]
    environment = dict(os.environ if env is None else env)
    environment.setdefault("PYTHONUNBUFFERED", "1")
    process = await trio.lowlevel.open_process(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=environment
    )
    try:
        assert process.stdout is not None
        line = b""
        with trio.move_on_after(start_timeout):
            while not line.endswith(b"\n"):
                chunk = await process.stdout.receive_some(1)
                if not chunk:
                    raise RuntimeError(f"node {name!r} exited before it was ready: {cmd}")
                line += chunk
        if not line.endswith(b"\n"):
            raise TimeoutError(f"node {name!r} did not report its endpoints in {start_timeout}s")
        ready = json.loads(line)
        node = NodeProcess(ready["endpoints"][0], int(ready["pid"]), name, process)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_drain, process.stdout)
            try:
                yield node
            finally:
                nursery.cancel_scope.cancel()
    finally:
        if process.returncode is None:
            process.kill()
        with trio.CancelScope(shield=True):
            await process.wait()
        if process.stdin is not None:
            with trio.CancelScope(shield=True):
                await process.stdin.aclose()
        if process.stdout is not None:
            with trio.CancelScope(shield=True):
                await process.stdout.aclose()
