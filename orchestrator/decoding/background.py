"""Clean-up coroutines (closing sessions) that run to completion whatever becomes of their caller."""

from __future__ import annotations

import asyncio

_background: set[asyncio.Task] = set()


def retrieve_outcome(task: asyncio.Task) -> None:
    """Mark an abandoned task's failure as seen; it no longer matters."""
    if not task.cancelled():
        task.exception()


def pending_clean_ups() -> int:
    """Clean-ups still running (a draining orchestrator waits for them: they free the services' sessions)."""
    return len(_background)


def spawn_background(coroutine) -> None:
    """Run a clean-up coroutine to completion independently of the caller's task."""
    task = asyncio.ensure_future(coroutine)
    _background.add(task)
    task.add_done_callback(_background.discard)
