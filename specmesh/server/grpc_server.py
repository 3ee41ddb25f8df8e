"""gRPC server plumbing shared by the three services.

`start_server` binds (port 0 picks a free port, for tests), adds the standard
health and reflection services, and installs `ErrorInterceptor`, the one place
where domain errors become status codes (INVALID_ARGUMENT carries a google.rpc
BadRequest naming the field) and anything unexpected becomes INTERNAL; a request whose
bytes do not decode (invalid UTF-8 in a string, garbage) is INVALID_ARGUMENT naming the
field too, never UNKNOWN. Messages above `max_request_bytes` are refused by gRPC itself
(RESOURCE_EXHAUSTED, naming the limit) before they are read. Transport
security comes in through it too: TLS or mutual TLS from a `TLSConfig`, and the key
check (`specmesh.server.security.ApiKeyInterceptor`: the API key, or the internal token of the
draft and target) on the services it is asked to guard.
Every server has a `specmesh.server.drain.Drain` (`drain_of(server)`): `serve_until_signal` drains
on SIGTERM/SIGINT (NOT_SERVING, new calls UNAVAILABLE, in-flight ones get the grace) and stops.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import signal
from typing import TYPE_CHECKING, Callable, Iterable

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection
from grpc_status import rpc_status

from specmesh.server.connections import ConnectionLimits, grpc_server_options
from specmesh.server.drain import DEFAULT_SHUTDOWN_GRACE_S, STOP_MARGIN_S, Drain, DrainInterceptor, drain_of
from specmesh.server.drain import register as register_drain
from specmesh.errors import InvalidArgument, SpecmeshError
from specmesh.server.request_decoding import UndecodableRequest, tolerant_deserializer
from specmesh.server.security import UNAUTHENTICATED_MESSAGE, ApiKeyInterceptor, TLSConfig
from specmesh.server.telemetry import server_interceptors, server_message_span
from specmesh.server.wrapped_handlers import WrappedHandlers

if TYPE_CHECKING:  # annotations only: the tracing SDK loads where tracing is on (start time)
    from opentelemetry.sdk.trace import TracerProvider

log = logging.getLogger(__name__)
DEFAULT_MAX_REQUEST_BYTES = 64 * 1024 * 1024  # the services' cap; the orchestrator's clients get a tighter one
INTERNAL_DETAILS_PREFIX = "internal error: "  # every INTERNAL our servers send; grpc's own transport failures lack it


def error_status(error: SpecmeshError) -> grpc.Status:
    """A rich status for `error`; INVALID_ARGUMENT names the offending field."""
    status = status_pb2.Status(code=error.code.value[0], message=str(error))
    if isinstance(error, InvalidArgument):
        detail = any_pb2.Any()
        detail.Pack(error_details_pb2.BadRequest(field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field=error.field, description=error.description)
        ]))
        status.details.append(detail)
    return rpc_status.to_status(status)


def unexpected_status(error: BaseException, where: str) -> status_pb2.Status:
    """INTERNAL for an error no domain error maps (logged with where it happened); its type only goes out."""
    log.exception("unexpected error in %s", where, exc_info=error)
    return status_pb2.Status(code=code_pb2.INTERNAL, message=f"{INTERNAL_DETAILS_PREFIX}{type(error).__name__}")


async def _abort_for(error: BaseException, context: grpc.aio.ServicerContext, method: str) -> None:
    if isinstance(error, SpecmeshError):
        await context.abort_with_status(error_status(error))
    await context.abort_with_status(rpc_status.to_status(unexpected_status(error, method)))


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps SpecmeshError to its status code, undecodable requests to INVALID_ARGUMENT, the rest to INTERNAL."""

    def __init__(self):
        self._handlers = WrappedHandlers(self._wrap)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        return self._handlers.wrapped(handler, handler_call_details.method)

    def _wrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        deserializer = tolerant_deserializer(handler.request_deserializer)
        if handler.unary_unary is not None:
            return handler._replace(unary_unary=self._wrap_unary(handler.unary_unary, method),
                                    request_deserializer=deserializer)
        if handler.unary_stream is not None:
            # Health's Watch writes with context.write from a coroutine rather than yielding.
            wrap = self._wrap_stream if inspect.isasyncgenfunction(handler.unary_stream) else self._wrap_unary
            return handler._replace(unary_stream=wrap(handler.unary_stream, method),
                                    request_deserializer=deserializer)
        if handler.stream_stream is not None:  # each message checked as it arrives
            behaviour = handler.stream_stream
            return handler._replace(stream_stream=self._wrap_stream(
                lambda requests, context: behaviour(_decoded(requests), context), method),
                request_deserializer=deserializer)
        return handler

    @staticmethod
    def _wrap_unary(behaviour, method):
        async def unary_unary(request, context):
            try:
                if isinstance(request, UndecodableRequest):
                    raise request.error
                return await behaviour(request, context)
            except (grpc.aio.AbortError, asyncio.CancelledError):
                raise
            except Exception as error:  # noqa: BLE001 - this is the last resort
                await _abort_for(error, context, method)
        return unary_unary

    @staticmethod
    def _wrap_stream(behaviour, method):
        async def streaming(request_or_iterator, context):
            try:
                if isinstance(request_or_iterator, UndecodableRequest):
                    raise request_or_iterator.error
                async for response in behaviour(request_or_iterator, context):
                    yield response
            except (grpc.aio.AbortError, asyncio.CancelledError):
                raise
            except Exception as error:  # noqa: BLE001
                await _abort_for(error, context, method)
        return streaming


