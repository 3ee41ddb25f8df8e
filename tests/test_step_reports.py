"""Step costs: kept current from decode steps, reported over GetModelInfo and /metrics, and kept
by the orchestrator per role (at start-up, and from every pool health check)."""

from __future__ import annotations

import asyncio
import math

import pytest
from prometheus_client import CollectorRegistry

from harness import load, make_engine, start_model_server
from orchestrator.decoding.loop import LoopConfig
from orchestrator.deployment.backends import OrchestratorOptions
from orchestrator.deployment.clients import DraftClient, TargetClient, open_channel
from orchestrator.deployment.options import PoolsOptions
from orchestrator.deployment.pool import ReplicaPool, fixed_replicas
from orchestrator.deployment.serving import Pools, servicer_over_pools
from orchestrator.deployment.step_reports import StepReports
from orchestrator.frontend.server import create_servicer
from specmesh.metrics import ServiceMetrics
from specmesh.sampling import SamplingParams
from orchestrator.decoding.costs import step_s, target_steps_s
from specmesh.step_costs import MEASURED_ROWS, PREMIUM_BOUNDS, StepCosts
from specmesh.v1 import common_pb2

TABLE = {1: 1.0, 2: 2.0, 3: 2.0, 4: 1.05, 8: 1.1, 16: 2.0, 32: 4.0}


def test_observe_moves_only_the_entry_of_the_size_the_step_ran_at():
    costs = StepCosts(TABLE)
    paddings = [costs.padding(rows) for rows in range(1, 33)]
    allowance = costs.prefill_allowance(4, slowdown=2.0)
    before = costs.seconds  # a reader's snapshot (the gRPC thread) while the worker observes
    costs.observe(4, 2.05)
    assert costs.seconds[4] == pytest.approx(1.05 + 0.2 * 1.0)
    assert {rows: s for rows, s in costs.seconds.items() if rows != 4} == {r: s for r, s in TABLE.items() if r != 4}
    assert before == TABLE  # replaced, never changed in place
    assert costs.cost(4) == pytest.approx(1.25) and costs.cost(6) == pytest.approx((1.25 + 1.1) / 2)
    costs.observe(5, 9.0)  # not a measured size: nothing to move (its cost is interpolated)
    for garbage in (math.nan, math.inf, 0.0, -1.0):
        costs.observe(1, garbage)
    assert costs.seconds == {**TABLE, 4: pytest.approx(1.25)}
    costs.observe(4, 1000.0)  # one stalled step (a GC pause) counts as at most 4x the entry
    assert costs.seconds[4] == pytest.approx(1.25 + 0.2 * (4 * 1.25 - 1.25))
    # Planning keeps the start-up table: no step flips padding or the prefill chunk.
    assert [costs.padding(rows) for rows in range(1, 33)] == paddings
    assert costs.prefill_allowance(4, slowdown=2.0) == allowance and costs.measured == TABLE


def test_a_disturbance_at_start_up_inflates_no_size(monkeypatch):
    """The first three forwards run ten times slower (another service loading beside this one);
    every size still gets its undisturbed cost, because each repeat is a pass over all sizes."""
    clock = [0.0]
    calls = []

    def forward_rows(rows: int) -> None:
        calls.append(rows)
        clock[0] += rows * 0.01 * (10 if len(calls) <= 3 else 1)
    monkeypatch.setattr("specmesh.step_costs.time.perf_counter", lambda: clock[0])
    costs = StepCosts.measure(forward_rows, sizes=(1, 2, 4, 8), repeats=2)
    assert costs.measured == pytest.approx({1: 0.01, 2: 0.02, 4: 0.04, 8: 0.08})
    assert calls == [1, 2, 4, 8] * 2


