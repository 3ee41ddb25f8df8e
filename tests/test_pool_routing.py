"""Routing and autoscaling by load: real target servers on tiny models, a pool over them.

The pools here run no background refresher: each test polls with `pool.refresh()`,
so what the router knew when it chose is exact. A replica "under load" is a real
server whose engine describes itself with load fields set (as a batching engine
fills them), so the report travels over GetModelInfo like any other.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import time
from contextlib import asynccontextmanager

import pytest

from harness import WORK_TIMEOUT_S, make_engine, start_model_server
from orchestrator.serving.clients import TargetClient, open_channel
from orchestrator.serving.failover import PooledTargetClient
from orchestrator.serving.load import KV_FULL, ROWS_PER_SESSION, Load, replica_load
from orchestrator.serving import pool as pool_module
from orchestrator.serving.pool import ReplicaPool, fixed_replicas
from orchestrator.control.ray_cli import add_serve_arguments
from orchestrator.control.ray_controller import autoscale
from orchestrator.control.pools import Pools
from specmesh.engine.sampling_params import SamplingParams
from specmesh.v1 import common_pb2
from target_service.servicer import TargetServicer

PROMPT = [5, 6, 7, 8]
GREEDY = SamplingParams(temperature=0.0)


class Targets:
    """Two target servers, named target-0 and target-1, and a pool over them (no background checks)."""

    def __init__(self, model_dir):
        self.model_dir = model_dir
        self.engines, self.servers, self.addresses = {}, {}, {}
        self.pool: ReplicaPool | None = None
        self.client: PooledTargetClient | None = None

    async def start(self, count: int = 2) -> "Targets":
        for index in range(count):
            name = f"target-{index}"
            self.engines[name] = make_engine(self.model_dir, role_name="target")
            self.servers[name], port = await start_model_server("target", self.engines[name])
            self.addresses[name] = f"127.0.0.1:{port}"
        self.pool = ReplicaPool("target", fixed_replicas(self.addresses), TargetClient, check_interval_s=3600)
        await self.pool.wait_serving(count, timeout=WORK_TIMEOUT_S)
        self.client = PooledTargetClient(self.pool, acquire_timeout_s=1.0)
        return self

    def report(self, name: str, **load) -> None:
        """The replica's GetModelInfo says `load` from now on (its own description, load fields replaced)."""
        engine = self.engines[name]
        describe = type(engine).describe

        def described() -> common_pb2.ModelInfo:
            info = describe(engine)
            for field, value in load.items():
                setattr(info, field, value)
            return info
        engine.describe = described

    def fail_reports(self, name: str) -> None:
        """The replica's GetModelInfo fails (its health service still says SERVING)."""
        def broken() -> common_pb2.ModelInfo:
            raise RuntimeError("describe broke")
        self.engines[name].describe = broken

    def heal_reports(self, name: str) -> None:
        del self.engines[name].describe  # the class's own again

    async def open_elsewhere(self, name: str, count: int) -> None:
        """`count` sessions opened on one replica by another orchestrator (not through this pool)."""
        async with open_channel(self.addresses[name]) as channel:
            other = TargetClient(channel)
            for index in range(count):
                await other.open(f"elsewhere-{name}-{index}", PROMPT, GREEDY, timeout=WORK_TIMEOUT_S)

    async def open(self, *request_ids: str) -> list[str]:
        """Open sessions through the pool at once (a burst); the replica each landed on."""
        await asyncio.gather(*(self.client.open(r, PROMPT, GREEDY, timeout=WORK_TIMEOUT_S) for r in request_ids))
        return [self.client.sessions[r].replica.name for r in request_ids]

    async def stop(self) -> None:
        for request_id in list(self.client.sessions):
            await self.client.close(request_id)
        await self.pool.stop()
        for server in self.servers.values():
            await server.stop(None)


@asynccontextmanager
async def targets(model_dir, count: int = 2):
    pair = await Targets(model_dir).start(count)
    try:
        yield pair
    finally:
        await pair.stop()


