"""The step scheduler and planner on their own: ordering, errors, chunking; and the step-cost table."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest
import torch

from specmesh.engine.batching import Feed, Part, StepPlanner, StepScheduler
from specmesh.engine.step_costs import ChunkSteering, StepCosts

pytestmark = pytest.mark.unit


class Steps:
    """A run_step that records each step's parts and answers row i of a part with its token ids."""

    def __init__(self, fail_on: int | None = None):
        self.log: list[list[tuple[str, tuple[int, ...]]]] = []
        self.fail_on = fail_on

    def __call__(self, parts: list[Part]):
        self.log.append([(part.session.name, tuple(part.token_ids)) for part in parts])
        if self.fail_on is not None and any(self.fail_on in part.token_ids for part in parts):
            raise RuntimeError("the forward failed")
        return [torch.tensor(part.token_ids[-part.keep_rows:]) if part.keep_rows else None for part in parts], 1


def session(name: str):
    return SimpleNamespace(name=name)


def decode(s, rounds: int, first: int = 0):
    """A job of `rounds` one-row feeds; returns what each step answered."""
    answers = []
    for i in range(rounds):
        logits, _ = yield Feed(s, [first + i])
        answers.append(int(logits[0]))
    return answers


def scheduler(steps: Steps, chunk: int = 4, max_step: int = 64) -> StepScheduler:
    return StepScheduler(steps, StepPlanner(max_step, lambda decode_rows, prefills: chunk, min_prefill_chunk=1))


async def test_jobs_of_different_sessions_share_steps_and_get_their_own_rows():
    steps = Steps()
    worker = scheduler(steps)
    a, b = session("a"), session("b")
    got = await asyncio.gather(worker.submit("a", decode(a, 3, 10)), worker.submit("b", decode(b, 3, 20)))
    assert got == [[10, 11, 12], [20, 21, 22]]
    assert any(len(step) == 2 for step in steps.log) and worker.batched_steps > 0
    worker.stop()


async def test_jobs_of_one_session_run_one_after_the_other():
    steps = Steps()
    worker = scheduler(steps)
    a = session("a")
    first, second = await asyncio.gather(worker.submit("a", decode(a, 2, 0)), worker.submit("a", decode(a, 2, 5)))
    assert (first, second) == ([0, 1], [5, 6])
    assert [step for step in steps.log] == [[("a", (0,))], [("a", (1,))], [("a", (5,))], [("a", (6,))]]
    worker.stop()


async def test_a_failing_job_or_step_fails_only_its_callers_and_the_worker_goes_on():
    steps = Steps(fail_on=99)
    worker = scheduler(steps)

    def bad_job():
        yield Feed(session("bad"), [1])
        raise ValueError("bad input")
    with pytest.raises(ValueError, match="bad input"):
        await worker.submit("bad", bad_job())
    with pytest.raises(RuntimeError, match="forward failed"):
        await worker.submit("boom", decode(session("boom"), 1, 99))
    assert await worker.submit("ok", decode(session("ok"), 2, 1)) == [1, 2]
    worker.stop()


async def test_a_caller_that_goes_away_leaves_the_worker_serving():
    started, gate = threading.Event(), threading.Event()
    worker = scheduler(Steps())
    held = asyncio.ensure_future(worker.call(lambda: (started.set(), gate.wait(10))))
    assert await asyncio.to_thread(started.wait, 10)  # the worker is held between steps
    waiting = asyncio.ensure_future(worker.submit("a", decode(session("a"), 2)))
    waiting.cancel()  # its caller goes away while the job waits in the inbox
    gate.set()
    await held
    assert await worker.submit("b", decode(session("b"), 1, 7)) == [7]
    assert waiting.cancelled()
    worker.stop()


