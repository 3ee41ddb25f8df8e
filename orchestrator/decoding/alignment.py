"""Drafting rounds of the requests decoding together start together, at one k.

With draft and target on the same cores (the sequential loop), requests whose rounds
drift out of phase run one request's draft steps beside another's verification: two
processes on the same cores, each step slower, and each service batching only part of
the requests. In phase, the draft steps all requests' drafts at once and the target
verifies them all in one step, one after the other. On the embedded pair (2026-11-25,
Intel Xeon, 2 cores) the target verified 8 rows in 389 ms against 314 for one, and the
draft stepped 2 rows in 60 ms against 56: two requests drafting 3 tokens each in phase
take 569 ms a round where apart they took 2 x (180 + 321) of mostly contended time.

So a request about to draft waits here for the others that drafted with it last time
(the members), at most `max_wait_s`, and all go at the smallest k any of them chose:
drafts of one length come back together and reach the target as one batch. A member
that stops drafting (target-only regime, k = 0, finished) leaves, and the rest go on
without it; one that does not come in time is dropped from the members until it
aligns again. k is settled before any draft token is sampled, so the output is unchanged.
"""

from __future__ import annotations

import asyncio
from typing import Hashable


class RoundAlignment:
    def __init__(self):
        self.members: set[Hashable] = set()  # requests that drafted together last time
        self._waiting: dict[Hashable, tuple[asyncio.Future, int]] = {}  # at the gate: (release, k chosen)

    async def align(self, key: Hashable, k: int, max_wait_s: float) -> int:
        """Wait for the other members' drafting rounds (at most max_wait_s); the group's k."""
        release = asyncio.get_running_loop().create_future()
        self.members.add(key)
        self._waiting[key] = (release, k)
        self._release_if_complete()
        try:
            return await asyncio.wait_for(asyncio.shield(release), max(0.0, max_wait_s))
        except asyncio.TimeoutError:
            self.members = set(self._waiting)  # the late ones align again when they next draft
            self._release()
            return release.result()
        finally:
            if not release.done():  # cancelled: the request is gone
                self._waiting.pop(key, None)
                self.leave(key)

    def leave(self, key: Hashable) -> None:
        """The request stopped drafting (or finished): nobody waits for it."""
        self.members.discard(key)
        if key not in self._waiting:
            self._release_if_complete()

    def _release_if_complete(self) -> None:
        if self._waiting and self.members <= set(self._waiting):
            self._release()

    def _release(self) -> None:
        if not self._waiting:
            return
        k = min(chosen for _, chosen in self._waiting.values())
        for release, _ in self._waiting.values():
            if not release.done():
                release.set_result(k)
        self._waiting.clear()
