"""The ``asyncflow`` command.

- ``asyncflow train CONFIG.toml``: run the pipeline a TOML file describes
  (``docs/pipeline.md``); ``--resume DIR`` continues from a checkpoint of a run (or a run
  directory: its newest checkpoint). The first Ctrl-C / SIGTERM stops the run cleanly (the last
  step saved, one line naming the command that resumes it, exit 130 / 143); a second aborts.
- ``asyncflow dashboard RUN_DIR_OR_JSONL``: serve the dashboard of a run from its files, during
  the run or after it: ``metrics.jsonl`` (written by an observer with a ``run_dir``), followed
  as it grows, ``trace.json``, ``steps.jsonl`` and ``completions.jsonl``.
- ``asyncflow demo``: run the scripted pipeline of ``asyncflow_actors.observe.demo`` with an
  observer and the dashboard, to see what observing a run looks like.

``dashboard`` and ``demo`` print one JSON line with the dashboard's address (``url``,
``ws_url``, ``token``) once it listens, then serve until interrupted (exit 130 / 143).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import trio

if TYPE_CHECKING:  # the observer loads with the commands that use it: errors come fast
    from .observe import DashboardAddress, GraphEdge, SnapshotFeed


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="asyncflow",
        description="Asynchronous RL post-training of LLMs: train the pipeline a TOML file\n"
        "describes, watch a run's dashboard, or try the demo.",
        epilog="Examples:\n"
        "  asyncflow train run.toml\n"
        "  asyncflow train run.toml --steps 60 --resume runs/first/final\n"
        "  asyncflow dashboard runs/first\n"
        "Docs: docs/quickstart.md, docs/runs.md, docs/pipeline.md.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--debug", action="store_true",
        help="show the full trace of an error (or set ASYNCFLOW_DEBUG=1)",
    )  # fmt: skip
    sub = p.add_subparsers(dest="command", required=True)

    def dashboard_options(q: argparse.ArgumentParser) -> None:
        q.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback)")
        q.add_argument("--port", type=int, default=8265, help="page port (0: any free port)")
        q.add_argument("--ws-port", type=int, default=0, help="websocket port (0: any free port)")
        q.add_argument("--token", default=None, help="access token (generated off loopback)")

    t = sub.add_parser(
        "train", help="run the pipeline a TOML config describes", parents=[common],
        description="Run the pipeline a TOML file describes (docs/pipeline.md). The model is "
        "saved in run_dir/final at the end; the first Ctrl-C stops the run cleanly and prints "
        "the command that resumes it. Exit status: 0 done, 1 the run failed, 2 a configuration "
        "error, 130/143 stopped by SIGINT/SIGTERM.",
    )  # fmt: skip
    t.add_argument("config", help="a TOML file (see docs/pipeline.md)")
    t.add_argument(
        "--resume", default=None,
        help="a checkpoint directory (or a run directory: its newest one) to continue from",
    )  # fmt: skip
    t.add_argument(
        "--overwrite", action="store_true",
        help="replace the run already in run_dir (a new run refuses one otherwise)",
    )  # fmt: skip
    t.add_argument("--run-dir", default=None, help="override the config's run_dir")
    t.add_argument("--steps", type=int, default=None, help="override train.steps")
    t.add_argument(
        "--progress", choices=("auto", "rich", "plain", "none"), default=None,
        help="override the config's progress display",
    )  # fmt: skip

    d = sub.add_parser(
        "dashboard",
        help="serve the dashboard of a run (its metrics, trace, steps, samples)",
        parents=[common],
    )
    d.add_argument("path", help="a run directory or its metrics.jsonl")
    d.add_argument("--poll", type=float, default=0.5, help="seconds between reads of the file")
    dashboard_options(d)

    m = sub.add_parser(
        "demo", help="run the scripted pipeline with an observer and dashboard", parents=[common]
    )
    m.add_argument("--seconds", type=float, default=math.inf, help="stop after this long")
    m.add_argument("--run-dir", default=None, help="write metrics.jsonl and trace.json here")
    m.add_argument("--node", action="store_true", help="run the forward engine on a node process")
    m.add_argument("--staleness", type=int, default=1)
    dashboard_options(m)
    return p


def _announce(address: DashboardAddress) -> None:
    line = {"url": address.url, "ws_url": address.ws_url, "token": address.token}
    print(json.dumps(line), flush=True)


def _graph_beside(jsonl: str) -> tuple[GraphEdge, ...]:
    """The role graph an observer recorded next to its metrics (``observe.json``), if any."""
    from .observe import ObserveConfig

    meta = os.path.join(os.path.dirname(jsonl), "observe.json")
    try:
        with open(meta, encoding="utf-8") as f:
            return ObserveConfig(graph=json.load(f).get("graph", ())).graph
    except FileNotFoundError:
        return ()


async def _follow(path: str, feed: SnapshotFeed, poll: float) -> None:
    """Publish every snapshot of the JSONL file at ``path``, then those appended to it."""
    from .observe import MetricsSnapshot

    while not await trio.Path(path).exists():  # noqa: ASYNC110 (a file has no event to wait on)
        await trio.sleep(poll)
    async with await trio.open_file(path, encoding="utf-8") as f:
        pending = ""
        while True:
            chunk = await f.read()
            if not chunk:
                await trio.sleep(poll)
                continue
            pending += chunk
            *lines, pending = pending.split("\n")
            for line in lines:
                if line.strip():
                    feed.publish(MetricsSnapshot.from_json(json.loads(line)))


async def _dashboard(args: argparse.Namespace) -> None:
    from .observe import RunFiles, SnapshotFeed, serve

    path = args.path
    if await trio.Path(path).is_dir():
        path = os.path.join(path, "metrics.jsonl")
    feed = SnapshotFeed(_graph_beside(path))
    files = RunFiles(os.path.dirname(path) or ".")  # the run's trace, steps and completions
    feed.trace, feed.steps, feed.completions = files.trace, files.steps, files.completions
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_follow, path, feed, args.poll)
        address = await nursery.start(
            lambda task_status: serve(
                feed,
                host=args.host,
                port=args.port,
                ws_port=args.ws_port,
                token=args.token,
                task_status=task_status,
            )
        )
        _announce(address)


async def _demo(args: argparse.Namespace) -> None:
    import asyncflow_actors as afa

    from .observe import ObserveConfig, demo, open_observer, serve

    config = ObserveConfig(interval=0.5, run_dir=args.run_dir, graph=demo.GRAPH)
    async with afa.open_actor_system(handle_signals=False) as system:  # ours: _until_signal
        node = None
        if args.node:
            node = await system.start_node("engine-node", allow=["asyncflow_actors.observe"])
        async with open_observer(system, config) as observer, trio.open_nursery() as nursery:
            if node is not None:
                await observer.attach_node(node)
            address = await nursery.start(
                lambda task_status: serve(
                    observer.feed,
                    host=args.host,
                    port=args.port,
                    ws_port=args.ws_port,
                    token=args.token,
                    task_status=task_status,
                )
            )
            _announce(address)
            run = demo.DemoConfig(
                groups=10**9,
                staleness=args.staleness,
                rollout_delay=0.05,
                forward_delay=0.01,
                advantage_delay=0.002,
                train_delay=0.03,
                sync_delay=0.01,
            )
            with trio.move_on_after(args.seconds):
                await demo.run_demo(system, run, observer=observer, engine_node=node)
            nursery.cancel_scope.cancel()


class _Stops:
    """The CLI's signals: the first SIGINT / SIGTERM stops the run cleanly (or, before it has
    started, cancels its start); a second aborts the process at once."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.scope = trio.CancelScope()
        self.run: Any = None  # the Pipeline, once started

    async def watch(self, signals: AsyncIterator[int]) -> None:
        async for signum in signals:
            if self.signum is not None:
                print("asyncflow: aborted", file=sys.stderr, flush=True)
                sys.stdout.flush()
                os._exit(128 + signum)
            self.signum = signum
            if self.run is not None:
                self.run.stop()
            else:
                self.scope.cancel()

    @contextmanager
    def receiving(self) -> Iterator[AsyncIterator[int]]:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            yield signals


