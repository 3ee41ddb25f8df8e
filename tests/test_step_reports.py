"""Step costs: the start-up table and the model fitted to decode steps (specmesh.engine.step_costs,
specmesh.engine.step_model), reported over GetModelInfo and /metrics, and kept by the orchestrator per role
(at start-up, and from every pool health check)."""

from __future__ import annotations

import asyncio
import math

import pytest
from hypothesis import given, settings, strategies as st
from prometheus_client import CollectorRegistry

from harness import load, make_engine, start_model_server
from orchestrator.decoding.request import LoopConfig
from orchestrator.control.build import OrchestratorOptions
from orchestrator.serving.clients import DraftClient, TargetClient, open_channel
from orchestrator.control.options import PoolsOptions
from orchestrator.serving.pool import PoolHooks, ReplicaPool, fixed_replicas
from orchestrator.control.pools import Pools
from orchestrator.control.build import servicer_over_pools
from orchestrator.serving.step_reports import StepReports
from orchestrator.control.build import create_servicer
from specmesh.server.metrics import ServiceMetrics
from specmesh.engine.sampling_params import SamplingParams
from specmesh.engine.step_costs import (COMPUTE_BOUND_GROWTH, MAX_REPORTED_SIZES, MEASURED_ROWS, OUTLIER_FACTOR,
                                       StepCosts)
from specmesh.engine.step_model import BOUNDS, PRIOR, StepShape
from specmesh.v1 import common_pb2

# 2 and 3 rows pad to 4 (5 % dearer than one row, where 2 and 3 cost twice as much); nothing else pads.
TABLE = {1: 1.0, 2: 2.0, 3: 2.0, 4: 1.05, 8: 1.1, 16: 2.0, 32: 4.0}
PADDED = {1: 1.0, 2: 1.05, 3: 1.05, 4: 1.05, 8: 1.1, 16: 2.0, 32: 4.0}  # one session's step of each size


def _coefficients(reported: common_pb2.StepCostModel) -> tuple[float, float, float]:
    return reported.scale, reported.per_session_s, reported.per_kilo_attended_s


def _info(costs: StepCosts, **fields) -> common_pb2.ModelInfo:
    """What a service running `costs` reports (specmesh.engine.model_engine.ModelEngine.describe)."""
    return common_pb2.ModelInfo(step_costs=costs.to_proto(), planned_step_costs=costs.planned_to_proto(),
                                step_model=costs.model.to_proto(), **fields)


def test_observe_fits_the_model_and_readers_see_one_consistent_table():
    costs = StepCosts(TABLE)
    paddings = [costs.padding(rows) for rows in range(1, 65)]
    allowance = costs.prefill_allowance(4, slowdown=2.0)
    assert costs.seconds == PADDED  # a size the service pads is priced as it runs: padded
    before = costs.seconds  # a reader's snapshot (the gRPC thread) while the worker observes
    for sessions, rows, attended in [(1, 1, 100), (2, 4, 3000), (4, 8, 9000), (8, 16, 40_000), (3, 4, 0)] * 10:
        shape = StepShape(sessions, rows, attended)  # slower than at start-up: twice the table, 50 ms a session
        costs.observe(shape, 2.0 * costs.planned_cost(rows) + 0.05 * (sessions - 1))
    assert before == PADDED  # a copy, never changed in place
    scale, per_session, _ = costs.model.coefficients
    assert scale > 1.5 and per_session > 0.03
    # Every reader's view is the one model over the start-up table: the table, one-session steps, any step.
    assert costs.seconds == {rows: costs.model.predict(PADDED[rows], StepShape(1, rows + costs.padding(rows)))
                             for rows in TABLE}
    assert costs.seconds[2] == costs.cost(2) == costs.cost(4) == costs.step_s(StepShape(1, 3)) > 1.5 * 1.05
    assert costs.step_s(StepShape(2, 3, 2000)) == costs.model.predict(1.05, StepShape(2, 4, 2000))  # 3 pads to 4
    six = StepShape(4, 6, 2000)
    assert costs.step_s(six) == costs.model.predict(costs.planned_cost(6), six)  # 6 does not pad
    assert costs.step_s(StepShape(4, 8)) > costs.step_s(StepShape(1, 8))  # sessions cost
    assert [entry.seconds for entry in costs.to_proto()] == list(costs.seconds.values())
    # Planning keeps the start-up table: no step flips padding or the prefill chunk.
    assert [costs.padding(rows) for rows in range(1, 65)] == paddings
    assert costs.prefill_allowance(4, slowdown=2.0) == allowance and costs.measured == TABLE
    assert costs.planned_to_proto() == [common_pb2.StepCost(rows=r, seconds=s) for r, s in TABLE.items()]


