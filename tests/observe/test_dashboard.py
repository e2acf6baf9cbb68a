"""The dashboard: its HTTP routes, the websocket feed, the CLI, and a real headless Chromium."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import trio
import trio_websocket

import asyncflow_actors as afa
from asyncflow_actors import observe
from asyncflow_actors.observe import demo

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1400,1000",
]


def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def snapshot(samples: float) -> observe.MetricsSnapshot:
    reg = observe.MetricsRegistry()
    reg.counter("afa_role_samples_total", role="train", worker="t0").inc(samples)
    return reg.snapshot()


async def test_routes_token_and_prometheus() -> None:
    feed = observe.SnapshotFeed(demo.GRAPH)
    feed.publish(snapshot(5))
    async with trio.open_nursery() as nursery:
        address = await nursery.start(
            lambda task_status: observe.serve(feed, token="s3cret", task_status=task_status)
        )
        assert address.url.endswith("/?token=s3cret") and address.token == "s3cret"
        base = address.url.split("?")[0]
        assert (await trio.to_thread.run_sync(get, base))[0] == 403
        assert (await trio.to_thread.run_sync(get, base + "api/view?token=wrong"))[0] == 403
        status, page = await trio.to_thread.run_sync(get, address.url)
        assert status == 200 and b"asyncflow_actors" in page and b"__WS_PORT__" not in page
        status, body = await trio.to_thread.run_sync(get, base + "api/view?token=s3cret")
        view = json.loads(body)
        assert status == 200 and view["seq"] == 1
        assert [r["samples"] for r in view["roles"]] == [0, 0, 0, 5]  # the graph's roles, in order
        bearer = {"Authorization": "Bearer s3cret"}
        status, text = await trio.to_thread.run_sync(get, base + "metrics", bearer)
        assert status == 200 and b'afa_role_samples_total{role="train",worker="t0"} 5.0' in text
        status, body = await trio.to_thread.run_sync(get, base + "api/trace?token=s3cret")
        assert status == 200 and json.loads(body) == {"traceEvents": []}
        nursery.cancel_scope.cancel()


async def test_websocket_pushes_each_new_view_and_refuses_foreign_origins() -> None:
    feed = observe.SnapshotFeed()
    async with trio.open_nursery() as nursery:
        address = await nursery.start(observe.serve, feed)
        assert address.token is None  # loopback: no token needed
        with pytest.raises(trio_websocket.ConnectionRejected):
            async with trio_websocket.open_websocket_url(
                address.ws_url, extra_headers=[(b"Origin", b"http://evil.example")]
            ):
                pass
        async with trio_websocket.open_websocket_url(
            address.ws_url, extra_headers=[(b"Origin", address.url.rstrip("/").encode())]
        ) as ws:
            for n in (3, 8):
                feed.publish(snapshot(n))
                with trio.fail_after(10):
                    view = json.loads(await ws.get_message())
                assert view["seq"] == feed.seq and view["roles"][0]["samples"] == n
        nursery.cancel_scope.cancel()


def test_non_loopback_hosts_are_recognized() -> None:
    from asyncflow_actors.observe._dashboard import host_is_loopback, is_loopback

    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("host-3")
    for ok in ("localhost", "localhost:8080", "LOCALHOST.", "127.0.0.1:1", "[::1]:9", "[::1]"):
        assert host_is_loopback(ok), ok
    for bad in (None, "", "evil.example", "evil.example:8080", "127.0.0.1.evil.example", "[::2]:9"):
        assert not host_is_loopback(bad), bad


async def test_without_a_token_requests_naming_a_foreign_host_are_refused() -> None:
    """DNS rebinding: a page whose name now resolves to 127.0.0.1 sends its own name as Host."""
    feed = observe.SnapshotFeed(demo.GRAPH)
    feed.publish(snapshot(5))
    async with trio.open_nursery() as nursery:
        address = await nursery.start(observe.serve, feed)
        assert address.token is None
        base = address.url.rstrip("/") + "/"
        port = base.rsplit(":", 1)[1].rstrip("/")
        for path in ("", "api/view", "api/trace", "metrics", "trace"):
            status, body = await trio.to_thread.run_sync(
                get, base + path, {"Host": f"rebound.example:{port}"}
            )
            assert status == 403 and b"loopback" in body, path
            status, _ = await trio.to_thread.run_sync(
                get, base + path, {"Host": f"localhost:{port}"}
            )
            assert status == 200, path
        rebound = f"http://rebound.example:{port}".encode()
        with pytest.raises(trio_websocket.ConnectionRejected):
            async with trio_websocket.open_websocket_url(
                address.ws_url, extra_headers=[(b"Origin", rebound)]
            ):
                pass
        nursery.cancel_scope.cancel()


async def test_cli_dashboard_follows_a_growing_jsonl_file(tmp_path: Path) -> None:
    exporter = observe.JsonlExporter(tmp_path / "metrics.jsonl")
    (tmp_path / "observe.json").write_text(json.dumps({"graph": [["rollout", "train"]]}))
    exporter.export(snapshot(1))
    exporter.export(snapshot(2))
    cmd = [
        sys.executable,
        "-m",
        "asyncflow_actors.cli",
        "dashboard",
        str(tmp_path),
        "--port",
        "0",
        "--poll",
        "0.05",
    ]
    process = await trio.lowlevel.open_process(cmd, stdout=subprocess.PIPE)
    try:
        assert process.stdout is not None
        with trio.fail_after(30):
            line = b""
            while not line.endswith(b"\n"):
                line += await process.stdout.receive_some(4096)
        url = json.loads(line)["url"]

        async def view() -> dict[str, Any]:
            with trio.fail_after(10):
                while True:
                    status, body = await trio.to_thread.run_sync(get, url + "api/view")
                    if status == 200 and body != b"null":
                        return json.loads(body)  # type: ignore[no-any-return]
                    await trio.sleep(0.05)

        first = await view()
        with trio.fail_after(10):
            while first["seq"] < 2:
                first = await view()
        assert [r["role"] for r in first["roles"]] == ["rollout", "train"]
        assert first["roles"][1]["samples"] == 2
        exporter.export(snapshot(7))
        with trio.fail_after(10):
            while (latest := await view())["seq"] < 3:
                await trio.sleep(0.05)
        assert latest["roles"][1]["samples"] == 7
    finally:
        exporter.close()
        process.kill()
        with trio.CancelScope(shield=True):
            await process.wait()


def browser_missing() -> str | None:
    if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
        return f"no system browser ({CHROMIUM}, {CHROMEDRIVER}): apt-get install chromium chromium-driver"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (the dev extra)"
    return None


READ_PAGE = """
const num = (sel) => { const e = document.querySelector(sel); return e ? e.textContent : null; };
const roles = {};
for (const g of document.querySelectorAll('#graph-body .role')) {
  roles[g.id.slice(5)] = g.querySelector('[data-field=samples]').textContent;
}
const edges = {};
for (const g of document.querySelectorAll('#graph-body .edge')) {
  edges[g.dataset.edge] = g.querySelector('.depth').textContent;
}
return {seq: document.body.dataset.seq || "0", roles: roles, edges: edges,
        staleness: num('#staleness-count'), reward: num('#reward'), version: num('#version'),
        live: document.getElementById('status').classList.contains('live'),
        syncs: document.querySelectorAll('#syncs tbody tr').length};
