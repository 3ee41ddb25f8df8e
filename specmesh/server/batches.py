"""Batch streams (VerifyBatches, ProposeBatches): many sessions' rounds, one message a batch.

An orchestrator sends every session's part of a round to a replica in one message. The parts are
checked one by one (a bad part gets its own status, as its unary call would), then handed to the model
worker together (ModelEngine.submit_all), so they board the same step: the service steps what it is
sent and guesses nothing about when the rest of a batch would come. Each part is answered as soon as
it is done, and the parts done together go out in one result message (specmesh.gathering); several
batches may be in flight on one stream.

A batch may also carry streamed parts (StreamedParts: the draft's pre-drafts), each answered by several
messages in order, the last marked: its first job boards the batch's step with the other parts, and the
rest follow as they are done.

The stream is long-lived and shared by every session of its orchestrator, so a drain does not wait for
it, only for its batches in flight (`BatchAnswers.in_flight`, a Drain's waits_for).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable, Sequence

import grpc
from google.protobuf.message import Message
from opentelemetry import propagate, trace

from specmesh.errors import SpecmeshError
from specmesh.gathering import WhenQuiet
from specmesh.server.grpc_server import unexpected_status
from specmesh.server.telemetry import tracer
from specmesh.v1 import common_pb2

if TYPE_CHECKING:  # annotations only: the tracing SDK loads where tracing is on (start time)
    from opentelemetry.sdk.trace import TracerProvider


# A part checked and ready to run (a session and its job, specmesh.engine.batching), or its error.
Prepare = Callable[[Message], Any]
SubmitAll = Callable[[Sequence[Any]], Sequence[asyncio.Future]]
Respond = Callable[[Message, Any], Message]  # (the part's request, its result) -> its response
# A streamed part's request checked -> (its first job, to board the batch's step; follow(the job's future) ->
# the part's answers in order).
PrepareStreamed = Callable[[Message], tuple[Any, Callable[[Awaitable], AsyncIterator[Message]]]]


@dataclass(frozen=True)
class StreamedParts:
    """A batch's parts that several messages answer: requests in the batch's `field`, answers in the result's
    `result_field` as `part_type(index=, <answer_field>= | error=, last=)`."""

    field: str
    result_field: str
    part_type: type[Message]
    answer_field: str
    prepare: PrepareStreamed


def part_status(error: BaseException, method: str) -> common_pb2.PartStatus:
    """The status a part's own call would have ended with: a domain error's code, anything else INTERNAL."""
    if isinstance(error, SpecmeshError):
        return common_pb2.PartStatus(code=error.code.value[0], message=str(error))
    if isinstance(error, asyncio.CancelledError):
        return common_pb2.PartStatus(code=grpc.StatusCode.CANCELLED.value[0], message="cancelled")
    status = unexpected_status(error, f"a part of {method}")
    return common_pb2.PartStatus(code=status.code, message=status.message)


class BatchAnswers:
    """Answers one service's batch streams: `answer(requests)` is a handler's body."""

    def __init__(self, method: str, prepare: Prepare, submit_all: SubmitAll, respond: Respond,
                 result_type: type[Message], part_type: type[Message],
                 tracer_provider: TracerProvider | None = None, streamed: StreamedParts | None = None):
        self.method = method
        self.prepare, self.submit_all, self.respond = prepare, submit_all, respond
        self.result_type, self.part_type = result_type, part_type
        self.streamed = streamed
        self.tracer_provider = tracer_provider
        self.in_flight = 0  # parts submitted and not answered yet, over every stream

    async def answer(self, requests: AsyncIterator[Message]) -> AsyncIterator[Message]:
        stream = _Stream(self)
        reading = asyncio.ensure_future(stream.read(requests))
        try:
            while (result := await stream.results.get()) is not None:
                yield result
            await reading  # a request that did not decode ends the stream with its error
        finally:
            reading.cancel()
            stream.abandon()


class _Stream:
    """One batch stream: its batches in flight and the results ready to go out."""

    def __init__(self, answers: BatchAnswers):
        self.answers = answers
        self.results: asyncio.Queue[Message | None] = asyncio.Queue()  # None: nothing more will come
        self._done: dict[int, list[Message]] = {}  # batch id -> parts answered since the last flush
        self._streamed_done: dict[int, list[Message]] = {}  # batch id -> streamed parts' answers since then
        self._open_parts = 0
        self._reading = True
        self._futures: set[asyncio.Future] = set()
        self._streaming: set[asyncio.Task] = set()  # a task per streamed part still answering
        self._quiet = WhenQuiet(self._flush)

    async def read(self, requests: AsyncIterator[Message]) -> None:
        try:
            async for batch in requests:
                self._start(batch)
        finally:
            self._reading = False
            self._end_if_done()

    def _start(self, batch: Message) -> None:
        ready, failed = self._prepared(batch.parts, self.answers.prepare)
        streamed = self.answers.streamed
        requests = getattr(batch, streamed.field) if streamed is not None else ()
        ready_streamed, failed_streamed = self._prepared(requests, streamed.prepare if streamed else None)
        jobs = [job for _, _, job in ready] + [job for _, _, (job, _) in ready_streamed]
        futures = self.answers.submit_all(jobs) if jobs else []
        count = len(batch.parts) + len(requests)
        self._open_parts += count
        self.answers.in_flight += count
        for index, error in failed:
            self._finish(batch.batch_id, index, error=error)
        for index, error in failed_streamed:
            self._answer_streamed(batch.batch_id, index, error=error, last=True)
        for (index, part, _), future in zip(ready, futures):
            span = self._span(part)
            self._futures.add(future)
            future.add_done_callback(lambda done, i=index, p=part, s=span: self._answered(batch.batch_id, i, p, s, done))
        for (index, request, (_, follow)), first in zip(ready_streamed, futures[len(ready):]):
            task = asyncio.ensure_future(self._stream_part(batch.batch_id, index, request, follow(first)))
            self._streaming.add(task)
            task.add_done_callback(self._streaming.discard)

    @staticmethod
    def _prepared(requests: Sequence[Message], prepare) -> tuple[list, list]:
        """([(index, request, prepared)], [(index, error)]): each request checked on its own."""
        ready, failed = [], []
        for index, request in enumerate(requests):
            try:
                ready.append((index, request, prepare(request)))
            except Exception as error:  # noqa: BLE001 - the part's own status
                failed.append((index, error))
        return ready, failed

    async def _stream_part(self, batch_id: int, index: int, request: Message, answers: AsyncIterator[Message]) -> None:
        """Send a streamed part's answers as they come, then its last (with its error, where it failed)."""
        span = self._span(request)
        error: BaseException | None = None
        with trace.use_span(span, end_on_exit=True) if span is not None else contextlib.nullcontext():
            try:
                async for answer in answers:
                    self._answer_streamed(batch_id, index, answer=answer)
            except (Exception, asyncio.CancelledError) as failed:  # noqa: BLE001 - the part's own status
                error = failed
        self._answer_streamed(batch_id, index, error=error, last=True)  # counted out of in_flight even when cancelled
        if isinstance(error, asyncio.CancelledError):
            raise error

    def _span(self, part: Message) -> trace.Span | None:
        provider = self.answers.tracer_provider
        if provider is None:  # tracing off: no span, the carried context is not even parsed
            return None
        context = propagate.extract(dict(part.trace_context))
        return tracer(provider).start_span(self.answers.method, context=context, kind=trace.SpanKind.SERVER)

    def _answered(self, batch_id: int, index: int, part: Message, span: trace.Span | None,
                  future: asyncio.Future) -> None:
        self._futures.discard(future)
        failed = asyncio.CancelledError() if future.cancelled() else future.exception()
        if failed is not None:
            if span is not None:
                span.end()
            self._finish(batch_id, index, error=failed)
            return
        # in the part's span, so that the response's annotations (forward ns, accepted) land on it
        with trace.use_span(span, end_on_exit=True) if span is not None else contextlib.nullcontext():
            try:
                response = self.answers.respond(part, future.result())
            except Exception as error:  # noqa: BLE001 - the part's own status
                self._finish(batch_id, index, error=error)
                return
        self._finish(batch_id, index, response=response)

    def _finish(self, batch_id: int, index: int, response: Message | None = None,
                error: BaseException | None = None) -> None:
        part = self._part(self.answers.part_type, "response", index, response, error)
        self._done.setdefault(batch_id, []).append(part)
        self._counted_out()

    def _part(self, part_type: type[Message], answer_field: str, index: int, answer: Message | None,
              error: BaseException | None, **fields) -> Message:
        """A part's answer message: its error's status where it failed, else its answer (where it has one)."""
        part = part_type(index=index, **fields)
        if error is not None:
            part.error.CopyFrom(part_status(error, self.answers.method))
        elif answer is not None:
            getattr(part, answer_field).CopyFrom(answer)
        return part

    def _counted_out(self) -> None:
        """A part is answered for good: no longer open on this stream nor in flight on the service."""
        self._open_parts -= 1
        self.answers.in_flight -= 1
        self._quiet.added()

    def _answer_streamed(self, batch_id: int, index: int, answer: Message | None = None,
                         error: BaseException | None = None, last: bool = False) -> None:
        streamed = self.answers.streamed
        part = self._part(streamed.part_type, streamed.answer_field, index, answer, error, last=last)
        self._streamed_done.setdefault(batch_id, []).append(part)
        if last:
            self._counted_out()
        else:
            self._quiet.added()

    def _flush(self) -> None:
        done, self._done = self._done, {}
        streamed, self._streamed_done = self._streamed_done, {}
        for batch_id in {**done, **streamed}:
            result = self.answers.result_type(batch_id=batch_id, parts=done.get(batch_id, ()))
            if batch_id in streamed:
                getattr(result, self.answers.streamed.result_field).extend(streamed[batch_id])
            self.results.put_nowait(result)
        self._end_if_done()

    def _end_if_done(self) -> None:
        if not self._reading and self._open_parts == 0 and not self._done and not self._streamed_done:
            self.results.put_nowait(None)

    def abandon(self) -> None:
        """The stream ended early (cancelled, failed): its parts' answers have nowhere to go."""
        for future in list(self._futures):
            future.cancel()  # the job itself runs on (a session's state moves only on the worker)
        self._futures.clear()
        for task in list(self._streaming):
            task.cancel()  # a streamed part stops at its next step (DraftEngine.predraft_branches)