def test_a_stalled_step_counts_as_at_most_outlier_factor_times_its_prediction():
    shape = StepShape(2, 8, 1000)
    stalled, capped, slow = StepCosts(TABLE), StepCosts(TABLE), StepCosts(TABLE)
    for costs in (stalled, capped, slow):
        costs.observe(StepShape(1, 8), 1.2)
    predicted = stalled.step_s(shape)
    stalled.observe(shape, 1000.0)  # a GC pause: not the new cost
    capped.observe(shape, OUTLIER_FACTOR * predicted)
    slow.observe(shape, 0.9 * OUTLIER_FACTOR * predicted)  # below the cap: counts as it is
    assert stalled.model.coefficients == capped.model.coefficients != slow.model.coefficients
    assert stalled.step_s(shape) < OUTLIER_FACTOR * predicted


@pytest.mark.parametrize("garbage", [math.nan, math.inf, -math.inf, 0.0, -1.0])
def test_garbage_seconds_fit_nothing(garbage):
    costs = StepCosts(TABLE)
    costs.observe(StepShape(2, 4, 500), 3.0)
    before = costs.model.coefficients
    costs.observe(StepShape(2, 4, 500), garbage)
    assert costs.model.coefficients == before and costs.model._steps == 1.0


def test_a_disturbance_at_start_up_inflates_no_size(monkeypatch):
    """The first three forwards run ten times slower (another service loading beside this one);
    every size still gets its undisturbed cost, because each repeat is a pass over all sizes."""
    clock = [0.0]
    calls = []

    def forward_rows(rows: int) -> None:
        calls.append(rows)
        clock[0] += rows * 0.01 * (10 if len(calls) <= 3 else 1)
    monkeypatch.setattr("specmesh.engine.step_costs.time.perf_counter", lambda: clock[0])
    costs = StepCosts.measure(forward_rows, sizes=(1, 2, 4, 8), repeats=2)
    assert costs.measured == pytest.approx({1: 0.01, 2: 0.02, 4: 0.04, 8: 0.08})
    assert calls == [1, 2, 4, 8] * 2


def _on_a_clock(monkeypatch, seconds_of_rows) -> tuple:
    """forward_rows on a fake clock, a forward of T rows taking seconds_of_rows(T); and the rows it ran."""
    clock, calls = [0.0], []

    def forward_rows(rows: int) -> None:
        calls.append(rows)
        clock[0] += seconds_of_rows(rows)
    monkeypatch.setattr("specmesh.engine.step_costs.time.perf_counter", lambda: clock[0])
    return forward_rows, calls


def test_the_table_goes_on_past_64_rows_until_a_step_is_compute_bound(monkeypatch):
    """A GPU's step: the weights' read (10 ms) up to about 512 rows, then 20 us a row of compute. The table
    doubles past MEASURED_ROWS while a doubling costs less than COMPUTE_BOUND_GROWTH times the size before,
    so a step of 64 sessions verifying 4 draft tokens (320 rows) is priced at what it costs, not at five
    64-row steps; past the first compute-bound size the proportion holds."""
    def gpu(rows: int) -> float:
        return max(0.010, rows * 20e-6)
    forward_rows, calls = _on_a_clock(monkeypatch, gpu)
    costs = StepCosts.measure(forward_rows, largest=4096)
    grown = [128, 256, 512, 1024]  # 1024 rows cost 2x 512: compute-bound, the last size measured
    assert gpu(1024) >= COMPUTE_BOUND_GROWTH * gpu(512) and gpu(512) < COMPUTE_BOUND_GROWTH * gpu(256)
    assert list(costs.measured) == [*MEASURED_ROWS, *grown]
    assert calls == [*MEASURED_ROWS, *grown] * 2  # the repeat times the grown sizes too
    assert costs.planned_cost(320) == pytest.approx(0.010, rel=0.01)
    assert costs.planned_cost(2048) == pytest.approx(gpu(2048))