"""


def read_panels(url: str) -> dict[str, Any]:
    """The steps and completions panels of the page at ``url``, once filled."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    profile = tempfile.mkdtemp(prefix="afa-chromium-")
    options.add_argument(f"--user-data-dir={profile}")
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        driver.get(url)
        deadline = time.monotonic() + 30
        while not driver.execute_script("return document.body.dataset.completions"):
            assert time.monotonic() < deadline, "the completions panel stayed empty"
            time.sleep(0.05)
        return driver.execute_script(  # type: ignore[no-any-return]
            "const d = document.body.dataset;"
            "const step = (id) => document.querySelector(id + ' tbody tr').cells[0].textContent;"
            "return {steps: d.steps, completions: d.completions,"
            "        first: [step('#completions'), step('#steps')]};"
        )
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def drive_browser(url: str, shots: Path) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Load the page, read it twice a few updates apart, then the trace view; screenshots."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    profile = tempfile.mkdtemp(prefix="afa-chromium-")
    options.add_argument(f"--user-data-dir={profile}")
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        driver.get(url)

        def read_after(seq: int) -> dict[str, Any]:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                reading: dict[str, Any] = driver.execute_script(READ_PAGE)
                if int(reading["seq"]) > seq and reading["live"]:
                    return reading
                time.sleep(0.05)
            raise AssertionError(f"the page did not update past {seq}: {reading}")

        first = read_after(2)
        second = read_after(int(first["seq"]) + 3)
        driver.save_screenshot(str(shots / "dashboard.png"))
        base, _, query = url.partition("?")
        driver.get(f"{base}trace?{query}")
        deadline = time.monotonic() + 30
        while not driver.execute_script("return document.body.dataset.spans"):
            assert time.monotonic() < deadline, "the trace view drew nothing"
            time.sleep(0.05)
        drawn = driver.execute_script(
            "return {spans: +document.body.dataset.spans, flows: +document.body.dataset.flows}"
        )
        driver.save_screenshot(str(shots / "trace-view.png"))
        return [first, second], drawn
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