async def test_the_pool_reports_serving_as_soon_as_a_replica_it_routes_to_serves(tiny_llama_dir):
    """A replica resolved between refreshes serves at once: health must not lag behind routing."""
    engine = make_engine(tiny_llama_dir, role_name="target")
    server, port = await start_model_server("target", engine)
    pool = ReplicaPool("target", fixed_replicas({"target-0": f"127.0.0.1:{port}"}), TargetClient,
                       check_interval_s=3600)
    reported: list[bool] = []
    pool.on_serving = lambda role, serving: reported.append(serving)
    try:
        await pool.wait_serving(1, timeout=WORK_TIMEOUT_S)  # no refresh runs after the replica resolves
        assert pool.serving and reported[-1] is True, reported
    finally:
        await pool.stop()
        await server.stop(None)


async def test_new_sessions_go_to_the_replica_another_orchestrator_left_idle(tiny_llama_dir):
    async with targets(tiny_llama_dir) as pair:
        await pair.open_elsewhere("target-0", 3)
        await pair.pool.refresh()
        assert pair.pool.replicas["target-0"].load.score == 3.0
        assert await pair.open("a", "b", "c") == ["target-1"] * 3
        # 3 and 3: the tie goes to the most KV left as reported, target-1's (its 3 are not in its report yet)
        assert pair.pool.replicas["target-0"].load.kv_cache_usage > pair.pool.replicas["target-1"].load.kv_cache_usage
        assert await pair.open("d") == ["target-1"]


async def test_a_burst_spreads_before_the_next_poll_and_is_not_counted_twice_after_it(tiny_llama_dir):
    async with targets(tiny_llama_dir) as pair:
        await pair.pool.refresh()
        placed = await pair.open(*"abcdef")
        assert sorted(placed) == ["target-0"] * 3 + ["target-1"] * 3
        assert [r.load.score for r in pair.pool.replicas.values()] == [3.0, 3.0]  # counted since the poll
        await pair.pool.refresh()
        # The replicas now report them open; the count since the poll starts again at 0.
        assert [(r.open_sessions, r.load.score) for r in pair.pool.replicas.values()] == [(3, 3.0), (3, 3.0)]
        for request_id, name in zip("abcdef", placed):
            if name == "target-0":
                await pair.client.close(request_id)
        await pair.pool.refresh()
        assert [r.load.score for r in pair.pool.replicas.values()] == [0.0, 3.0]


@pytest.mark.parametrize("report", [
    {"kv_cache_usage": 1.0},  # its KV budget reserved: a new session would queue
    {"kv_cache_usage": KV_FULL},
    {"waiting_sessions": 1},
    {"kv_cache_usage": math.nan},  # nonsense counts as full
])
async def test_a_full_replica_is_avoided_while_another_has_room(tiny_llama_dir, report):
    async with targets(tiny_llama_dir) as pair:
        pair.report("target-0", **report)  # no sessions open there
        await pair.open_elsewhere("target-1", 4)
        await pair.pool.refresh()
        assert not pair.pool.replicas["target-0"].load.has_room
        assert await pair.open("a", "b") == ["target-1"] * 2
        shown = Pools({"target": pair.pool}).state("target").replicas  # what `specmesh replicas` prints
        assert [(r.name, r.has_room, r.load) for r in shown] == [
            ("target-0", False, report.get("waiting_sessions", 0)),  # no session open there
            ("target-1", True, 6.0)]  # 4 open at the report, 2 routed since
        pair.report("target-1", waiting_sessions=2)  # now both are full: the least work wins
        await pair.pool.refresh()
        assert await pair.open("c") == ["target-0"]


async def test_queued_rows_weigh_as_sessions(tiny_llama_dir):
    async with targets(tiny_llama_dir) as pair:
        pair.report("target-0", queued_rows=int(3 * ROWS_PER_SESSION))  # a long prefill, no session open
        await pair.open_elsewhere("target-1", 2)
        await pair.pool.refresh()
        assert pair.pool.replicas["target-0"].load.score == 3.0
        assert await pair.open("a", "b") == ["target-1", "target-0"]  # 2 < 3, then 3 and 3 (by name)


async def test_a_failing_model_info_takes_only_that_replica_out_of_routing(tiny_llama_dir):
    async with targets(tiny_llama_dir) as pair:
        pair.fail_reports("target-0")
        await pair.pool.refresh()  # does not raise
        assert [r.serving for r in pair.pool.replicas.values()] == [False, True]
        assert await pair.open(*"abc") == ["target-1"] * 3
        pair.heal_reports("target-0")
        await pair.pool.refresh()
        assert await pair.open("d") == ["target-0"]