def test_a_compute_bound_step_or_the_largest_step_ends_the_table(monkeypatch):
    """A CPU's step, in proportion to its rows: one doubling shows it, and the proportion prices the rest.
    The largest step the engine may take bounds the sizes measured, the fixed ones too."""
    def cpu(rows: int) -> float:
        return 0.001 * rows
    forward_rows, _ = _on_a_clock(monkeypatch, cpu)
    assert list(StepCosts.measure(forward_rows, largest=2048).measured) == [*MEASURED_ROWS, 128]
    forward_rows, calls = _on_a_clock(monkeypatch, lambda rows: 0.010)
    assert list(StepCosts.measure(forward_rows, largest=100).measured) == list(MEASURED_ROWS)
    forward_rows, calls = _on_a_clock(monkeypatch, lambda rows: 0.010)
    assert list(StepCosts.measure(forward_rows, largest=40).measured) == [r for r in MEASURED_ROWS if r <= 40]
    assert max(calls) == 32


def test_from_proto_drops_garbage_and_never_raises():
    entries = [common_pb2.StepCost(rows=rows, seconds=seconds) for rows, seconds in
               [(0, 1.0), (1, math.nan), (2, math.inf), (3, -1.0), (4, 0.0), (8, 0.5), (1, 0.25)]]
    assert StepCosts.from_proto(common_pb2.ModelInfo(planned_step_costs=entries)).measured == {1: 0.25, 8: 0.5}
    assert StepCosts.from_proto(common_pb2.ModelInfo(planned_step_costs=entries[:5])) is None
    assert StepCosts.from_proto(common_pb2.ModelInfo()) is None
    # No model reported (a service before step_model): the table as it is.
    assert StepCosts.from_proto(common_pb2.ModelInfo(planned_step_costs=entries)).model.coefficients == PRIOR
    # A model out of bounds is brought within them; with no usable table, still None.
    wild = common_pb2.StepCostModel(scale=math.nan, per_session_s=-2.0, per_kilo_attended_s=math.inf)
    assert StepCosts.from_proto(common_pb2.ModelInfo(step_costs=entries, step_model=wild)
                                ).model.coefficients == (1.0, 0.0, 0.0)
    huge = common_pb2.StepCostModel(scale=1e9, per_session_s=0.5)
    assert StepCosts.from_proto(common_pb2.ModelInfo(step_costs=entries, step_model=huge)
                                ).model.coefficients == (BOUNDS[0][1], 0.5, 0.0)
    assert StepCosts.from_proto(common_pb2.ModelInfo(step_model=huge)) is None


def test_from_proto_round_trips_the_table_and_the_model():
    moved = StepCosts(TABLE)
    for _ in range(20):
        moved.observe(StepShape(4, 8, 20_000), 5.0)
    assert moved.model.coefficients != PRIOR
    reported = StepCosts.from_proto(_info(moved))
    assert reported.measured == TABLE and reported.model.coefficients == moved.model.coefficients
    assert reported.seconds == moved.seconds != PADDED
    assert reported.step_s(StepShape(4, 8, 20_000)) == moved.step_s(StepShape(4, 8, 20_000))
    # A service that sends only step_costs (no start-up table): they stand in for it.
    alone = StepCosts.from_proto(common_pb2.ModelInfo(step_costs=moved.to_proto()))
    assert alone.measured == moved.seconds and alone.model.coefficients == PRIOR
    # Garbage start-up entries and good current ones: the current ones stand in too.
    garbage = [common_pb2.StepCost(rows=1, seconds=-1.0)]
    assert StepCosts.from_proto(common_pb2.ModelInfo(step_costs=moved.to_proto(), planned_step_costs=garbage)
                                ).measured == moved.seconds


def test_a_flood_of_sizes_stays_bounded():
    many = [common_pb2.StepCost(rows=rows, seconds=1.0) for rows in range(1, 10_001)]
    costs = StepCosts.from_proto(common_pb2.ModelInfo(planned_step_costs=many, step_costs=many))
    assert list(costs.measured) == list(range(1, MAX_REPORTED_SIZES + 1))  # the smallest sizes
    assert len(costs.seconds) == len(costs.to_proto()) == MAX_REPORTED_SIZES


_floats = st.floats(allow_nan=True, allow_infinity=True)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2**32 - 1), _floats), max_size=20),
       st.lists(st.tuples(st.integers(0, 2**32 - 1), _floats), max_size=20),
       st.none() | st.tuples(_floats, _floats, _floats))
def test_any_report_is_read_without_raising(planned, current, model):
    info = common_pb2.ModelInfo(planned_step_costs=[common_pb2.StepCost(rows=r, seconds=s) for r, s in planned],
                                step_costs=[common_pb2.StepCost(rows=r, seconds=s) for r, s in current])
    if model is not None:
        info.step_model.CopyFrom(common_pb2.StepCostModel(scale=model[0], per_session_s=model[1],
                                                          per_kilo_attended_s=model[2]))
    costs = StepCosts.from_proto(info)
    valid = [s for r, s in planned + current if r > 0 and math.isfinite(s) and s > 0]
    assert (costs is None) == (not valid)
    if costs is not None:
        assert 0 < len(costs.measured) <= MAX_REPORTED_SIZES
        assert all(rows > 0 and 0 < s < math.inf for rows, s in costs.measured.items())
        assert all(low <= c <= high for c, (low, high) in zip(costs.model.coefficients, BOUNDS))