@pytest.mark.skipif(browser_missing() is not None, reason=browser_missing() or "")
async def test_dashboard_in_headless_chromium_shows_the_metrics_live(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SE_OFFLINE", "true")  # selenium must never fetch a driver or browser
    run = demo.DemoConfig(
        groups=10**6,
        staleness=1,
        rollout_delay=0.02,
        forward_delay=0.004,
        advantage_delay=0.001,
        train_delay=0.01,
        sync_delay=0.006,
    )
    config = observe.ObserveConfig(interval=0.2, graph=demo.GRAPH)
    async with (
        afa.open_actor_system() as system,
        observe.open_observer(system, config) as obs,
        trio.open_nursery() as nursery,
    ):
        node = await system.start_node("engine-node", allow=["asyncflow_actors.observe"])
        await obs.attach_node(node)  # the trace view shows the engine's spans from that process
        address = await nursery.start(observe.serve, obs.feed)
        nursery.start_soon(lambda: demo.run_demo(system, run, observer=obs, engine_node=node))
        readings, drawn = await trio.to_thread.run_sync(drive_browser, address.url, tmp_path)
        checked = [(r, *obs.feed.get(int(r["seq"]))) for r in readings]
        nursery.cancel_scope.cancel()

    for reading, snap, view in checked:
        for role in demo.ROLES:
            assert int(reading["roles"][role]) == snap.total("afa_role_samples_total", role=role)
        for edge in demo.GRAPH:
            depth = snap.total("afa_tq_ready_samples", topic=edge.topic, consumer=edge.dst)
            assert int(reading["edges"][f"{edge.src}->{edge.dst}"]) == depth
        staleness = snap.find("afa_train_staleness_versions")
        assert staleness is not None and int(reading["staleness"]) == staleness.count
        assert reading["reward"] == f"{snap.value('afa_reward_mean', role='train'):.3f}"
        assert int(reading["version"]) == snap.value(
            "afa_policy_version", role="train", worker="train-0"
        )
        assert reading["syncs"] == min(len(view["syncs"]), 8)
    first, second = readings
    assert int(second["roles"]["train"]) > int(first["roles"]["train"])  # the numbers move
    assert int(second["staleness"]) > int(first["staleness"])
    assert drawn["spans"] > 0 and drawn["flows"] > 0  # the trace view drew spans and flows
    for name in ("dashboard.png", "trace-view.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        keep = os.environ.get("AFA_SCREENSHOT_DIR")  # refreshes the docs' pictures
        if keep:
            shutil.copy(tmp_path / name, Path(keep) / name)


async def test_cli_dashboard_serves_a_finished_runs_files(tmp_path: Path) -> None:
    """After a run: its trace (all of it, or its last seconds), its step records and its
    sample completions, read from the run directory, through the dashboard's HTTP routes."""
    from asyncflow_actors.pipeline import run_pipeline

    from ..pipeline.kit import tiny

    run_dir = tmp_path / "run"
    config = tiny(run_dir=str(run_dir), observe=True, report={"log_completions_every": 1})
    await run_pipeline(config)
    trace = json.loads((run_dir / "trace.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert spans
    cmd = [sys.executable, "-m", "asyncflow_actors.cli", "dashboard", str(run_dir), "--port", "0"]
    process = await trio.lowlevel.open_process(cmd, stdout=subprocess.PIPE)
    try:
        assert process.stdout is not None
        with trio.fail_after(30):
            line = b""
            while not line.endswith(b"\n"):
                line += await process.stdout.receive_some(4096)
        url = json.loads(line)["url"]

        async def read(route: str) -> Any:
            status, body = await trio.to_thread.run_sync(get, url + route)
            assert status == 200, (route, body)
            return json.loads(body)

        assert await read("api/trace") == trace
        # ``last`` chosen halfway between two spans' ends (the run's own length varies with the
        # machine): the spans that ended after it, and only those
        ends = sorted({e["ts"] + e["dur"] for e in spans})
        middle = len(ends) // 2
        last = (ends[-1] - (ends[middle - 1] + ends[middle]) / 2) / 1e6
        recent = [e for e in (await read(f"api/trace?last={last!r}"))["traceEvents"]
                  if e["ph"] == "X"]  # fmt: skip
        assert recent == [e for e in spans if e["ts"] + e["dur"] >= ends[middle]]
        assert 0 < len(recent) < len(spans)
        steps = [json.loads(x) for x in (run_dir / "steps.jsonl").read_text().splitlines()]
        assert await read("api/steps") == steps and len(steps) == 3
        assert await read("api/steps?last=2") == steps[-2:]
        samples = (run_dir / "completions.jsonl").read_text().splitlines()
        assert await read("api/completions?last=2") == [json.loads(x) for x in samples[-2:]]
        assert [c["step"] for c in await read("api/completions")] == [1, 1, 2, 2, 3, 3]
        with trio.fail_after(10):  # the run's metrics.jsonl, followed
            while (view := await read("api/view")) is None:
                await trio.sleep(0.05)
        assert view["seq"] >= 1
        if browser_missing() is None:  # the page's panels show them
            shown = await trio.to_thread.run_sync(read_panels, url)
            assert shown["steps"] == "3" and shown["completions"] == "6"
            assert shown["first"] == ["3", "3"]  # the latest first, in both
    finally:
        process.kill()
        with trio.CancelScope(shield=True):
            await process.wait()


def test_run_files_skip_a_line_being_written_and_a_trace_not_yet_there(tmp_path: Path) -> None:
    files = observe.RunFiles(tmp_path)
    assert files.trace() == {"traceEvents": []} and files.steps() == []
    (tmp_path / "steps.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"ste')
    assert files.steps() == [{"step": 1}, {"step": 2}] and files.steps(1) == [{"step": 2}]
    (tmp_path / "trace.json").write_text('{"traceEvents": [')  # being written
    assert files.trace() == {"traceEvents": []}
    (tmp_path / "trace.json").write_text('{"traceEvents": [{"ph": "M"}]}')
    assert files.trace(5.0) == {"traceEvents": [{"ph": "M"}]}
