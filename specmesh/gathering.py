"""Work handed on together once the event loop goes quiet.

Many tasks woken by one event (a batch's answers, a step's results) each add their piece of the
next piece of work during the same turns of the event loop. `WhenQuiet` runs its flush once a whole
turn has gone by with nothing added: everything that could be added now has been, and what comes
later (a task still waiting on something else) goes with the next flush. No timer, no guess of
how long the others take: the loop's own ready queue says when they are done.
"""

from __future__ import annotations

import asyncio
from typing import Callable


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
