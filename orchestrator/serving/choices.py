"""n independent completions of one request: their response streams, interleaved."""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator, TypeVar

T = TypeVar("T")
_FINISHED = object()


async def interleave(streams: list[AsyncIterator[T]]) -> AsyncIterator[T]:
    """Items of all streams in arrival order; the first failure ends all of them.

    Closing the result (or a failure) cancels every stream still running, and each
    is closed, so their generations free their sessions.
    """
    arrived: asyncio.Queue = asyncio.Queue()
    pumps = [asyncio.ensure_future(_pump(stream, arrived)) for stream in streams]
    try:
        running = len(pumps)
        while running:
            item = await arrived.get()
            if item is _FINISHED:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for pump in pumps:
            pump.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)


async def _pump(stream: AsyncIterator[T], arrived: asyncio.Queue) -> None:
    try:
        async with contextlib.aclosing(stream):
            async for item in stream:
                arrived.put_nowait(item)
    except Exception as error:  # handed to the consumer, which raises it
        arrived.put_nowait(error)
        return
    arrived.put_nowait(_FINISHED)