def test_extra_rows_beside_several_sessions_learn_what_they_cost_over_the_tables_growth():
    costs = StepCosts(TABLE)
    growth = costs.planned_cost(16) - costs.cost(8)  # 8 one-row sessions and 8 rows more: 0.9 s by the table
    for _ in range(2):
        costs.observe_extra_rows(8, 16, costs.cost(8) + 1.7 * growth)
    assert costs.extra_row_premium(8) == 1.0  # too few steps to tell
    costs.observe_extra_rows(8, 16, costs.cost(8) + 1.7 * growth)
    assert costs.extra_row_premium(8) == pytest.approx(1.7) and costs.extra_row_premium(5) == pytest.approx(1.7)
    assert costs.extra_row_premium(12) == 1.0 and costs.extra_row_premium(1) == 1.0  # another load; one session
    costs.observe_extra_rows(8, 16, 1000.0)  # one stalled step counts as at most 4x its price
    stalled = costs.extra_row_premium(8)
    assert 1.7 < stalled < PREMIUM_BOUNDS[1]
    for _ in range(100):
        costs.observe_extra_rows(8, 16, costs.cost(8) + 1.7 * growth)
    assert costs.extra_row_premium(8) == pytest.approx(1.7, rel=0.02)  # and it passes
    for sessions, rows, seconds in [(8, 8, 5.0), (1, 4, 5.0), (8, 16, math.nan), (8, 16, -1.0), (8, 16, math.inf)]:
        costs.observe_extra_rows(sessions, rows, seconds)  # no extra rows, one session, garbage: nothing
    assert costs.extra_row_premium(8) == pytest.approx(1.7, rel=0.02)
    reported = StepCosts.from_proto(costs.to_proto(), costs.planned_to_proto(), costs.premiums.to_proto())
    assert reported.extra_row_premium(8) == costs.extra_row_premium(8) and reported.premiums.learned.keys() == {8}
    garbage = [common_pb2.RowPremium(sessions=sessions, premium=premium) for sessions, premium in
               [(0, 2.0), (1, 2.0), (2, math.nan), (3, 100.0), (32, -5.0)]]
    assert StepCosts.from_proto(costs.to_proto(), premiums=garbage).premiums.learned == {4: 4.0, 32: 0.5}


def test_prompt_lookups_rows_are_priced_at_the_premium_and_a_drafts_are_not():
    costs = StepCosts(TABLE)
    for _ in range(3):
        costs.observe_extra_rows(8, 16, costs.cost(8) + 2.0 * (costs.planned_cost(16) - costs.cost(8)))
    assert step_s(costs, 8, 8) == pytest.approx(2.0)  # the table's own growth (and its 16-row entry)
    assert step_s(costs, 8, 8, premium=True) == pytest.approx(1.1 * (1 + 2 * (2.0 / 1.1 - 1)))
    assert target_steps_s(costs, steady_rows=16, drafting_rows=0, lookup_rows=8) == step_s(costs, 8, 8, premium=True)
    assert target_steps_s(costs, steady_rows=0, drafting_rows=16, drafting=8) == step_s(costs, 8, 8)
    assert step_s(costs, 1, 3, premium=True) == step_s(costs, 1, 3)  # one session: the table itself


def test_from_proto_drops_garbage_and_never_raises():
    entries = [common_pb2.StepCost(rows=rows, seconds=seconds) for rows, seconds in
               [(0, 1.0), (1, math.nan), (2, math.inf), (3, -1.0), (4, 0.0), (8, 0.5), (1, 0.25)]]
    assert StepCosts.from_proto(entries).seconds == {1: 0.25, 8: 0.5}
    assert StepCosts.from_proto(entries[:5]) is None and StepCosts.from_proto([]) is None
    assert StepCosts.from_proto(StepCosts(TABLE).to_proto()).seconds == TABLE  # the round trip
    moved = StepCosts(TABLE)
    moved.observe(1, 10 * TABLE[1])
    both = StepCosts.from_proto(moved.to_proto(), moved.planned_to_proto())
    assert (both.seconds, both.measured) == (moved.seconds, TABLE) and both.cost(1) > both.planned_cost(1)
    assert StepCosts.from_proto(moved.to_proto(), entries[:5]).measured == moved.seconds  # no good start-up entry
    many = [common_pb2.StepCost(rows=rows, seconds=1.0) for rows in range(1, 10_001)]
    assert len(StepCosts.from_proto(many).seconds) == 256  # a flood stays cheap: the smallest sizes


