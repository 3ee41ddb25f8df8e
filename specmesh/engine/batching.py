"""Continuous batching: the pending model work of every session runs in one forward per step.

Work arrives as *jobs*: generators that yield a `Feed` (token rows for one session,
fed after its KV cache) and receive `(logits, step_ns)` back, then yield the next
Feed or return their result. A verification is one Feed; a proposal of k draft
tokens is k Feeds, one per step; a prefill is one chunkable Feed that the planner
may split over several steps so that it never stalls the streams already running.

One worker thread runs the loop: take the jobs that arrived, plan a step (every
decode Feed, then prefill chunks within what the step may cost), run it as one
ragged forward (`specmesh.engine.ragged`), hand each job its logits. It steps what
it has been sent and waits for no session's next call: sessions share a step
because the orchestrator sends one message per round for all sessions of a
replica, whose parts `submit_all` queues together. Only new prompts reaching an
idle engine are gathered a moment, so that a burst of them boards one step.

A job's own Python (sampling, verification, rollback) runs on the worker between
steps, so a session is only ever touched by one thread. Jobs of one session run in arrival order, one
at a time: a pre-draft still stepping blocks the Propose that interrupts it until
it notices, exactly as when each job had the worker to itself.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Generator, Sequence

import torch

from specmesh.engine.step_costs import MIN_PREFILL_CHUNK

Logits = tuple[torch.Tensor, int]  # ([keep_rows, V] float32 on the CPU, the step's ns)


@dataclass
class Feed:
    """Rows for one session: `token_ids` at the positions after its cache."""

    session: Any  # specmesh.engine.model_engine.Session
    token_ids: list[int]
    keep_rows: int = 1  # logits of the last keep_rows fed tokens
    chunkable: bool = False  # a prefill: may be fed over several steps; logits come with the last chunk
    parents: tuple[int, ...] = ()  # a tree of rows (specmesh.engine.ragged.tree_ancestry); empty: a chain


Job = Generator[Feed, Logits, Any]


@dataclass(frozen=True)
class Part:
    """What one step feeds for one session: a whole Feed, or one chunk of a prefill."""

    session: Any
    token_ids: list[int]
    keep_rows: int  # 0: a chunk that is not the last, no logits
    prefill: bool = False  # a chunk of a chunkable Feed
    parents: tuple[int, ...] = ()  # the Feed's (never chunked)


@dataclass(eq=False)
class _Work:
    key: str | None  # the session it belongs to; None: runs between steps, in arrival order
    job: Job | None
    call: Callable[[], Any] | None
    future: concurrent.futures.Future
    feed: Feed | None = None
    fed: int = 0  # tokens of `feed` already fed (a chunked prefill)

    @property
    def rows_left(self) -> int:
        return len(self.feed.token_ids) - self.fed if self.feed is not None else 0


class StepPlanner:
    """Which rows go into the next step.

    Decode rows (verifications, draft steps) all go in, oldest first, up to
    max_step_tokens. Prefill chunks fill what is left of `prefill_allowance(decode_rows,
    prefills)`: the rows a step may add to those decode rows and stay cheap
    (specmesh.engine.step_costs), at least `min_prefill_chunk` so a prefill always moves.
    """

    def __init__(self, max_step_tokens: int, prefill_allowance: Callable[[int, int], int],
                 min_prefill_chunk: int = MIN_PREFILL_CHUNK):
        self.max_step_tokens = max_step_tokens
        self.prefill_allowance = prefill_allowance
        self.min_prefill_chunk = min_prefill_chunk

    def plan(self, active: Sequence[_Work]) -> list[tuple[_Work, Part]]:
        """The step's parts."""
        planned, rows = [], 0
        for work in active:
            if work.feed is None or work.feed.chunkable:
                continue
            if planned and rows + work.rows_left > self.max_step_tokens:
                break
            planned.append((work, Part(work.feed.session, work.feed.token_ids, work.feed.keep_rows,
                                       parents=work.feed.parents)))
            rows += work.rows_left
        prefills = sum(1 for work in active if work.feed is not None and work.feed.chunkable)
        if not prefills:
            return planned
        allowance = max(self.min_prefill_chunk, min(self.prefill_allowance(rows, prefills), self.max_step_tokens - rows))
        for work in active:
            if allowance <= 0 or work.feed is None or not work.feed.chunkable:
                continue
            feed, take = work.feed, min(work.rows_left, allowance)
            last = take == work.rows_left
            planned.append((work, Part(feed.session, feed.token_ids[work.fed: work.fed + take],
                                       feed.keep_rows if last else 0, prefill=True)))
            allowance -= take
        return planned


