"""A session's rounds on one bidirectional stream (VerifyRounds, ProposeRounds) instead of a unary call each.

A unary call pays for its own HTTP/2 stream, headers and the server's per-call set-up; a message on
an open stream pays for itself only. Each message still has its own deadline and its own client and
server spans (specmesh.server.telemetry.client_message_span, server_message_span). A message that fails,
times out or finds the stream ended raises the AioRpcError its unary call would have raised, and the
stream is dropped: the session's next round opens a new one (on another replica, after a failover).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Callable

import grpc
from google.protobuf.message import Message

from specmesh.server.grpc_server import INTERNAL_DETAILS_PREFIX
from specmesh.server.telemetry import client_message_span

if TYPE_CHECKING:  # annotations only: the tracing SDK loads where tracing is on (start time)
    from opentelemetry.sdk.trace import TracerProvider


class RoundStream:
    def __init__(self, open_call: Callable[[], grpc.aio.StreamStreamCall], method: str,
                 tracer_provider: TracerProvider | None = None):
        self._open_call = open_call
        self.method = method
        self.tracer_provider = tracer_provider
        self._call: grpc.aio.StreamStreamCall | None = None
        self._lock = asyncio.Lock()  # one message in flight: responses are matched to requests by order

    async def send(self, request: Message, timeout: float) -> Message:
        """The response to `request`; raises AioRpcError (DEADLINE_EXCEEDED past `timeout`) and ends the stream."""
        async with self._lock:
            with client_message_span(self.tracer_provider, self.method, request):
                if self._call is None:
                    self._call = self._open_call()
                try:
                    async with asyncio.timeout(timeout):  # in this task: wait_for would start one per message
                        return await _exchange(self._call, request)
                except BaseException as error:  # the stream is out of step with its requests: drop it
                    self.end()
                    raise _as_call_error(error, timeout) from None

    def end(self) -> None:
        """Stop the stream (the server's handler is cancelled between messages); a later send opens another."""
        call, self._call = self._call, None
        if call is not None:
            call.cancel()


def _as_call_error(error: BaseException, timeout: float) -> BaseException:
    """What the unary call would have raised: DEADLINE_EXCEEDED past its timeout; anything else as it is
    (a cancellation included), but a stream broken under the message as UNAVAILABLE."""
    if isinstance(error, asyncio.TimeoutError):
        return deadline_exceeded(timeout)
    if isinstance(error, grpc.aio.AioRpcError):
        return broken_as_unavailable(error)
    return error


def broken_as_unavailable(error: grpc.aio.AioRpcError) -> grpc.aio.AioRpcError:
    """A stream that broke under the message (its replica stopped) can surface as grpc's own INTERNAL; a call
    to a lost replica is UNAVAILABLE, which failover acts on. The servers' own INTERNAL errors stay INTERNAL."""
    if error.code() != grpc.StatusCode.INTERNAL or (error.details() or "").startswith(INTERNAL_DETAILS_PREFIX):
        return error
    return call_error(grpc.StatusCode.UNAVAILABLE, f"the round stream broke: {error.details()}")


def call_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """The error a call ending with `code` raises."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


def deadline_exceeded(timeout: float) -> grpc.aio.AioRpcError:
    return call_error(grpc.StatusCode.DEADLINE_EXCEEDED, f"no response within {timeout:g} s")


async def _exchange(call: grpc.aio.StreamStreamCall, request: Message) -> Message:
    try:
        await call.write(request)
    except asyncio.InvalidStateError:  # the stream has ended: its status says why
        raise await ended_error(call) from None
    response = await call.read()
    if response is grpc.aio.EOF:
        raise await ended_error(call)
    return response


async def ended_error(call: grpc.aio.StreamStreamCall) -> grpc.aio.AioRpcError:
    """The error a unary call would have raised, from the finished stream's status."""
    code = await call.code()
    if code == grpc.StatusCode.OK:  # a server ends a session's stream only by failing it
        code = grpc.StatusCode.UNAVAILABLE
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), await call.trailing_metadata() or grpc.aio.Metadata(),
                                details=await call.details() or "the round stream ended")
