"""Work handed on together once the event loop goes quiet.

Many tasks woken by one event (a batch's answers, a step's results) each add their piece of the
next piece of work during the same turns of the event loop. `WhenQuiet` runs its flush once a whole
turn has gone by with nothing added: everything that could be added now has been, and what comes
later (a task still waiting on something else) goes with the next flush. No timer, no guess of
how long the others take: the loop's own ready queue says when they are done.
"""

from __future__ import annotations

import asyncio
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class WhenQuiet:
    def __init__(self, flush: Callable[[], None]):
        self._flush = flush
        self._scheduled_on: asyncio.AbstractEventLoop | None = None  # the loop a check waits on, if any
        self._added = False  # since the last check

    def added(self) -> None:
        """Something was added for the next flush (call from the event loop's thread)."""
        self._added = True
        loop = asyncio.get_running_loop()
        if self._scheduled_on is not loop:  # none waiting, or one on a loop that has ended (it never runs)
            self._scheduled_on = loop
            loop.call_soon(self._check)

    def _check(self) -> None:
        if self._added:  # the turn that ran before this check added more: give it another
            self._added = False
            asyncio.get_running_loop().call_soon(self._check)
            return
        self._scheduled_on = None
        self._flush()


class Gathered(Generic[T]):
    """Calls answered together: `ask(item)` gives a future, and once the loop goes quiet `answer(items, futures)`
    gets every item still awaited (not those whose caller gave up, nor any left on an event loop that ended)."""

    def __init__(self, answer: Callable[[list[T], list[asyncio.Future]], None]):
        self._answer = answer
        self._asked: list[tuple[T, asyncio.Future]] = []
        self._quiet = WhenQuiet(self._flush)

    def ask(self, item: T) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        self._asked.append((item, future))
        self._quiet.added()
        return future

    def _flush(self) -> None:
        loop = asyncio.get_running_loop()
        asked = [(item, future) for item, future in self._asked if not future.done() and future.get_loop() is loop]
        self._asked = []
        if asked:
            self._answer([item for item, _ in asked], [future for _, future in asked])
