"""The live dashboard: a page served by hypercorn on trio, updates pushed over trio-websocket.

``serve(feed)`` runs two listeners on the same host: hypercorn (its trio worker) serves the page,
``/trace`` (a timeline of the last seconds of spans, with the samples' flows), ``/api/view`` (the
current view as JSON), ``/api/trace[?last=SECONDS]`` (the trace as Chrome JSON),
``/api/steps[?last=N]`` and ``/api/completions[?last=N]`` (a run's step records and sample
completions, when the feed has them) and ``/metrics`` (Prometheus text); trio-websocket pushes each new view to every open page. Both bind to loopback
unless told otherwise; bound elsewhere they require an access token (``?token=`` on every URL,
or ``Authorization: Bearer``), generated when not given. Without a token, a request must name a
loopback host in its ``Host`` header, and a websocket's ``Origin`` (browsers always send one)
must be loopback: a page on another site that rebinds its own name to 127.0.0.1 (DNS
rebinding) reads nothing. The
page is a single static file with no external resources, so it works offline.
"""

from __future__ import annotations

import hmac
import importlib.resources
import ipaddress
import json
import logging
import secrets
import urllib.parse
from collections.abc import Awaitable, Callable, MutableMapping
from functools import partial
from typing import Any

import attrs
import trio

from ._feed import SnapshotFeed

log = logging.getLogger("asyncflow_actors.observe")

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


@attrs.frozen
class DashboardAddress:
    """Where a dashboard listens: open ``url`` (it carries the token when there is one)."""

    url: str
    ws_url: str
    token: str | None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_is_loopback(host_header: str | None) -> bool:
    """Whether a ``Host`` header (``name``, ``name:port``, ``[v6]:port``) names a loopback host.

    A missing header is refused: every browser sends one, and a DNS-rebound page is a browser.
    """
    if not host_header:
        return False
    host = host_header.strip()
    if host.startswith("["):
        host = host[1 : host.find("]")] if "]" in host else ""
    elif host.count(":") == 1:
        host = host.partition(":")[0]
    return is_loopback(host.rstrip(".").lower())


def _page(name: str) -> bytes:
    return importlib.resources.files(__package__).joinpath(name).read_bytes()


def _token_ok(expected: str | None, query: str, authorization: str | None) -> bool:
    if expected is None:
        return True
    given = urllib.parse.parse_qs(query).get("token", [""])[0]
    if not given and authorization and authorization.lower().startswith("bearer "):
        given = authorization[7:].strip()
    return hmac.compare_digest(given.encode(), expected.encode())


