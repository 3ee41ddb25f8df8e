"""Every session's rounds to one replica, one message a batch (VerifyBatches, ProposeBatches).

Each session's loop asks for its round as it would with a unary call (`RoundBatches.send`); the parts
asked for while the orchestrator's event loop works through one wake-up (a target's answers release
many sessions at once; each commits and plans its next round) go out together once it goes quiet
(specmesh.gathering), as one message on one stream per replica. The replica submits them to its model
at once, so they share its steps; each part comes back as soon as it is done.

A batch may also carry the draft's pre-drafts (`RoundBatches.stream`: ProposeBatch.predrafts), each a
stream of branches as its PreDraft call would give them, without a call of its own to open and cancel each
round: the loop iterates it and cancels it to stop listening (the draft stops drafting branches when the
session's next call reaches it).

A part keeps the unary call's contract: its own deadline (DEADLINE_EXCEEDED), its own status when
it fails (the replica's error for that part only), a client span per part. A stream that fails or
ends fails every part in flight on it, UNAVAILABLE where it broke (the replica stopped), so each
session fails over on its own; the next batch opens a new stream. A part whose caller was cancelled
before its batch went out is not sent; one cancelled after has its answer dropped.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import TYPE_CHECKING, Callable

import grpc
from google.protobuf.message import Message
from opentelemetry import trace

from orchestrator.serving.round_streams import broken_as_unavailable, call_error, deadline_exceeded, ended_error
from specmesh.gathering import Gathered
from specmesh.server.telemetry import client_message_span, start_client_part_span

if TYPE_CHECKING:  # annotations only: the tracing SDK loads where tracing is on (start time)
    from opentelemetry.sdk.trace import TracerProvider

_CODES = {code.value[0]: code for code in grpc.StatusCode}


def _part_error(status) -> grpc.aio.AioRpcError:
    """What a part's own call would have raised, from the PartStatus its replica answered."""
    return call_error(_CODES.get(status.code, grpc.StatusCode.UNKNOWN), status.message)


class RoundBatches:
    def __init__(self, open_call: Callable[[], grpc.aio.StreamStreamCall], batch_type: type[Message], method: str,
                 tracer_provider: TracerProvider | None = None, streamed_fields: tuple[str, str] | None = None):
        """streamed_fields: the batch's field for streamed parts and the result's field for their answers
        (the draft's ("predrafts", "branches")); None where the batch carries none."""
        self._open_call = open_call
        self.streamed_fields = streamed_fields
        self.batch_type = batch_type
        self.method = method
        self.tracer_provider = tracer_provider
        self._parts: Gathered[Message] = Gathered(self._send_batch)  # parts for the next batch
        self._stream: _BatchStream | None = None
        self._batch_ids = itertools.count(1)
        self.batches_sent = 0

    async def send(self, request: Message, timeout: float) -> Message:
        """The part's response, as its unary call would give it; raises AioRpcError as that call would."""
        with client_message_span(self.tracer_provider, self.method, request):
            future = self._parts.ask(request)
            try:
                async with asyncio.timeout(timeout):
                    return await future
            except TimeoutError:
                raise deadline_exceeded(timeout) from None

    def stream(self, request: Message, timeout: float) -> BatchedBranches:
        """A streamed part (a pre-draft) for the next batch: iterate it for its answers, cancel it to stop
        listening; it ends with the AioRpcError its call would have raised (DEADLINE_EXCEEDED past `timeout`)."""
        span = start_client_part_span(self.tracer_provider, self.method, request)
        branches = BatchedBranches(request, timeout, span)
        branches.sent = self._parts.ask(branches)
        return branches

    @property
    def parts_waiting(self) -> int:
        """Parts sent whose callers still wait for them (not those that gave up: deadline, cancellation)."""
        return self._stream.parts_waiting if self._stream is not None else 0

    def _send_batch(self, asked: list, futures: list[asyncio.Future]) -> None:
        parts = [(item, future) for item, future in zip(asked, futures) if not isinstance(item, BatchedBranches)]
        streamed = [item for item in asked if isinstance(item, BatchedBranches)]
        try:
            if self._stream is None or self._stream.ended:
                self._stream = _BatchStream(self._open_call(), self.streamed_fields)
        except Exception as error:  # noqa: BLE001 - a channel closed under us: each part fails as its call would
            failure = call_error(grpc.StatusCode.UNAVAILABLE, f"no batch stream: {error}")
            for future in futures:
                future.set_exception(failure)
            for branches in streamed:
                branches.end(failure)
            return
        batch = self.batch_type(batch_id=next(self._batch_ids), parts=[request for request, _ in parts])
        if streamed:  # only a batch type with streamed_fields is asked for streamed parts (stream())
            getattr(batch, self.streamed_fields[0]).extend(branches.request for branches in streamed)
        for branches in streamed:
            branches.sent.set_result(None)
        self._stream.send(batch, [future for _, future in parts], streamed)
        self.batches_sent += 1