async def test_a_hanging_model_info_times_out_and_takes_only_that_replica_out(tiny_llama_dir, monkeypatch):
    hanging: set[int] = set()  # ids of the engines whose GetModelInfo never answers
    answer = TargetServicer.GetModelInfo

    async def hang_or_answer(servicer, request, context):
        if id(servicer.engine.engine) in hanging:
            await asyncio.Event().wait()
        return await answer(servicer, request, context)
    monkeypatch.setattr(TargetServicer, "GetModelInfo", hang_or_answer)  # before the servers bind it
    monkeypatch.setattr(pool_module, "CHECK_TIMEOUT_S", 0.5)
    async with targets(tiny_llama_dir) as pair:
        hanging.add(id(pair.engines["target-0"]))
        started = time.monotonic()
        await pair.pool.refresh()
        assert time.monotonic() - started < 5.0  # the poll's deadline, not a hang
        assert [r.serving for r in pair.pool.replicas.values()] == [False, True]
        assert await pair.open(*"ab") == ["target-1"] * 2
        hanging.clear()
        await pair.pool.refresh()
        assert await pair.open("c") == ["target-0"]


async def test_model_info_through_the_pool_places_no_session(tiny_llama_dir):
    async with targets(tiny_llama_dir) as pair:
        await pair.pool.refresh()
        for _ in range(3):
            await pair.client.model_info(timeout=10)
        assert [r.load.score for r in pair.pool.replicas.values()] == [0.0, 0.0]
        assert all(r.routed == 0 for r in pair.pool.replicas.values())


def info(**fields) -> common_pb2.ModelInfo:
    return common_pb2.ModelInfo(model="m", **fields)


@pytest.mark.unit
def test_replica_load_from_a_report():
    assert replica_load(None, 2) == Load(2.0, True)  # no report yet: what was routed there
    load = replica_load(info(open_sessions=3, waiting_sessions=1, queued_rows=16, kv_cache_usage=0.5), 2)
    assert load == Load(3 + 1 + 16 / ROWS_PER_SESSION + 2, False, 0.5)
    assert replica_load(info(open_sessions=1, kv_cache_usage=0.5), 0).has_room
    assert not replica_load(info(kv_cache_usage=1.0), 0).has_room
    assert replica_load(info(kv_cache_usage=-3.0), 0).kv_cache_usage == 0.0
    assert replica_load(info(kv_cache_usage=math.inf), 0) == Load(0.0, False, 1.0)


def room(score: float) -> Load:
    return Load(score, True)


def full(score: float) -> Load:
    return Load(score, False, 1.0)


@pytest.mark.unit
@pytest.mark.parametrize("desired, loads, expected", [
    (2, [room(5), room(4)], 3),  # mean 4.5 > 4: up
    (2, [room(4.5), room(3.75)], 3),  # 4.125 > 4: fractional work counts
    (4, [room(9)] * 4, 4),  # at the maximum
    (3, [room(2), room(1), room(0)], 2),  # 3 fits under half the target on 2 replicas: down
    (3, [room(3), room(3), room(2)], 3),  # 8 would be 4 per replica on 2: stay
    (2, [full(1), full(1)], 3),  # light but no replica has KV room: up
    (2, [full(1), room(0)], 2),  # one has room: no reason to add, none to remove
    (3, [full(0.5), room(0), room(0)], 3),  # down only when every replica has room
    (1, [room(0)], 1),  # at the minimum
    (2, [], 2),  # nothing serving: no figure to act on
])
def test_autoscale_steps_towards_the_load_per_replica_target(desired, loads, expected):
    assert autoscale(desired, 1, 4, loads, load_per_replica=4.0) == expected


@pytest.mark.unit
def test_the_autoscaling_target_has_one_name():
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    assert parser.parse_args([]).load_per_replica == 4.0
    assert parser.parse_args(["--load-per-replica", "2.5"]).load_per_replica == 2.5
    assert parser.parse_known_args(["--sessions-per-replica", "3"])[1] == ["--sessions-per-replica", "3"]
