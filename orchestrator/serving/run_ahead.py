"""A request's rounds run on while its client's stream sends what they committed.

With batch-level rounds (orchestrator.serving.round_batches) a session's next round should be asked for
in the same turn of the event loop as the others released with it. Were the loop to wait while the
front end writes its last tokens to the client (a write waits on the transport), it would miss its
batch and go a step behind the rest. So the rounds run in a task of their own and hand their batches
of tokens to the stream through a queue.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, TypeVar

T = TypeVar("T")
_END = object()


async def run_ahead(items: AsyncIterator[T]) -> AsyncIterator[T]:
    """`items`, iterated in a task of its own; closing this iterator cancels that task (the source's
    finally blocks run there), and the source's error comes out here."""
    queue: asyncio.Queue = asyncio.Queue()

    async def produce() -> None:
        try:
            async for item in items:
                queue.put_nowait(item)
        except Exception as error:  # noqa: BLE001 - raised to the consumer
            queue.put_nowait(_Failed(error))
        finally:
            queue.put_nowait(_END)

    producer = asyncio.ensure_future(produce())
    try:
        while (item := await queue.get()) is not _END:
            if isinstance(item, _Failed):
                raise item.error
            yield item
    finally:
        producer.cancel()
        await asyncio.wait([producer])


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error