class BatchedBranches:
    """A streamed part's answers (a pre-draft's branches) as they arrive: an async iterator that a
    PreDraft call's stream would be (orchestrator.decoding.endpoints.BranchStream)."""

    def __init__(self, request: Message, timeout: float, span: trace.Span | None = None):
        self.request = request
        self.span = span  # the client span, ended with the answers
        self.sent: asyncio.Future | None = None  # done once its batch went out
        self._answers: asyncio.Queue = asyncio.Queue()  # answers, then an error or None (the end)
        self._deadline = asyncio.get_running_loop().time() + timeout
        self._timeout = timeout
        self.ended = False

    def __aiter__(self) -> BatchedBranches:
        return self

    async def __anext__(self) -> Message:
        try:
            async with asyncio.timeout_at(self._deadline):
                answer = await self._answers.get()
        except TimeoutError:
            self.end(deadline_exceeded(self._timeout))
            answer = self._answers.get_nowait()
        if answer is None:
            raise StopAsyncIteration
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def add(self, answer: Message) -> None:
        if not self.ended:
            self._answers.put_nowait(answer)

    def end(self, error: BaseException | None = None) -> None:
        """No more answers: the iteration stops (raising `error` where one is given)."""
        if not self.ended:
            self.ended = True
            self._answers.put_nowait(error)
            if self.span is not None:
                self.span.end()

    def cancel(self) -> bool:
        """Stop listening: not sent at all if its batch has not gone out; later answers are dropped."""
        if self.ended:
            return False
        if self.sent is not None:
            self.sent.cancel()
        self.end()
        return True


class _BatchStream:
    """One open VerifyBatches/ProposeBatches call: a writer and a reader task, the batches in flight."""

    def __init__(self, call: grpc.aio.StreamStreamCall, streamed_fields: tuple[str, str] | None = None):
        self.call = call
        self._streamed_answers = streamed_fields[1] if streamed_fields else ""
        self.ended = False
        self._waiting: dict[int, list[asyncio.Future | None]] = {}  # batch id -> its parts' futures
        self._streaming: dict[int, list[BatchedBranches | None]] = {}  # batch id -> its streamed parts
        self._outbox: asyncio.Queue[Message] = asyncio.Queue()
        self._writer = asyncio.ensure_future(self._write())
        self._reader = asyncio.ensure_future(self._read())

    @property
    def parts_waiting(self) -> int:
        return sum(future is not None and not future.done() for futures in self._waiting.values() for future in futures)

    def send(self, batch: Message, futures: list[asyncio.Future], streamed: list[BatchedBranches] = ()) -> None:
        if futures:
            self._waiting[batch.batch_id] = list(futures)
        if streamed:
            self._streaming[batch.batch_id] = list(streamed)
        self._outbox.put_nowait(batch)

    async def _write(self) -> None:
        try:
            while True:
                await self.call.write(await self._outbox.get())
        except (asyncio.InvalidStateError, grpc.aio.AioRpcError):  # the stream ended: the reader says why
            pass
        except Exception:  # noqa: BLE001 - a stream that cannot be written is ended; the reader fails its parts
            self.call.cancel()

    async def _read(self) -> None:
        try:
            async for result in self.call:
                self._deliver(result)
            error = await ended_error(self.call)
        except grpc.aio.AioRpcError as failed:
            error = broken_as_unavailable(failed)
        except asyncio.CancelledError:
            error = call_error(grpc.StatusCode.UNAVAILABLE, "the batch stream was stopped")
        self._end(error)

    def _deliver(self, result: Message) -> None:
        if result.batch_id in self._streaming:
            self._deliver_streamed(result.batch_id, getattr(result, self._streamed_answers))
        futures = self._waiting.get(result.batch_id)
        if futures is None:
            return
        for part in result.parts:
            future = futures[part.index] if part.index < len(futures) else None
            if future is None:
                continue
            futures[part.index] = None
            if future.done():  # its caller gave up (deadline, cancellation)
                continue
            if part.HasField("error"):
                future.set_exception(_part_error(part.error))
            else:
                future.set_result(part.response)
        if all(future is None for future in futures):
            del self._waiting[result.batch_id]

    def _deliver_streamed(self, batch_id: int, answered) -> None:
        streamed = self._streaming[batch_id]
        for part in answered:
            branches = streamed[part.index] if part.index < len(streamed) else None
            if branches is None:
                continue
            if part.HasField("error"):
                branches.end(_part_error(part.error))
            elif part.WhichOneof("result") is not None:
                branches.add(getattr(part, part.WhichOneof("result")))
            if part.last:
                branches.end()
                streamed[part.index] = None
        if all(branches is None for branches in streamed):
            del self._streaming[batch_id]

    def _end(self, error: grpc.aio.AioRpcError) -> None:
        """Every part still in flight fails with the stream's error; the next batch opens a new stream."""
        self.ended = True
        self._writer.cancel()
        for futures in self._waiting.values():
            for future in futures:
                if future is not None and not future.done():
                    future.set_exception(error)
        self._waiting.clear()
        for streamed in self._streaming.values():
            for branches in streamed:
                if branches is not None:
                    branches.end(error)
        self._streaming.clear()