def test_step_reports_keep_the_last_good_table_per_role():
    reports = StepReports()
    reports.update("draft", common_pb2.ModelInfo())  # not measured yet: nothing
    assert reports.draft is None and reports.updated_at == {}
    model = common_pb2.StepCostModel(scale=1.5, per_session_s=0.01)
    reports.update("draft", common_pb2.ModelInfo(planned_step_costs=StepCosts(TABLE).planned_to_proto(),
                                                 step_model=model))
    first = reports.updated_at["draft"]
    garbage = common_pb2.ModelInfo(step_costs=[common_pb2.StepCost(rows=1, seconds=-1.0)], step_model=model)
    reports.update("draft", garbage)
    reports.update("draft", None)
    assert reports.draft.measured == TABLE and reports.draft.model.coefficients == (1.5, 0.01, 0.0)
    assert reports.draft.seconds == {rows: 1.5 * s for rows, s in PADDED.items()}
    assert reports.updated_at == {"draft": first} and reports.target is None
    with pytest.raises(ValueError):
        reports.update("verifier", garbage)


async def test_a_calibrated_service_reports_the_model_it_fits_to_decode_steps(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    metrics = ServiceMetrics.for_engine("target", engine, CollectorRegistry())
    server, port = await start_model_server("target", engine)
    try:
        async with open_channel(f"127.0.0.1:{port}") as channel:
            client = TargetClient(channel)
            info = await client.model_info(timeout=10)
            assert list(info.step_costs) == list(info.planned_step_costs) == [] and not info.HasField("step_model")
            assert _scraped(metrics) == {}
            costs = await engine.run(engine.calibrate)
            info = await client.model_info(timeout=10)
            sizes = [entry.rows for entry in info.planned_step_costs]
            assert sizes[:len(MEASURED_ROWS)] == list(MEASURED_ROWS)  # then doubling, within a step's largest
            grown = sizes[len(MEASURED_ROWS) - 1:]
            assert all(b == 2 * a for a, b in zip(grown, grown[1:])) and sizes[-1] < engine.context_window
            assert all(entry.seconds > 0 for entry in info.planned_step_costs)
            assert _coefficients(info.step_model) == PRIOR  # nothing run since calibration
            assert _scraped(metrics) == costs.seconds
            await _prefill_then_decode(engine, decode_steps=0)
            assert costs.model.coefficients == PRIOR  # a prefill is not what a decode step costs
            await _prefill_then_decode(engine, decode_steps=3)
            scale, per_session, per_kilo = costs.model.coefficients
            assert scale != 1.0 and per_session == 0.0  # one session: nothing tells what more would cost
            info = await client.model_info(timeout=10)
            assert _coefficients(info.step_model) == costs.model.coefficients
            reported = StepCosts.from_proto(info)
            assert reported.measured == costs.measured and reported.model.coefficients == costs.model.coefficients
            assert reported.seconds == costs.seconds == _scraped(metrics)
            assert {entry.rows: entry.seconds for entry in info.step_costs} == costs.seconds
    finally:
        await server.stop(None)


async def test_steps_of_several_sessions_move_the_model_the_service_reports(tiny_llama_dir):
    """Three sessions decoding in the same steps, one of them verifying four rows at a time: the
    service fits its model to those steps (their sessions, rows and attended pairs) and reports it."""
    engine = make_engine(tiny_llama_dir)
    assert engine.ragged  # several sessions' rows in one forward: one step to fit
    server, port = await start_model_server("target", engine)
    try:
        async with open_channel(f"127.0.0.1:{port}") as channel:
            client = TargetClient(channel)
            costs = await engine.run(engine.calibrate)
            seen: list[tuple[StepShape, float]] = []
            fit = costs.observe
            costs.observe = lambda shape, seconds: (seen.append((shape, seconds)), fit(shape, seconds))
            sessions = [(engine.new_session(f"several-{i}", [5, 6, 7, 8, 9, 10 + i], SamplingParams(temperature=0.0)),
                         rows) for i, rows in enumerate((1, 1, 4))]

            def job(session, rows: int):
                yield from engine.feed_tail(session, keep_rows=1, chunkable=True)
                for step in range(8):
                    session.token_ids.extend(range(20 + step, 20 + step + rows))
                    yield from engine.feed_tail(session, keep_rows=rows)
            await asyncio.gather(*(engine.submit(session, job(session, rows)) for session, rows in sessions))
            several = [shape for shape, _ in seen if shape.sessions > 1]
            assert several, seen
            for shape in several:  # every row attends over its session's cache: the prompt's 6 tokens at least
                assert shape.rows >= shape.sessions and shape.attended >= 6 * shape.sessions
            assert costs.model.coefficients != PRIOR
            reported = _coefficients((await client.model_info(timeout=10)).step_model)
            assert reported == costs.model.coefficients
            # the steps of several sessions are in the fit (what a session costs is then measured, not the
            # prior; how much, zero included, is whatever this host's timings say)
            assert costs.model.evidence[1] > 0.0
            assert BOUNDS[1][0] <= reported[1] <= BOUNDS[1][1]
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
        assert reports.target.measured == engines["target"].costs.measured != engines["draft"].costs.measured
        assert reports.target.model.coefficients == reports.draft.model.coefficients == PRIOR
        assert set(reports.updated_at) == {"target", "draft"}
    finally:
        for server in servers.values():
            await server.stop(None)


async def test_pools_keep_the_orchestrators_costs_current_at_every_health_check(tiny_llama_dir,
                                                                               tiny_llama_perturbed_dir):
    engines = {"target": make_engine(tiny_llama_dir), "draft": make_engine(tiny_llama_perturbed_dir, role_name="draft")}
    servers, pools = {}, None
    try:
        replica_pools, step_reports = {}, StepReports()
        for role, engine in engines.items():
            engine.calibrate()
            servers[role], port = await start_model_server(role, engine)
            client = TargetClient if role == "target" else DraftClient
            replica_pools[role] = ReplicaPool(role, fixed_replicas({f"{role}-0": f"127.0.0.1:{port}"}), client,
                                              check_interval_s=3600,  # checks only when the test refreshes
                                              hooks=PoolHooks(on_info=step_reports.update))
        pools = Pools(replica_pools, options=PoolsOptions(start_timeout_s=30), step_reports=step_reports)
        _, tokenizer = load(str(tiny_llama_dir), "cpu")
        reports = (await servicer_over_pools(tokenizer, pools, LoopConfig())).backends.step_reports
        assert reports.target.cost(1) == engines["target"].costs.cost(1)
        started = engines["target"].costs.cost(1)  # the service's own, as its steps (a warm-up) left it
        one_row = StepShape(1, 1 + engines["target"].costs.padding(1))  # as it runs: padded where that is cheaper
        for _ in range(3):
            engines["target"].costs.observe(one_row, 3 * started)  # steps got slower
        checked_before = reports.updated_at["target"]
        await pools.pools["target"].refresh()
        assert reports.target.seconds == engines["target"].costs.seconds
        # ... from the start-up table and the model the service fitted, as the service has them
        assert reports.target.measured == engines["target"].costs.measured
        assert reports.target.model.coefficients == engines["target"].costs.model.coefficients != PRIOR
        assert reports.target.cost(1) > started
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


async def test_the_busy_counter_counts_each_batched_step_once(tiny_llama_dir):
    """specmesh_step_busy_seconds: the model's time in steps, whatever the sessions in them (a call's forward
    time counts a shared step once per session), so that over committed tokens it is what a token costs."""
    engine = make_engine(tiny_llama_dir)
    metrics = ServiceMetrics.for_engine("target", engine, CollectorRegistry())
    stepped: list[int] = []
    engine.scheduler.observers.append(lambda parts, step_ns: stepped.append(step_ns))
    await asyncio.gather(*(_prefill_then_decode(engine, decode_steps=4, name=f"busy-{i}") for i in range(3)))
    assert engine.scheduler.batched_steps > 0  # some steps held several sessions
    busy = metrics.registry.get_sample_value("specmesh_step_busy_seconds_total", metrics.labels)
    assert busy == pytest.approx(sum(stepped) / 1e9)
    assert metrics.registry.get_sample_value("specmesh_step_rows_count", metrics.labels) == len(stepped)


async def _prefill_then_decode(engine, decode_steps: int = 3, name: str = "costs") -> None:
    """A prompt's prefill (alone: one prefill step) and then one-row decode steps."""
    session = engine.new_session(name, [5, 6, 7, 8, 9, 10], SamplingParams(temperature=0.0))

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

    from specmesh.server.service import CALIBRATION_LOCK, calibration_turn

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