async def test_a_prefill_is_chunked_beside_decode_rows_and_its_logits_come_with_the_last_chunk():
    steps = Steps()
    worker = scheduler(steps, chunk=4)
    prompt = list(range(100, 111))  # 11 rows: chunks of 4, 4, 3

    def prefill(s):
        logits, _ = yield Feed(s, prompt, keep_rows=1, chunkable=True)
        return int(logits[0])
    decoded, first = await asyncio.gather(worker.submit("d", decode(session("d"), 3)),
                                          worker.submit("p", prefill(session("p"))))
    assert first == 110 and decoded == [0, 1, 2]
    chunks = [rows for step in steps.log for name, rows in step if name == "p"]
    assert [len(c) for c in chunks] == [4, 4, 3] and sum(chunks, ()) == tuple(prompt)
    worker.stop()


def prefill_job(s, prompt):
    logits, _ = yield Feed(s, prompt, keep_rows=1, chunkable=True)
    return int(logits[0])


async def steps_of(worker: StepScheduler, jobs: dict) -> list:
    """Run jobs {key: job} from one start (the worker held until all are queued); their results."""
    gate, holding = threading.Event(), threading.Event()
    held = asyncio.ensure_future(worker.call(lambda: holding.set() or gate.wait(10)))
    # The worker must be inside the held call before the jobs queue: otherwise it may take the
    # first jobs in with the call and the rest a step later.
    assert await asyncio.to_thread(holding.wait, 10)
    running = [asyncio.ensure_future(worker.submit(key, job)) for key, job in jobs.items()]
    await asyncio.sleep(0)  # one pass of the event loop: every submit has queued its job
    gate.set()
    await held
    return await asyncio.gather(*running)


def chunk_steps(steps: Steps, prefill_key: str = "p") -> list[bool]:
    return [any(name == prefill_key for name, _ in step) for step in steps.log]


async def test_a_chunk_rides_every_step_beside_the_streams():
    """The worker steps what it has: a chunk goes in within the planner's allowance, never held back for a stream."""
    steps = Steps()
    worker = scheduler(steps, chunk=4)
    prompt = list(range(100, 112))
    await steps_of(worker, {"a": decode(session("a"), 4), "b": decode(session("b"), 4),
                            "p": prefill_job(session("p"), prompt)})
    assert chunk_steps(steps)[:3] == [True, True, True]
    assert all(len(step) == 3 for step in steps.log[:3])  # both streams in every step that carried a chunk
    worker.stop()


async def test_prompts_that_reach_an_idle_engine_a_few_ms_apart_share_its_first_step():
    """Requests sent together reach the engine one by one; stepping at the first would prefill it alone
    and feed the rest as chunks beside its decoding."""
    steps = Steps()
    worker = StepScheduler(steps, StepPlanner(64, lambda rows, prefills: 64, min_prefill_chunk=1),
                           burst_quiet_s=0.2, max_burst_gather_s=5.0)
    running = []
    for i in range(4):
        running.append(asyncio.ensure_future(worker.submit(f"p{i}", prefill_job(session(f"p{i}"), [10 * i, 10 * i + 1]))))
        await asyncio.sleep(0.002)  # arrivals a few ms apart, as through the orchestrator and the servicer
    assert await asyncio.gather(*running) == [1, 11, 21, 31]
    assert sorted(name for name, _ in steps.log[0]) == ["p0", "p1", "p2", "p3"] and len(steps.log) == 1
    worker.stop()


WORK_TIMEOUT_S = 10  # a guard against a worker that hangs, never a wait the test relies on


async def test_a_batch_given_to_submit_all_boards_one_step_on_an_idle_worker():
    """A batch's parts reach the worker together: the first part never steps before the others are in."""
    steps = Steps()
    worker = scheduler(steps)
    names = [f"s{i}" for i in range(8)]
    futures = worker.submit_all([(name, decode(session(name), 1, 10 * i)) for i, name in enumerate(names)])
    assert await asyncio.wait_for(asyncio.gather(*futures), WORK_TIMEOUT_S) == [[10 * i] for i in range(8)]
    assert sorted(name for name, _ in steps.log[0]) == names and len(steps.log) == 1
    worker.stop()