async def _until_signal(fn: Callable[[argparse.Namespace], Awaitable[None]], args: Any) -> int:
    """Run ``fn(args)`` until it returns (0) or a first signal cancels it (128 + signal)."""
    stops = _Stops()
    with stops.receiving() as signals:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stops.watch, signals)
            with stops.scope:
                await fn(args)
            nursery.cancel_scope.cancel()
    return 0 if stops.signum is None else 128 + stops.signum


async def _train_run(config: Any, resume: str | None, overwrite: bool, stops: _Stops) -> Any:
    """The run, stopped cleanly by a first signal; its result (``None``: stopped before it
    started)."""
    from .actors.remote import open_actor_system
    from .pipeline import open_pipeline

    result = None
    with stops.receiving() as signals:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stops.watch, signals)
            with stops.scope:
                async with (
                    open_actor_system(handle_signals=False) as system,  # ours: a clean stop
                    open_pipeline(system, config, resume=resume, overwrite=overwrite) as run,
                ):
                    stops.run = run
                    if stops.signum is not None:
                        run.stop()
                    result = await run.wait()
            nursery.cancel_scope.cancel()
    return result


def _stop_line(args: argparse.Namespace, result: Any) -> str:
    """The one line a stopped run prints: where it stopped and the command that resumes it."""
    step = result.version if result is not None else 0
    checkpoint = result.latest_checkpoint if result is not None else args.resume
    where = f"stopped at step {step}"
    if not checkpoint:
        why = "no run_dir" if result is not None and not result.run_dir else "no step finished"
        return f"{where}; nothing saved ({why})"
    command = ["asyncflow", "train", args.config, "--resume", checkpoint]
    if args.steps is not None:
        command += ["--steps", str(args.steps)]
    if args.run_dir is not None:
        command += ["--run-dir", args.run_dir]
    return f"{where}; resume with: {shlex.join(command)}"


