"""specmesh.gathering.WhenQuiet: what tasks woken together add is flushed once, when the loop goes quiet."""

from __future__ import annotations

import asyncio

import pytest

from specmesh.gathering import WhenQuiet

pytestmark = pytest.mark.unit


class Batches:
    def __init__(self):
        self.pending: list[str] = []
        self.flushed: list[list[str]] = []
        self.quiet = WhenQuiet(self.flush)
        self.done = asyncio.Event()

    def flush(self) -> None:
        self.flushed.append(self.pending)
        self.pending = []
        self.done.set()

    def add(self, item: str) -> None:
        self.pending.append(item)
        self.quiet.added()


async def test_what_tasks_released_together_add_goes_in_one_flush():
    batches, release = Batches(), asyncio.Event()

    async def session(name: str, hops: int) -> None:
        await release.wait()
        for _ in range(hops):  # some work between the release and the add, a turn of the loop each
            await asyncio.sleep(0)
        batches.add(name)
    tasks = [asyncio.ensure_future(session(f"s{i}", hops=i % 3)) for i in range(6)]
    await asyncio.sleep(0)
    release.set()
    await asyncio.gather(*tasks)
    await batches.done.wait()
    assert batches.flushed == [["s0", "s3", "s1", "s4", "s2", "s5"]]


async def test_an_item_still_waiting_on_something_else_goes_with_the_next_flush():
    batches, late = Batches(), asyncio.get_running_loop().create_future()

    async def slow() -> None:
        await late
        batches.add("slow")
    task = asyncio.ensure_future(slow())
    batches.add("fast")
    await batches.done.wait()
    assert batches.flushed == [["fast"]]
    batches.done.clear()
    late.set_result(None)
    await task
    await batches.done.wait()
    assert batches.flushed == [["fast"], ["slow"]]


def test_a_check_left_on_an_ended_loop_does_not_hold_the_next_loops_flush():
    ended = asyncio.new_event_loop()
    try:
        batches = ended.run_until_complete(_batches_with_a_check_pending())
    finally:
        ended.close()  # its check never runs
    assert batches.flushed == []

    async def add_again() -> None:
        batches.add("next")
        await asyncio.wait_for(batches.done.wait(), 5)
    asyncio.run(add_again())
    assert batches.flushed == [["first", "next"]]


async def _batches_with_a_check_pending() -> Batches:
    batches = Batches()
    batches.add("first")  # the loop ends before its check runs
    return batches