class DashboardApp:
    """The ASGI application hypercorn serves (routes above; everything is read-only)."""

    def __init__(self, feed: SnapshotFeed, *, token: str | None, ws_port: int) -> None:
        self.feed = feed
        self.token = token
        self.ws_port = ws_port
        self.page = _page("dashboard.html").replace(b"__WS_PORT__", str(ws_port).encode())
        self.trace_page = _page("trace.html")
        self._prometheus: Any = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        query = scope.get("query_string", b"").decode("latin-1")
        if not _token_ok(self.token, query, headers.get("authorization")):
            await self._respond(send, 403, b"forbidden: a valid token is required\n", "text/plain")
            return
        if self.token is None and not host_is_loopback(headers.get("host")):
            await self._respond(
                send, 403, b"forbidden: host is not a loopback name\n", "text/plain"
            )
            return
        path = scope["path"]
        if path == "/":
            await self._respond(send, 200, self.page, "text/html; charset=utf-8")
        elif path == "/api/view":
            await self._json(send, self._view(query))
        elif path == "/trace":
            await self._respond(send, 200, self.trace_page, "text/html; charset=utf-8")
        elif path == "/api/trace":
            await self._json(send, await self._trace(query))
        elif path in ("/api/steps", "/api/completions"):
            await self._json(send, await self._records(path.rpartition("/")[2], query))
        elif path == "/metrics":
            await self._metrics(scope, receive, send)
        else:
            await self._respond(send, 404, b"not found\n", "text/plain")

    def _view(self, query: str) -> dict[str, Any] | None:
        wanted = urllib.parse.parse_qs(query).get("seq")
        if wanted:
            try:
                return self.feed.get(int(wanted[0]))[1]
            except (KeyError, ValueError):
                return None
        return self.feed.view

    async def _trace(self, query: str) -> dict[str, Any]:
        if self.feed.trace is None:
            return {"traceEvents": []}
        last = urllib.parse.parse_qs(query).get("last")
        try:
            seconds = float(last[0]) if last else None
        except ValueError:
            seconds = None
        # Building a long trace takes a while: off the event loop.
        return await trio.to_thread.run_sync(self.feed.trace, seconds)

    async def _records(self, kind: str, query: str) -> list[dict[str, Any]]:
        read = self.feed.steps if kind == "steps" else self.feed.completions
        if read is None:
            return []
        last = urllib.parse.parse_qs(query).get("last")
        try:
            count = int(last[0]) if last else None
        except ValueError:
            count = None
        return await trio.to_thread.run_sync(read, count)

    async def _metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._prometheus is None:
            from prometheus_client import make_asgi_app

            from ._exporters import prometheus_registry

            self._prometheus = make_asgi_app(prometheus_registry(self.feed))
        await self._prometheus(scope, receive, send)

    async def _json(self, send: Send, value: Any) -> None:
        body = json.dumps(value, separators=(",", ":")).encode()
        await self._respond(send, 200, body, "application/json")

    @staticmethod
    async def _respond(send: Send, status: int, body: bytes, content_type: str) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", content_type.encode()),
                    (b"content-length", str(len(body)).encode()),
                    (b"cache-control", b"no-store"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


async def _push_views(feed: SnapshotFeed, token: str | None, request: Any) -> None:
    """One websocket client: check its token and origin, then send every new view."""
    from trio_websocket import ConnectionClosed

    query = request.path.partition("?")[2]
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in request.headers}
    origin = headers.get("origin")
    if not _token_ok(token, query, headers.get("authorization")):
        await request.reject(403, body=b"a valid token is required")
        return
    if token is None and origin is not None:
        # Without a token, only pages served from a loopback address may read the feed (a
        # web page from elsewhere could otherwise open this socket from the user's browser).
        host = urllib.parse.urlsplit(origin).hostname or ""
        if not is_loopback(host.strip("[]")):
            await request.reject(403, body=b"origin not allowed")
            return
    ws = await request.accept()
    try:
        seq = feed.seq
        if feed.view is not None:
            await ws.send_message(json.dumps(feed.view, separators=(",", ":")))
        while True:
            seq = await feed.wait_after(seq)
            assert feed.view is not None
            await ws.send_message(json.dumps(feed.view, separators=(",", ":")))
    except ConnectionClosed:
        return


def _bind(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def serve(
    feed: SnapshotFeed,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    ws_port: int = 0,
    token: str | None = None,
    task_status: trio.TaskStatus[DashboardAddress] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the dashboard of ``feed`` until cancelled: ``await nursery.start(serve, feed)``.

    Returns (through ``nursery.start``) a :class:`DashboardAddress`. Port 0 picks free ports.
    A ``host`` other than loopback requires a ``token``; one is generated when not given (read
    it from the address). Needs the ``observe`` extra (hypercorn, trio-websocket).
    """
    try:
        import hypercorn.config
        import hypercorn.trio
        import trio_websocket
    except ImportError as exc:
        raise ImportError(
            "the dashboard needs the observe extra: pip install 'asyncflow-actors[observe]'"
        ) from exc
    if token is None and not is_loopback(host):
        token = secrets.token_urlsafe(18)
    async with trio.open_nursery() as nursery:
        ws_server = await nursery.start(
            partial(
                trio_websocket.serve_websocket,
                partial(_push_views, feed, token),
                host,
                ws_port,
                None,
            )
        )
        config = hypercorn.config.Config()
        config.bind = [_bind(host, port)]
        config.accesslog = None
        config.errorlog = log  # hypercorn's messages go to our logger, not stderr
        app = DashboardApp(feed, token=token, ws_port=ws_server.port)
        binds: list[str] = await nursery.start(
            partial(hypercorn.trio.serve, app, config)  # type: ignore[arg-type]
        )
        suffix = f"?token={urllib.parse.quote(token)}" if token else ""
        ws_host = _bind(host, ws_server.port)
        task_status.started(
            DashboardAddress(
                url=f"{binds[0]}/{suffix}", ws_url=f"ws://{ws_host}/{suffix}", token=token
            )
        )
