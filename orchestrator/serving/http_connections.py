"""The HTTP port's connection bounds (specmesh.server.connections) on uvicorn, and the API key checked first.

uvicorn has no cap on connections that keeps room for newcomers: its `limit_concurrency`
answers 503 to every request once that many connections are open, so strangers holding idle
connections would lock out an authenticated caller. And its keep-alive timeout starts only
after a first response, so a connection that never sends a request stays open forever. The
protocol below adds both, the way a public proxy does: at the cap, a new connection closes the
oldest connection with no request in flight (when every one is busy, the newcomer is closed
instead), and a connection whose first request head has not arrived within the handshake
timeout is closed, however slowly it trickles bytes in.

`ApiKeyFirst` answers 401 before anything else runs for the request: before its body is
read or parsed, before the routes, the body limit and the drain see it.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import Any

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from orchestrator.serving.http_front_door import OpenAIError
from specmesh.server.connections import ConnectionLimits
from specmesh.server.security import AUTHORIZATION, UNAUTHENTICATED_MESSAGE, authorized

OPEN_PATHS = frozenset({"/health"})  # probes work without the key
LISTEN_BACKLOG = 4096  # Linux clamps it to net.core.somaxconn (4096 by default)
MAX_REQUEST_HEAD_BYTES = 16 * 1024  # h11's bound on an incomplete request head (uvicorn's default, stated)


def bounded_protocol(limits: ConnectionLimits) -> type[H11Protocol]:
    """An H11Protocol class for one server: at most `limits.connection_cap()` connections."""
    cap = limits.connection_cap()
    open_connections: OrderedDict[H11Protocol, None] = OrderedDict()  # oldest first

    def make_room(newcomer: H11Protocol) -> None:
        for connection in open_connections:
            if connection is not newcomer and _idle(connection):
                open_connections.pop(connection)
                connection.transport.close()
                return
        open_connections.pop(newcomer)
        newcomer.transport.close()

    class BoundedH11Protocol(H11Protocol):
        _first_request_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            open_connections[self] = None
            self._first_request_timer = self.loop.call_later(limits.handshake_timeout_s, self._no_request_in_time)
            if len(open_connections) > cap:
                make_room(self)

        def connection_lost(self, exc: Exception | None) -> None:
            open_connections.pop(self, None)
            if self._first_request_timer is not None:
                self._first_request_timer.cancel()
            super().connection_lost(exc)

        def _no_request_in_time(self) -> None:
            if self.cycle is None and not self.transport.is_closing():  # no complete request head yet
                open_connections.pop(self, None)
                self.transport.close()

    BoundedH11Protocol.open_connections = open_connections  # for tests and the soak script
    return BoundedH11Protocol


def _idle(connection: H11Protocol) -> bool:
    """No request in flight: none started yet, or the last one answered (a keep-alive wait)."""
    return connection.cycle is None or connection.cycle.response_complete


def uvicorn_settings(limits: ConnectionLimits) -> dict[str, Any]:
    """uvicorn.Config's settings for `limits`."""
    cap = limits.connection_cap()
    return {
        "http": bounded_protocol(limits),
        # uvicorn answers 503 at this many connections or tasks. Connections stay within the cap
        # (above), but one closed for a newcomer counts until its connection_lost runs: under a storm
        # of reconnects hundreds are closing at once, and a cap + 1 here turned authenticated requests
        # away. Twice the cap still bounds the tasks of requests whose connection is gone.
        "limit_concurrency": 2 * cap,
        "timeout_keep_alive": max(1, round(limits.idle_timeout_s)),
        # Connections the kernel has completed but we have not accepted yet hold no descriptor of ours;
        # a short queue would leave clients that believe they are connected unanswered for a minute.
        "backlog": LISTEN_BACKLOG,
        "h11_max_incomplete_event_size": MAX_REQUEST_HEAD_BYTES,
    }


class ApiKeyFirst:
    """ASGI middleware: 401 (OpenAI's error shape) for a request without the key, before anything reads it."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app, self.api_key = app, api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        if authorized(Headers(scope=scope).get(AUTHORIZATION), self.api_key):
            return await self.app(scope, receive, send)
        refusal = OpenAIError(401, UNAUTHENTICATED_MESSAGE, code="invalid_api_key").response()
        # The body is never read: close the connection rather than leave it half-read for the next request.
        refusal.headers["connection"] = "close"
        await refusal(scope, receive, send)