def test_step_reports_keep_the_last_good_table_per_role():
    reports = StepReports()
    reports.update("draft", common_pb2.ModelInfo())  # not measured yet: nothing
    assert reports.draft is None and reports.updated_at == {}
    reports.update("draft", common_pb2.ModelInfo(step_costs=StepCosts(TABLE).to_proto()))
    first = reports.updated_at["draft"]
    garbage = common_pb2.ModelInfo(step_costs=[common_pb2.StepCost(rows=1, seconds=-1.0)])
    reports.update("draft", garbage)
    reports.update("draft", None)
    assert reports.draft.seconds == TABLE and reports.updated_at == {"draft": first} and reports.target is None
    with pytest.raises(ValueError):
        reports.update("verifier", garbage)


async def test_a_calibrated_service_reports_costs_it_keeps_current_from_decode_steps(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    metrics = ServiceMetrics.for_engine("target", engine, CollectorRegistry())
    server, port = await start_model_server("target", engine)
    try:
        async with open_channel(f"127.0.0.1:{port}") as channel:
            client = TargetClient(channel)
            assert list((await client.model_info(timeout=10)).step_costs) == []  # before calibration
            assert _scraped(metrics) == {}
            costs = await engine.run(engine.calibrate)
            reported = (await client.model_info(timeout=10)).step_costs
            assert [entry.rows for entry in reported] == list(MEASURED_ROWS)
            assert all(entry.seconds > 0 for entry in reported)
            assert _scraped(metrics) == costs.seconds
            await _prefill_then_decode(engine)
            ran_at = 1 + costs.padding(1)  # the decode steps' size, padding included
            assert costs.seconds[ran_at] != costs.measured[ran_at]
            assert {r: s for r, s in costs.seconds.items() if r != ran_at} == \
                {r: s for r, s in costs.measured.items() if r != ran_at}  # the prefill moved nothing
            reported = StepCosts.from_proto((await client.model_info(timeout=10)).step_costs)
            assert reported.seconds == costs.seconds and _scraped(metrics) == costs.seconds
    finally:
        await server.stop(None)


async def test_a_service_reports_the_premium_its_steps_of_several_sessions_show(tiny_llama_dir):
    """Two sessions decoding in the same steps, one of them verifying four rows at a time: the
    service learns what those extra rows cost and reports it in ModelInfo (bucket: 2 sessions)."""
    engine = make_engine(tiny_llama_dir)
    server, port = await start_model_server("target", engine)
    try:
        async with open_channel(f"127.0.0.1:{port}") as channel:
            client = TargetClient(channel)
            # A table whose rows always cost (the tiny model's measured one is flat, and where the table
            # does not grow with rows a step says nothing of a premium): what steps take is still real.
            engine.costs = StepCosts({rows: 0.001 * rows for rows in MEASURED_ROWS})
            assert list((await client.model_info(timeout=10)).extra_row_premiums) == []
            sessions = [(engine.new_session(f"premium-{rows}", [5, 6, 7, 8, 9, 10 + rows],
                                            SamplingParams(temperature=0.0)), rows) for rows in (1, 4)]

            def job(session, rows: int):
                yield from engine.feed_tail(session, keep_rows=1, chunkable=True)
                for step in range(8):
                    session.token_ids.extend(range(20 + step, 20 + step + rows))
                    yield from engine.feed_tail(session, keep_rows=rows)
            await asyncio.gather(*(engine.submit(session, job(session, rows)) for session, rows in sessions))
            reported = (await client.model_info(timeout=10)).extra_row_premiums
            assert [entry.sessions for entry in reported] == [2]
            assert PREMIUM_BOUNDS[0] <= reported[0].premium <= PREMIUM_BOUNDS[1]
            assert StepCosts.from_proto((await client.model_info(timeout=10)).step_costs, premiums=reported
                                        ).extra_row_premium(2) == reported[0].premium
    finally:
        await server.stop(None)


async def test_the_orchestrator_has_both_roles_costs_from_start_up(tiny_llama_dir, tiny_llama_perturbed_dir):
    engines = {"target": make_engine(tiny_llama_dir), "draft": make_engine(tiny_llama_perturbed_dir, role_name="draft")}
    servers, ports = {}, {}
    try:
        for role, engine in engines.items():
            engine.calibrate()  # as load_engine does, before serving
            servers[role], ports[role] = await start_model_server(role, engine)
        options = OrchestratorOptions(f"127.0.0.1:{ports['target']}", f"127.0.0.1:{ports['draft']}", LoopConfig())
        _, tokenizer = load(str(tiny_llama_dir), "cpu")
        reports = (await create_servicer(tokenizer, options)).backends.step_reports
        assert reports.target.seconds == engines["target"].costs.seconds
        assert reports.draft.seconds == engines["draft"].costs.seconds
        assert set(reports.updated_at) == {"target", "draft"}
    finally:
        for server in servers.values():
            await server.stop(None)


async def test_pools_keep_the_orchestrators_costs_current_at_every_health_check(tiny_llama_dir,
                                                                               tiny_llama_perturbed_dir):
    engines = {"target": make_engine(tiny_llama_dir), "draft": make_engine(tiny_llama_perturbed_dir, role_name="draft")}
    servers, pools = {}, None
    try:
        replica_pools = {}
        for role, engine in engines.items():
            engine.calibrate()
            servers[role], port = await start_model_server(role, engine)
            client = TargetClient if role == "target" else DraftClient
            replica_pools[role] = ReplicaPool(role, fixed_replicas({f"{role}-0": f"127.0.0.1:{port}"}), client,
                                              check_interval_s=3600)  # checks only when the test refreshes
        pools = Pools(replica_pools, options=PoolsOptions(start_timeout_s=30))
        _, tokenizer = load(str(tiny_llama_dir), "cpu")
        reports = (await servicer_over_pools(tokenizer, pools, LoopConfig())).backends.step_reports
        assert reports.target.cost(1) == engines["target"].costs.cost(1)
        engines["target"].costs.observe(1, 3 * engines["target"].costs.cost(1))  # steps got slower
        checked_before = reports.updated_at["target"]
        await pools.pools["target"].refresh()
        assert reports.target.seconds == engines["target"].costs.seconds != engines["target"].costs.measured
        # ... and the start-up table with them: the growth with rows that prices sizes not run lately
        assert reports.target.measured == engines["target"].costs.measured
        assert reports.target.cost(1) > reports.target.planned_cost(1)
        assert reports.updated_at["target"] > checked_before
        # A replica that reports garbage (or fails its report) leaves the last good table in place.
        engines["target"].describe = lambda: common_pb2.ModelInfo(
            step_costs=[common_pb2.StepCost(rows=1, seconds=math.nan)])
        kept = reports.target
        await pools.pools["target"].refresh()
        assert reports.target is kept and reports.draft.seconds == engines["draft"].costs.seconds
    finally:
        if pools is not None:
            await pools.stop()
        for server in servers.values():
            await server.stop(None)


async def _prefill_then_decode(engine, decode_steps: int = 3) -> None:
    """A prompt's prefill (alone: one prefill step) and then one-row decode steps."""
    session = engine.new_session("costs", [5, 6, 7, 8, 9, 10], SamplingParams(temperature=0.0))

    def job():
        yield from engine.feed_tail(session, keep_rows=1, chunkable=True)
        for token in range(decode_steps):
            session.token_ids.append(11 + token)
            yield from engine.feed_tail(session, keep_rows=1)

    await engine.submit(session, job())
    engine.close(session.request_id)


def _scraped(metrics: ServiceMetrics) -> dict[int, float]:
    return {int(sample.labels["rows"]): sample.value for family in metrics.registry.collect()
            if family.name == "specmesh_step_seconds" for sample in family.samples}


def test_services_on_one_machine_take_turns_to_calibrate():
    """While one service measures its step costs, another on the machine cannot start measuring."""
    import fcntl
    import tempfile
    from pathlib import Path

    from specmesh.service import CALIBRATION_LOCK, calibration_turn

    def try_to_calibrate() -> bool:
        with open(Path(tempfile.gettempdir()) / CALIBRATION_LOCK, "a") as other:
            try:
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            fcntl.flock(other, fcntl.LOCK_UN)
            return True

    with calibration_turn():
        assert not try_to_calibrate()
    assert try_to_calibrate()
