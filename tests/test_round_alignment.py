"""orchestrator.decoding.alignment: drafting rounds of requests decoding together start together, at one k."""

from __future__ import annotations

import asyncio

import pytest

from orchestrator.decoding.alignment import RoundAlignment

BOUND = 5.0  # a safety bound on waits that must end long before it


async def until_waiting(gate: RoundAlignment, *keys: str) -> None:
    """Let the event loop run until the gate holds every one of `keys`."""
    while not all(key in gate._waiting for key in keys):
        await asyncio.sleep(0)


async def test_a_request_alone_drafts_at_once_at_its_own_k():
    gate = RoundAlignment()
    assert await asyncio.wait_for(gate.align("a", 3, BOUND), BOUND / 2) == 3


async def test_a_member_waits_for_the_others_and_all_draft_the_smallest_k():
    gate = RoundAlignment()
    assert await gate.align("a", 3, BOUND) == 3  # a drafts alone: the only member so far
    b = asyncio.ensure_future(gate.align("b", 2, BOUND))
    await until_waiting(gate, "b")
    assert not b.done()  # a drafted last time, so b waits for a's next round
    assert await asyncio.wait_for(gate.align("a", 5, BOUND), BOUND / 2) == 2
    assert await b == 2 and gate.members == {"a", "b"}


async def test_a_member_that_stops_drafting_releases_the_others():
    gate = RoundAlignment()
    await gate.align("a", 3, BOUND)
    b = asyncio.ensure_future(gate.align("b", 4, BOUND))
    await until_waiting(gate, "b")
    gate.leave("a")  # a's next round is target-only, or a finished
    assert await asyncio.wait_for(b, BOUND / 2) == 4
    assert gate.members == {"b"}


async def test_a_member_that_does_not_come_in_time_is_dropped_until_it_aligns_again():
    gate = RoundAlignment()
    await gate.align("a", 3, BOUND)
    assert await gate.align("b", 2, 0.05) == 2  # a never came: b went alone after its wait
    assert gate.members == {"b"}
    assert await asyncio.wait_for(gate.align("b", 2, BOUND), BOUND / 2) == 2  # nobody to wait for now


async def test_a_cancelled_wait_leaves_nobody_waiting_for_it():
    gate = RoundAlignment()
    await gate.align("a", 3, BOUND)
    b = asyncio.ensure_future(gate.align("b", 2, BOUND))
    await until_waiting(gate, "b")
    b.cancel()
    with pytest.raises(asyncio.CancelledError):
        await b
    assert "b" not in gate.members and not gate._waiting
    assert await asyncio.wait_for(gate.align("a", 3, BOUND), BOUND / 2) == 3