async def answer_in_order(requests, answer: Callable, tracer_provider: TracerProvider | None, method: str):
    """A round stream's responses: each request answered by `answer` (the unary call's handler), in
    order, within its own server span."""
    async for request in requests:
        with server_message_span(tracer_provider, method, request):
            response = await answer(request)
        yield response


async def _decoded(requests):
    """A bidirectional stream's requests; one that did not decode ends the stream with its error."""
    async for request in requests:
        if isinstance(request, UndecodableRequest):
            raise request.error
        yield request


async def start_server(
    register: Callable[[grpc.aio.Server], None],
    service_names: Iterable[str],
    address: str,
    *,
    max_concurrent_rpcs: int | None = None,
    tls: TLSConfig | None = None,
    api_key: str | None = None,
    tracer_provider: TracerProvider | None = None,
    unauthenticated_message: str = UNAUTHENTICATED_MESSAGE,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    connection_limits: ConnectionLimits | None = None,
    drain: Drain | None = None,
) -> tuple[grpc.aio.Server, int, health_aio.HealthServicer]:
    """Start a grpc.aio server on `address` ("host:port", port 0 = any); return (server, port, health).

    `tls`: serve TLS (mutual TLS when it has a client CA); None = plaintext. `api_key`: the
    services in `service_names` require it (the API key, or the draft's and target's internal
    token), refusing with `unauthenticated_message`; health and reflection stay open. The server's
    `Drain` (`drain`, or one that waits for calls only; `drain_of(server)`) refuses and tracks calls to those services. `max_request_bytes`:
    larger request messages get RESOURCE_EXHAUSTED without being read. `connection_limits`: a public
    port's bounds (specmesh.server.connections); None = grpc's defaults, for the internal services.
    """
    names = list(service_names)
    drain = drain or Drain()
    # The key check outermost: a stranger's call is refused before a span, a handler or the drain's
    # count is spent on it (a flood of them must cost only themselves). Tracing next, so a span
    # covers the errors mapped below; the drain innermost, so ErrorInterceptor turns its ShuttingDown
    # into UNAVAILABLE. (grpc's maximum_concurrent_rpcs counts calls before any interceptor runs:
    # the public server leaves it unset, so strangers cannot use up its slots.)
    auth = [ApiKeyInterceptor(api_key, names, unauthenticated_message)] if api_key else []
    interceptors = [*auth, *server_interceptors(tracer_provider), ErrorInterceptor(), DrainInterceptor(drain, names)]
    # One server to a port: with grpc's default SO_REUSEPORT a second server (another process of the same user)
    # binds a port already in use, or port 0 picks one, and clients are dealt between the two (grpc/grpc#10755).
    options = [("grpc.max_receive_message_length", max_request_bytes), ("grpc.so_reuseport", 0)]
    options += grpc_server_options(connection_limits) if connection_limits else []
    server = grpc.aio.server(interceptors=interceptors, maximum_concurrent_rpcs=max_concurrent_rpcs, options=options)
    register(server)
    register_drain(server, drain)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(names + [reflection.SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name], server)
    port = server.add_secure_port(address, tls.server_credentials()) if tls else server.add_insecure_port(address)
    await server.start()
    for name in names + [""]:
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, port, health


async def stop_server(server: grpc.aio.Server, health: health_aio.HealthServicer, grace_s: float) -> None:
    """Drain: NOT_SERVING, new calls refused, in-flight calls get grace_s and are then cut off; stop."""
    drain = drain_of(server)
    await health.enter_graceful_shutdown()  # every service NOT_SERVING, and it stays so
    drain.begin(grace_s)
    left = await drain.wait()
    if left:
        log.warning("stopping with %d calls or sessions still in flight after the %g s grace", left, grace_s)
    await server.stop(STOP_MARGIN_S)  # what is left: health watches, calls that ignored the cut-off
    log.info("drained and stopped")


async def wait_for_signal() -> int:
    """Block until SIGINT or SIGTERM; return which."""
    received: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda sig=sig: received.done() or received.set_result(sig))
    return await received


async def serve_until_signal(server: grpc.aio.Server, health: health_aio.HealthServicer,
                             grace_s: float = DEFAULT_SHUTDOWN_GRACE_S) -> None:
    """Block until SIGINT/SIGTERM, then drain for up to grace_s and stop."""
    sig = await wait_for_signal()
    log.info("%s: draining for up to %g s", signal.Signals(sig).name, grace_s)
    await stop_server(server, health, grace_s)