async def test_a_lone_job_steps_without_waiting_for_sessions_that_were_active_before():
    """a and b decoded together; then only a sends work. It steps alone at once: b's next job is only sent
    after a's result, so a worker that waited for b would never answer a."""
    steps = Steps()
    worker = scheduler(steps)
    await asyncio.gather(*worker.submit_all([("a", decode(session("a"), 2, 0)), ("b", decode(session("b"), 2, 10))]))
    assert [sorted(name for name, _ in step) for step in steps.log] == [["a", "b"], ["a", "b"]]
    assert await asyncio.wait_for(worker.submit("a", decode(session("a"), 1, 5)), WORK_TIMEOUT_S) == [5]
    assert await asyncio.wait_for(worker.submit("b", decode(session("b"), 1, 15)), WORK_TIMEOUT_S) == [15]
    assert steps.log[2:] == [[("a", (5,))], [("b", (15,))]]
    worker.stop()


async def test_a_failing_job_in_a_batch_fails_only_its_own_future():
    steps = Steps()
    worker = scheduler(steps)

    def bad_job():
        yield Feed(session("bad"), [1])
        raise ValueError("bad input")
    futures = worker.submit_all([("a", decode(session("a"), 2, 10)), ("bad", bad_job()),
                                 ("b", decode(session("b"), 2, 20))])
    a, bad, b = await asyncio.wait_for(asyncio.gather(*futures, return_exceptions=True), WORK_TIMEOUT_S)
    assert (a, b) == ([10, 11], [20, 21])
    assert isinstance(bad, ValueError) and str(bad) == "bad input"
    assert sorted(name for name, _ in steps.log[0]) == ["a", "b", "bad"]  # it failed after sharing their step
    worker.stop()


async def test_a_batch_sent_to_a_stopped_worker_fails_every_part():
    worker = scheduler(Steps())
    worker.stop()
    futures = worker.submit_all([("a", decode(session("a"), 1)), ("b", decode(session("b"), 1))])
    outcomes = await asyncio.gather(*futures, return_exceptions=True)
    assert [str(outcome) for outcome in outcomes] == ["the model worker has stopped"] * 2
    with pytest.raises(RuntimeError, match="stopped"):
        await worker.submit("c", decode(session("c"), 1))


def test_planner_puts_decode_rows_first_then_prefill_within_the_allowance():
    planner = StepPlanner(max_step_tokens=10, prefill_allowance=lambda rows, prefills: 3)
    works = []
    for name, rows, chunkable in (("p", 20, True), ("d1", 4, False), ("d2", 5, False), ("d3", 5, False)):
        work = SimpleNamespace(feed=Feed(session(name), list(range(rows)), 1, chunkable), fed=0)
        work.rows_left = rows
        works.append(work)
    planned = planner.plan(works)
    assert [(part.session.name, len(part.token_ids), part.keep_rows) for _, part in planned] == [
        ("d1", 4, 1), ("d2", 5, 1), ("p", 8, 0)]  # d3 would pass 10 rows; the prefill gets at least 8


def test_step_costs_pad_to_cheaper_sizes_and_bound_prefill_chunks():
    # A CPU where 2-3 rows cost two weight passes and 4 rows one: pad 2 and 3 up to 4.
    costs = StepCosts({1: 1.0, 2: 2.0, 3: 2.0, 4: 1.05, 8: 1.1, 16: 2.0, 32: 4.0})
    assert [costs.padding(rows) for rows in (1, 2, 3, 4, 8)] == [0, 2, 1, 0, 0]
    assert costs.cost(24) == pytest.approx(3.0) and costs.cost(64) == pytest.approx(8.0)  # past 32: in proportion
    # Beside 4 decode rows (1.05 s), a step may grow to 2.1 s: up to 16 rows, 12 of prefill.
    assert costs.prefill_allowance(4, slowdown=2.0) == 12
    assert costs.prefill_allowance(0) == 32  # an idle engine takes the largest measured step