def _train(args: argparse.Namespace) -> int:
    import attrs

    from .pipeline import PipelineConfig, PipelineConfigError
    from .pipeline._preflight import check_paths

    config = PipelineConfig.from_toml(args.config)
    try:
        if args.run_dir is not None:
            config = attrs.evolve(config, run_dir=args.run_dir)
        if args.progress is not None:
            config = attrs.evolve(config, progress=args.progress)
        if args.steps is not None:
            config = attrs.evolve(config, train=attrs.evolve(config.train, steps=args.steps))
    except ValueError as exc:  # a settings validator: the override's own key
        raise PipelineConfigError(f"--{str(exc).replace('_', '-')}") from exc
    # the quick checks before anything; the slower ones run while the nodes start
    # (``open_pipeline``), and fail the same way
    resume = check_paths(config, resume=args.resume, overwrite=args.overwrite)
    stops = _Stops()
    result = trio.run(_train_run, config, resume, args.overwrite, stops)
    if stops.signum is not None and (result is None or result.stopped):
        print(_stop_line(args, result), file=sys.stderr, flush=True)
        return 128 + stops.signum
    summary = {
        "mode": result.mode,
        "staleness": result.staleness,
        "steps": len(result.records),
        "version": result.version,
        "samples": result.samples,
        "seconds": round(result.seconds, 3),
        "samples_per_s": round(result.samples_per_s, 3),
        "final_reward": round(result.final_reward(), 4),
        "offpolicy_samples": result.offpolicy_samples,
        "run_dir": result.run_dir,
        "checkpoints": list(result.checkpoints),
    }
    print(json.dumps(summary), flush=True)
    return 0


def _root(error: BaseException) -> BaseException:
    """The error a user should read behind ``error`` (``actors.root_error``), a failed run's
    (``RunFailed``) included."""
    from .actors import root_error
    from .pipeline import RunFailed

    error = root_error(error)
    if isinstance(error, RunFailed) and error.error is not None:
        return root_error(error.error)
    return error


def _is_config_error(error: BaseException) -> bool:
    from .pipeline import PipelineConfigError
    from .roles._settings import SettingsError

    return isinstance(error, (PipelineConfigError, SettingsError))


def _one_line(error: BaseException) -> str:
    text = str(error).strip()
    first = text.splitlines()[0] if text else ""
    if _is_config_error(error):
        return first or type(error).__name__
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


def main(argv: Sequence[str] | None = None) -> None:
    """The ``asyncflow`` command: one line per failure (exit 2: the configuration, 1: the run;
    ``--debug`` or ``ASYNCFLOW_DEBUG=1``: the full trace)."""
    args = _parser().parse_args(argv)
    debug = args.debug or os.environ.get("ASYNCFLOW_DEBUG", "") not in ("", "0")
    try:
        if args.command == "train":
            code = _train(args)
        else:
            command = _dashboard if args.command == "dashboard" else _demo
            code = trio.run(_until_signal, command, args)
    except KeyboardInterrupt:  # before the event loop listens (loading, checking)
        if args.command == "train":
            print(_stop_line(args, None), file=sys.stderr, flush=True)
        code = 130
    except Exception as exc:
        if debug:
            raise
        root = _root(exc)
        config = _is_config_error(root)
        where = f"asyncflow {args.command}: "
        if not config:
            where += _failed_role(exc)
        hint = "" if config else " (--debug: the full trace)"
        if _stalled_log(root):  # the line names the stall; the file holds its diagnosis
            hint = f" (the diagnosis: {_stalled_log(root)}; --debug: the full trace)"
        print(f"{where}{_one_line(root)}{hint}", file=sys.stderr, flush=True)
        code = 2 if config else 1
    sys.exit(code)


def _stalled_log(error: BaseException) -> str | None:
    """The file holding a stalled run's diagnosis (``RunStalled``), if any."""
    from .pipeline import RunStalled

    return error.log if isinstance(error, RunStalled) else None


def _failed_role(error: BaseException) -> str:
    """``role 'trainer-0' failed: `` if ``error`` is a failed run (``RunFailed``)."""
    from .actors import root_error
    from .pipeline import RunFailed

    error = root_error(error)
    return f"role {error.role!r} failed: " if isinstance(error, RunFailed) else ""


if __name__ == "__main__":
    main()
