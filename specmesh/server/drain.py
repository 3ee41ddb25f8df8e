"""Graceful drain: how a server stops on SIGTERM without failing the work it holds.

A `Drain` belongs to one serving process front (the gRPC server, and the orchestrator's HTTP API
shares its server's). Once it begins, calls that would start new work are refused with
UNAVAILABLE (HTTP 503), in-flight calls run on, and when the shutdown grace ends the ones still
running are cut off with UNAVAILABLE "server is shutting down". Health turns NOT_SERVING at the
start (the caller does that: it owns the health servicer), so routers and Kubernetes stop sending.

The orchestrator refuses every new call. A model service keeps serving calls on the sessions it
holds (an orchestrator that is draining still runs its last rounds there) and refuses only new
sessions; its drain also waits for those sessions to close.

The cut-off works as `asyncio.timeout` does (which Python 3.10 lacks): the calls still running
at the grace's end have their tasks cancelled, and the cancellation becomes ShuttingDown where it
was tracked; so a cut-off call unwinds its finally blocks (sessions closed) like any cancelled one,
and a call that ends in time is never touched.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import time
import weakref
from typing import AsyncIterator, Callable

import grpc

from specmesh.errors import ShuttingDown
from specmesh.server.wrapped_handlers import WrappedHandlers

log = logging.getLogger(__name__)
DEFAULT_SHUTDOWN_GRACE_S = 30.0
STOP_MARGIN_S = 5.0  # beyond the grace: cut-off calls unwind, servers close, the process exits
BATCH_STREAMS = "Batches"  # VerifyBatches, ProposeBatches: many sessions' rounds on one long-lived stream
REFUSED_MESSAGE = "server is shutting down; send new requests to another replica"
_POLL_S = 0.05  # how often the drain looks at the work it waits for


def stop_bound_s(grace_s: float) -> float:
    """The longest a drained server takes from SIGTERM to exit: the grace, the unwinding of the calls cut
    off (Drain.wait), the server's own stop (specmesh.server.grpc_server.stop_server), and the process's exit."""
    return grace_s + 3 * STOP_MARGIN_S


def add_shutdown_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shutdown-grace", type=float, default=DEFAULT_SHUTDOWN_GRACE_S, metavar="SECONDS",
                        help="on SIGTERM/SIGINT: seconds in-flight requests may run on before they are "
                             "cancelled (new ones are refused at once); the process then exits 0")


class Drain:
    """Refuse new work, let in-flight work finish within a grace, cut off the rest."""

    def __init__(self, waits_for: tuple[Callable[[], int], ...] = (),
                 open_sessions: Callable[[], int] | None = None) -> None:
        """`waits_for`: work besides the tracked calls that a drain lets finish (it waits until each is 0).
        `open_sessions`, for a model service: while draining only new sessions are refused, and the drain
        waits until `open_sessions()` is 0 (their orchestrators close them when their streams end)."""
        self.draining = False
        self.grace_s = 0.0
        self._deadline: float | None = None  # loop time the grace ends at, once draining
        self._calls: dict[object, asyncio.Task] = {}  # one entry per track(): a task may nest them
        self._cut: weakref.WeakSet[asyncio.Task] = weakref.WeakSet()  # cancelled by the cut-off
        self._refuses: Callable[[str], bool] = lambda method: True
        self._other_work: list[Callable[[], int]] = list(waits_for)
        if open_sessions is not None:
            self._refuses = lambda method: method.rsplit("/", 1)[-1] == "OpenSession"
            self._other_work.append(open_sessions)

    def refuses(self, method: str) -> bool:
        return self.draining and self._refuses(method)

    def check_admitted(self, method: str) -> None:
        if self.refuses(method):
            raise ShuttingDown(REFUSED_MESSAGE)

    @contextlib.asynccontextmanager
    async def track(self) -> AsyncIterator[None]:
        """Run one in-flight call; raises ShuttingDown if it is still running when the grace ends.

        Enter it in the task that runs the call (a generator body counts): that task is the one cut off."""
        task, token = asyncio.current_task(), object()
        if self._deadline is not None and asyncio.get_running_loop().time() >= self._deadline:
            raise self._cut_off_error()
        self._calls[token] = task
        try:
            yield
        except asyncio.CancelledError:
            if task not in self._cut:
                raise
            if hasattr(task, "uncancel"):  # 3.11+: the cancellation was ours and ends here
                task.uncancel()
            raise self._cut_off_error() from None
        finally:
            del self._calls[token]

    def _cut_off_error(self) -> ShuttingDown:
        return ShuttingDown(f"server is shutting down: the request was cancelled at the end of the "
                            f"{self.grace_s:g} s shutdown grace")

    @property
    def in_flight(self) -> int:
        return len(self._calls) + sum(pending() for pending in self._other_work)

    def begin(self, grace_s: float) -> None:
        """Refuse new work from now on; in-flight calls get `grace_s` seconds."""
        if self.draining:
            return
        self.draining, self.grace_s = True, grace_s
        loop = asyncio.get_running_loop()
        self._deadline = loop.time() + grace_s
        loop.call_at(self._deadline, self._cut_off)
        log.info("draining: %d in flight, %g s grace", self.in_flight, grace_s)

    def _cut_off(self) -> None:
        for task in set(self._calls.values()):
            self._cut.add(task)
            task.cancel()

    async def wait(self) -> int:
        """Until nothing is in flight, or the grace (plus the margin for cut-off calls to unwind) is
        over; returns what is still in flight then."""
        give_up = time.monotonic() + self.grace_s + STOP_MARGIN_S
        while self.in_flight and time.monotonic() < give_up:
            await asyncio.sleep(_POLL_S)
        return self.in_flight


_DRAINS: weakref.WeakKeyDictionary[grpc.aio.Server, Drain] = weakref.WeakKeyDictionary()


def register(server: grpc.aio.Server, drain: Drain) -> None:
    _DRAINS[server] = drain


def drain_of(server: grpc.aio.Server) -> Drain:
    """The drain `specmesh.server.grpc_server.start_server` installed on `server`."""
    return _DRAINS[server]


class DrainInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls the drain refuses and tracks the rest; inside ErrorInterceptor, which turns
    ShuttingDown into UNAVAILABLE. Health and reflection are not its business."""

    def __init__(self, drain: Drain, service_names: list[str]):
        self.drain = drain
        self.prefixes = tuple(f"/{name}/" for name in service_names)
        self._handlers = WrappedHandlers(self._wrap)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(self.prefixes):
            return handler
        return self._handlers.wrapped(handler, method)

    def _wrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        if handler.unary_unary is not None:
            return handler._replace(unary_unary=self._wrap_unary(handler.unary_unary, method))
        if handler.unary_stream is not None:
            return handler._replace(unary_stream=self._wrap_stream(handler.unary_stream, method))
        if handler.stream_stream is not None and method.endswith(BATCH_STREAMS):
            # shared by every session of an orchestrator and open while it serves: its batches are the
            # work in flight, counted by its handler (specmesh.server.batches, a Drain's waits_for)
            return handler._replace(stream_stream=self._wrap_untracked(handler.stream_stream, method))
        if handler.stream_stream is not None:  # a session's rounds: in flight while the stream is open
            return handler._replace(stream_stream=self._wrap_stream(handler.stream_stream, method))
        return handler

    def _wrap_unary(self, behaviour, method: str):
        async def unary_unary(request, context):
            self.drain.check_admitted(method)
            async with self.drain.track():
                return await behaviour(request, context)
        return unary_unary

    def _wrap_untracked(self, behaviour, method: str):
        async def streaming(request_iterator, context):
            self.drain.check_admitted(method)
            async for response in behaviour(request_iterator, context):
                yield response
        return streaming

    def _wrap_stream(self, behaviour, method: str):
        async def streaming(request_or_iterator, context):
            self.drain.check_admitted(method)
            async with self.drain.track():
                async for response in behaviour(request_or_iterator, context):
                    yield response
        return streaming