# A CPU whose GEMM costs a step function of the rows (today's host, torch's GEMM, in seconds).
STEPPED = {1: 0.25, 2: 0.26, 3: 0.26, 4: 0.45, 8: 0.58, 16: 0.65, 32: 0.74, 64: 0.98}


def test_a_chunk_that_must_pass_the_budget_takes_the_rows_that_cost_about_the_same():
    costs = StepCosts(STEPPED)
    # Beside 8 decode rows (0.58 s) a step may cost 1.16 s: 72 rows do (past 64 in proportion: 1.10 s).
    assert costs.prefill_allowance(8, slowdown=2.0) == 64
    # Beside 3 (0.26 s) the budget is 0.52 s, but the smallest chunk (8 rows: 11, 0.61 s) passes it:
    # then every row that costs at most 1.15x those 11 goes in (24 rows, 0.695 s), not just 8.
    assert costs.prefill_allowance(3, slowdown=2.0) == 21
    assert costs.planned_cost(3 + 21) <= 1.15 * costs.planned_cost(3 + 8) < costs.planned_cost(3 + 22)


def test_chunk_steering_shrinks_chunks_that_run_dearer_than_the_table_says_and_grows_them_back():
    costs, steering = StepCosts(STEPPED), ChunkSteering(weight=1.0)  # weight 1: each step replaces the estimate
    assert steering.correction == 1.0  # nothing measured yet: the table as it is
    steering.observe(decode_rows=8, prefill_rows=0, seconds=0.70, table_seconds=0.58)  # 1.2x the table
    steering.observe(decode_rows=8, prefill_rows=56, seconds=2.40, table_seconds=0.98)  # 2.45x: a long context
    assert steering.correction == pytest.approx((0.70 / 0.58) / (2.40 / 0.98))
    assert costs.prefill_allowance(8, 2.0, steering.correction) == 0  # the planner's minimum chunk, no more
    steering.observe(decode_rows=8, prefill_rows=8, seconds=0.84, table_seconds=0.65)  # chunks cheap again
    assert costs.prefill_allowance(8, 2.0, steering.correction) == 62  # 70 rows: 2 x 0.58 x 0.93 s
    steering.observe(decode_rows=8, prefill_rows=0, seconds=5.0, table_seconds=0.58)  # decode steps crawl:
    assert steering.correction == ChunkSteering.MAX_CORRECTION  # chunks grow, but only so far
    steering.observe(decode_rows=0, prefill_rows=64, seconds=9.0, table_seconds=0.98)  # a lone prefill: no say
    assert steering.correction == ChunkSteering.MAX_CORRECTION


async def test_the_step_log_writes_one_line_per_step_in_order(tmp_path, monkeypatch):
    import json
    from specmesh.engine.step_log import ENV, StepLog
    monkeypatch.setenv(ENV, str(tmp_path / "not-yet" / "steps-{role}.jsonl"))  # its folder made for it
    log = StepLog.from_environment("target")
    steps = Steps()
    worker = scheduler(steps, chunk=4)
    worker.observers.append(log.observe)
    await steps_of(worker, {"d": decode(SimpleNamespace(name="d", request_id="req-1/abcdef012345"), 3),
                            "p": prefill_job(SimpleNamespace(name="p", request_id="req-2/0123456789ab"),
                                             list(range(100, 106)))})
    worker.stop()
    lines = [json.loads(line) for line in (tmp_path / "not-yet" / "steps-target.jsonl").read_text().splitlines()]
    assert len(lines) == len(steps.log) == 3
    assert [line["t"] for line in lines] == sorted(line["t"] for line in lines)
    assert lines[0]["parts"] == [["ef012345", 1, 0], ["456789ab", 4, 1]]  # a stream's row, then a chunk
    monkeypatch.delenv(ENV)
    assert StepLog.from_environment("draft") is None
