"""Ids of sessions closed before they were open, so that their late open is refused.

An orchestrator whose request ends while the session's OpenSession is still on its way (cancelled by
its client, or ended before the draft's background prefill) sends CloseSession at once. The service
runs each call as its own task: the close can run while the open still waits for KV room, or before
the open's handler even starts, and find nothing to close; the open then registered a session that
nobody would close until the idle reaper, minutes later, and held a draining service open meanwhile.
So a close that finds no session leaves the id here, and an open for it is refused (SessionClosed).
Session ids are unique per request (the orchestrator adds a random suffix), so no later open of
the same id is meant to succeed; the record is bounded in count and age all the same.
"""

from __future__ import annotations

import time
from collections import OrderedDict

MAX_CLOSED = 4096  # ids remembered; far more than the opens in flight at any time
CLOSED_TTL_S = 600.0  # longer than any open waits (for KV room, behind other prefills) within its deadline


class ClosedSessions:
    def __init__(self, max_ids: int = MAX_CLOSED, ttl_s: float = CLOSED_TTL_S):
        self.max_ids, self.ttl_s = max_ids, ttl_s
        self._closed: OrderedDict[str, float] = OrderedDict()  # id -> when closed, oldest first

    def add(self, request_id: str) -> None:
        now = time.monotonic()
        self._closed[request_id] = now
        self._closed.move_to_end(request_id)
        while self._closed and (len(self._closed) > self.max_ids or self._oldest() < now - self.ttl_s):
            self._closed.popitem(last=False)

    def _oldest(self) -> float:
        return next(iter(self._closed.values()))

    def __contains__(self, request_id: str) -> bool:
        closed_at = self._closed.get(request_id)
        return closed_at is not None and closed_at >= time.monotonic() - self.ttl_s

    def __len__(self) -> int:
        return len(self._closed)