class StepScheduler:
    """The worker thread that batches jobs into steps; `run_step(parts)` does the forward."""

    def __init__(self, run_step: Callable[[list[Part]], tuple[list[torch.Tensor | None], int]],
                 planner: StepPlanner, name: str = "model", burst_quiet_s: float = 0.01,
                 max_burst_gather_s: float = 0.05):
        self.run_step = run_step
        self.planner = planner
        # On an idle engine, prompts arriving within burst_quiet_s of each other board one step
        # (at most max_burst_gather_s of waiting).
        self.burst_quiet_s, self.max_burst_gather_s = burst_quiet_s, max_burst_gather_s
        self._inbox: collections.deque[_Work] = collections.deque()
        self._wakeup = threading.Condition()
        self._active: list[_Work] = []  # jobs with a Feed to run, in arrival order
        self._parked: dict[str, collections.deque[_Work]] = {}  # per session: work behind a running job
        self._busy: set[str] = set()
        self._stopping = False
        self.steps = 0
        self.batched_steps = 0  # steps that fed more than one session
        self.observers: list[Callable[[list[Part], int], None]] = []  # (parts, ns) after each step
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    async def submit(self, key: str | None, job: Job) -> Any:
        """Run a job for the session `key`; its result."""
        future, = self.submit_all([(key, job)])
        return await future

    def submit_all(self, keyed_jobs: Sequence[tuple[str | None, Job]]) -> list[asyncio.Future]:
        """Queue jobs that board the same step (a batch's parts, one per session); a future per job, in order.

        Call it on the event loop's thread. The jobs reach the worker together, so none steps
        before the others are in. Once the worker is stopping, every future carries the RuntimeError.
        """
        works = [_Work(key, job, None, concurrent.futures.Future()) for key, job in keyed_jobs]
        self._enqueue(works)
        return [asyncio.wrap_future(work.future) for work in works]

    async def call(self, fn: Callable[..., Any], *args, key: str | None = None) -> Any:
        """Run fn(*args) on the worker between steps (after the session's earlier jobs)."""
        work = _Work(key, None, lambda: fn(*args), concurrent.futures.Future())
        self._enqueue([work])
        return await asyncio.wrap_future(work.future)

    @property
    def queued_rows(self) -> int:
        return sum(work.rows_left for work in list(self._active))

    @property
    def arrived(self) -> int:
        """Jobs and calls handed in that the worker has not taken up yet (it takes them between steps)."""
        return len(self._inbox)

    def stop(self) -> None:
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()

    def _enqueue(self, works: Sequence[_Work]) -> None:
        """Hand the works to the worker in one go (one lock, one wake-up), or fail them all if it stopped."""
        with self._wakeup:
            if not self._stopping:
                self._inbox.extend(works)
                self._wakeup.notify()
                return
        for work in works:
            work.future.set_exception(RuntimeError("the model worker has stopped"))

    def _loop(self) -> None:
        while self._wait_for_work():
            self._admit_arrived()
            if self._only_new_prompts():
                self._gather_burst()
            if self._active:
                self._step()

    def _wait_for_work(self) -> bool:
        """Sleep until work arrives; False once the worker is stopping."""
        with self._wakeup:
            while not self._inbox and not self._active and not self._stopping:
                self._wakeup.wait()
            return not self._stopping

    def _admit_arrived(self) -> None:
        with self._wakeup:
            arrived = list(self._inbox)
            self._inbox.clear()
        for work in arrived:
            self._admit(work)

    def _only_new_prompts(self) -> bool:
        """Nothing runs but prompts not fed yet: the engine was idle when they came."""
        return bool(self._active) and all(work.feed is not None and work.feed.chunkable and work.fed == 0
                                          for work in self._active)

    def _gather_burst(self) -> None:
        """Let the rest of a burst of prompts board the first step: admit arrivals while they come
        within burst_quiet_s of each other, for at most max_burst_gather_s.

        Requests sent together reach an idle engine a few ms apart (each passes the
        orchestrator and the servicer on its own). Stepping at the first would prefill it
        alone, and the next ones would then go in as chunks beside its decoding, a step
        each, which spreads their first tokens over many steps (figures: docs/design/tuning.md).
        A lone prompt waits burst_quiet_s.
        """
        deadline = time.monotonic() + self.max_burst_gather_s
        while not self._stopping:
            with self._wakeup:
                quiet = min(self.burst_quiet_s, deadline - time.monotonic())
                if quiet > 0 and not self._inbox:
                    self._wakeup.wait(quiet)
                if not self._inbox:
                    return
            self._admit_arrived()

    def _admit(self, work: _Work) -> None:
        if work.key is not None and work.key in self._busy:
            self._parked.setdefault(work.key, collections.deque()).append(work)
            return
        if work.key is not None:
            self._busy.add(work.key)
        self._start(work)

    def _start(self, work: _Work) -> None:
        if work.call is not None:
            try:
                _settle(work.future, work.call())
            except BaseException as error:  # noqa: BLE001 - the caller's to handle
                _settle(work.future, error=error)
            self._finish(work)
            return
        self._active.append(work)
        self._advance(work, None)

    def _advance(self, work: _Work, logits: Logits | None) -> None:
        """Run the job to its next Feed (or its end) with the logits of the last one."""
        try:
            feed = work.job.send(logits) if logits is not None else next(work.job)
            if not isinstance(feed, Feed) or not feed.token_ids:
                raise TypeError(f"a job must yield a Feed with tokens, got {feed!r}")
            work.feed, work.fed = feed, 0
            return
        except StopIteration as done:
            _settle(work.future, done.value)
        except BaseException as error:  # noqa: BLE001 - delivered to the job's caller
            _settle(work.future, error=error)
        self._active.remove(work)
        self._finish(work)

    def _finish(self, work: _Work) -> None:
        """The session's next parked work may start."""
        if work.key is None:
            return
        parked = self._parked.get(work.key)
        if parked:
            self._start(parked.popleft())
            if not parked:
                self._parked.pop(work.key, None)
        else:
            self._busy.discard(work.key)
            self._parked.pop(work.key, None)

    def _step(self) -> None:
        planned = self.planner.plan(self._active)
        try:
            logits, step_ns = self.run_step([part for _, part in planned])
        except BaseException as error:  # noqa: BLE001 - every job of the step gets the error
            for work, _ in planned:
                work.job.close()
                _settle(work.future, error=error)
                self._active.remove(work)
                self._finish(work)
            return
        parts = [part for _, part in planned]
        self.steps += 1
        self.batched_steps += len({id(part.session) for part in parts}) > 1
        for observe in self.observers:
            observe(parts, step_ns)
        for (work, part), rows in zip(planned, logits):
            work.fed += len(part.token_ids)
            if work.rows_left == 0:
                self._advance(work, (rows, step_ns))


def _settle(future: concurrent.futures.Future, result: Any = None, error: BaseException | None = None) -> None:
    """Deliver a job's outcome, unless its caller went away (its awaiting task was cancelled)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass  # cancelled meanwhile, on the event loop's thread
