"""KV memory managed by reservation: admission, a FIFO queue, RESOURCE_EXHAUSTED past its limits, metrics.

Real grpc.aio target servers over tiny models, with budgets sized in tokens of the model's own KV.
"""

from __future__ import annotations

import argparse
import asyncio
import threading

import grpc
import pytest

from engine_helpers import feed_uncached
from front_door import assert_openai_error, open_front_door
from harness import WORK_TIMEOUT_S, TargetHold, eventually, load, make_engine, start_model_server, start_stack
from orchestrator.serving.failover import PooledTargetClient
from parity import target_greedy
from pools import MAX_TOKENS as FAILOVER_MAX_TOKENS, PROMPT as FAILOVER_PROMPT, Replicas, generation, placed
from specmesh.engine.model_engine import EngineConfig, ModelEngine
from specmesh.engine.kv_budget import (KVBudget, KVCacheMemory, available_memory, kv_bytes_per_token,
                                       parse_kv_cache_memory)
from specmesh.server.metrics import ServiceMetrics
from specmesh.roles import MAX_DRAFT_TOKENS
from specmesh.engine.sampling_params import SamplingParams
from specmesh.server.service import add_service_arguments
from specmesh.v1 import common_pb2, target_pb2, target_pb2_grpc
from benchmarks.tiny_models import TINY_PROMPTS
from orchestrator.serving.clients import open_channel

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]  # 10 tokens


def budget_engine(model_dir, device: str, tokens: int, max_waiting: int = 4) -> ModelEngine:
    """A target engine whose KV budget holds `tokens` tokens of its model (given to it in bytes); caches grow
    as sessions decode (graph steps off: with them a session reserves a whole slot, tests/test_graph_steps.py)."""
    model, tokenizer = load(str(model_dir), device)
    memory = KVCacheMemory(bytes=tokens * kv_bytes_per_token(model))
    return ModelEngine(model, tokenizer, EngineConfig(model_name=str(model_dir), kv_cache_memory=memory,
                                                      max_waiting_sessions=max_waiting, graph_steps="off"))


@pytest.fixture
async def target(tiny_llama_dir, device):
    """(engine with a 100-token budget and a queue of 2, its metrics, a TargetService stub)."""
    engine = budget_engine(tiny_llama_dir, device, tokens=100, max_waiting=2)
    metrics = ServiceMetrics.for_engine("target", engine)
    server, port = await start_model_server("target", engine)
    channel = open_channel(f"127.0.0.1:{port}")
    yield engine, metrics, target_pb2_grpc.TargetServiceStub(channel)
    await channel.close()
    await server.stop(None)


def open_call(stub, request_id: str, max_new_tokens: int, timeout: float = 30):
    return stub.OpenSession(target_pb2.TargetOpenRequest(request_id=request_id, prompt_token_ids=PROMPT,
                                                         max_new_tokens=max_new_tokens), timeout=timeout)


def close_call(stub, request_id: str):
    return stub.CloseSession(common_pb2.CloseSessionRequest(request_id=request_id), timeout=10)


@pytest.mark.unit
@pytest.mark.parametrize("text, wanted", [
    ("2GiB", KVCacheMemory(bytes=2 * 2**30)), ("512MiB", KVCacheMemory(bytes=512 * 2**20)),
    ("1.5 GB", KVCacheMemory(bytes=1_500_000_000)), ("1500000000", KVCacheMemory(bytes=1_500_000_000)),
    ("0.5", KVCacheMemory(fraction=0.5)), ("1", KVCacheMemory(fraction=1.0)), ("64kib", KVCacheMemory(bytes=65536)),
])
def test_kv_cache_memory_parses_bytes_and_fractions(text, wanted):
    assert parse_kv_cache_memory(text) == wanted


@pytest.mark.unit
@pytest.mark.parametrize("text", ["", "lots", "-1", "0", "0GiB", "2.5", "3 parsecs", "0.5.1", "nan"])
def test_a_bad_kv_cache_memory_is_a_clear_flag_error(text, capsys):
    parser = argparse.ArgumentParser()
    add_service_arguments(parser, default_model="m")
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-memory", text])
    assert "--kv-cache-memory" in capsys.readouterr().err


@pytest.mark.unit
@pytest.mark.parametrize("model_fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_bytes_per_token_is_what_the_cache_holds(request, model_fixture, device):
    """The formula against a real cache: n tokens fed hold n x bytes-per-token of keys and values."""
    engine = budget_engine(request.getfixturevalue(model_fixture), device, tokens=1000)
    session = engine.new_session("r", PROMPT, SamplingParams())
    feed_uncached(engine, session)
    held = sum(t.nelement() * t.element_size() for layer in session.cache.layers for t in (layer.keys, layer.values))
    assert held == session.cached_length * engine.kv.bytes_per_token and session.cached_length == len(PROMPT)
    assert engine.kv.capacity == 1000


@pytest.mark.unit
def test_a_fraction_is_of_the_devices_free_memory(tiny_llama_dir, device):
    """0.5: half the free memory of the model's device (CUDA), or half the RAM available (CPU)."""
    model, tokenizer = load(str(tiny_llama_dir), device)
    engine = ModelEngine(model, tokenizer, EngineConfig(model_name="m", kv_cache_memory=KVCacheMemory(fraction=0.5),
                                                        graph_steps="off"))  # off: no allocation moves `free`
    free = available_memory([engine.device])
    assert 0.4 * free <= engine.kv.capacity * engine.kv.bytes_per_token <= 0.6 * free


@pytest.mark.unit
def test_a_budget_that_holds_no_token_stops_the_service_from_starting(tiny_llama_dir, device):
    with pytest.raises(ValueError, match="holds no token"):
        budget_engine(tiny_llama_dir, device, tokens=0)


async def test_sessions_that_fit_are_admitted_and_counted(target):
    engine, metrics, stub = target
    await open_call(stub, "a", max_new_tokens=30)  # 10 + 30 = 40 tokens
    await open_call(stub, "b", max_new_tokens=50)  # 60: exactly the rest of the budget
    assert engine.kv.reserved == {"a": 40, "b": 60}
    info = await stub.GetModelInfo(common_pb2.ModelInfoRequest(), timeout=10)
    assert (info.running_sessions, info.waiting_sessions, info.kv_cache_usage) == (2, 0, pytest.approx(1.0))
    sample = lambda name: metrics.registry.get_sample_value(name, metrics.labels)  # noqa: E731
    assert (sample("specmesh_kv_cache_usage_perc"), sample("specmesh_kv_cache_budget_tokens")) == (1.0, 100)
    assert (sample("specmesh_num_requests_running"), sample("specmesh_num_requests_waiting")) == (2, 0)
    assert (await close_call(stub, "a")).closed
    info = await stub.GetModelInfo(common_pb2.ModelInfoRequest(), timeout=10)
    assert (info.running_sessions, info.kv_cache_usage) == (1, pytest.approx(0.6))


async def test_a_session_that_does_not_fit_waits_until_one_closes(target):
    engine, metrics, stub = target
    await open_call(stub, "a", max_new_tokens=60)  # 70 of 100
    waiting = asyncio.ensure_future(open_call(stub, "b", max_new_tokens=40))  # 50: does not fit yet
    await eventually(lambda: engine.kv.waiting, 1)
    info = await stub.GetModelInfo(common_pb2.ModelInfoRequest(), timeout=10)
    assert (info.running_sessions, info.waiting_sessions) == (1, 1) and not waiting.done()
    assert metrics.registry.get_sample_value("specmesh_num_requests_waiting", metrics.labels) == 1
    assert "b" not in engine.sessions
    await close_call(stub, "a")
    opened = await waiting
    assert opened.committed_length == len(PROMPT) + 1 and engine.kv.reserved == {"b": 50}


async def test_waiters_are_admitted_first_come_first_served(target):
    """A large waiter is not overtaken by a small one that arrived after it and would fit."""
    engine, _, stub = target
    await open_call(stub, "a", max_new_tokens=50)  # 60
    large = asyncio.ensure_future(open_call(stub, "large", max_new_tokens=80))  # 90
    await eventually(lambda: engine.kv.waiting, 1)
    small = asyncio.ensure_future(open_call(stub, "small", max_new_tokens=10))  # 20 would fit now, but waits
    await eventually(lambda: engine.kv.waiting, 2)
    await close_call(stub, "a")
    await large
    assert not small.done() and engine.kv.waiting == 1
    await close_call(stub, "large")
    await small


async def test_a_full_queue_refuses_at_once_naming_the_limit(target):
    engine, _, stub = target
    await open_call(stub, "a", max_new_tokens=90)  # the whole budget
    waiters = [asyncio.ensure_future(open_call(stub, f"w{i}", max_new_tokens=10)) for i in range(2)]
    await eventually(lambda: engine.kv.waiting, 2)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await open_call(stub, "third", max_new_tokens=10)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--max-waiting-sessions 2" in refused.value.details()
    await close_call(stub, "a")
    await asyncio.gather(*waiters)
    assert set(engine.kv.reserved) == {"w0", "w1"}


async def test_a_session_larger_than_the_budget_is_refused_at_once(target):
    engine, _, stub = target
    # 0, or more than the window holds: the whole context window
    for max_new_tokens, needs in ((91, 101), (0, engine.context_window), (2**32 - 1, engine.context_window)):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await open_call(stub, "huge", max_new_tokens=max_new_tokens)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"needs {needs} tokens of KV, budget is 100" in refused.value.details()
    assert engine.kv.reserved == {} and engine.kv.waiting == 0 and not engine.sessions


async def test_bad_requests_fail_before_they_wait(target):
    engine, _, stub = target
    await open_call(stub, "a", max_new_tokens=90)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.OpenSession(target_pb2.TargetOpenRequest(request_id="bad", prompt_token_ids=[10**6],
                                                            max_new_tokens=5), timeout=10)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and engine.kv.waiting == 0


async def test_a_cancelled_waiter_leaves_the_queue_and_holds_nothing(target):
    engine, _, stub = target
    await open_call(stub, "a", max_new_tokens=60)
    call = open_call(stub, "gone", max_new_tokens=40)
    await eventually(lambda: engine.kv.waiting, 1)
    call.cancel()
    await eventually(lambda: engine.kv.waiting, 0)
    with pytest.raises(grpc.aio.AioRpcError) as timed_out:  # a waiter whose deadline nears leaves too, saying why
        await open_call(stub, "late", max_new_tokens=40, timeout=2.0)
    assert timed_out.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "tokens of KV: the budget of 100 stayed full" in timed_out.value.details()
    await eventually(lambda: engine.kv.waiting, 0)
    await close_call(stub, "a")
    assert engine.kv.reserved == {} and not engine.sessions
    await open_call(stub, "all", max_new_tokens=90)  # the whole budget is free again


@pytest.mark.unit
async def test_a_waiter_cancelled_just_as_it_is_granted_gives_its_reservation_back():
    budget = KVBudget(capacity_tokens=10)
    await budget.reserve("a", 10)
    waiter = asyncio.ensure_future(budget.reserve("b", 10))
    await eventually(lambda: budget.waiting, 1)
    budget.release("a")  # grants b at once, before b's task resumes ...
    assert budget.reserved == {"b": 10}
    waiter.cancel()  # ... and b's caller gives up before it sees the grant
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert budget.reserved == {} and budget.waiting == 0


async def test_reaping_an_idle_session_frees_its_room_for_a_waiter(target):
    engine, _, stub = target
    await open_call(stub, "idle", max_new_tokens=80)
    waiting = asyncio.ensure_future(open_call(stub, "next", max_new_tokens=80))
    await eventually(lambda: engine.kv.waiting, 1)
    assert engine.reap_idle(0.0) == ["idle"]
    await waiting
    assert engine.kv.reserved == {"next": 90}


async def test_resume_reserves_the_committed_sequence_and_what_is_left(target):
    engine, _, stub = target
    committed = PROMPT + [20, 21, 22]
    await stub.OpenSession(target_pb2.TargetOpenRequest(request_id="moved", prompt_token_ids=committed,
                                                        resume=True, max_new_tokens=7), timeout=10)
    assert engine.kv.reserved == {"moved": 20}


async def test_http_429_when_the_target_queue_is_full_then_200_once_it_frees(tiny_llama_dir,
                                                                             tiny_llama_perturbed_dir, device):
    stack = await start_stack(tiny_llama_dir, tiny_llama_perturbed_dir, k=2, device=device)
    stack.target_engine.kv = KVBudget(capacity_tokens=200, max_waiting=0)  # full means refused
    door = await open_front_door(stack, tiny_llama_dir, device)
    try:
        await stack.target_engine.kv.reserve("occupier", 200)
        body = {"model": str(tiny_llama_dir), "prompt": TINY_PROMPTS[0], "max_tokens": 8, "temperature": 0}
        error = assert_openai_error(await door.http.post("/v1/completions", json=body), 429)
        assert "--max-waiting-sessions 0" in error["message"]
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stack.generate(prompt=TINY_PROMPTS[0], max_tokens=8)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        stack.target_engine.kv.release("occupier")
        response = await door.http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        await eventually(lambda: stack.target_engine.kv.reserved, {})
    finally:
        await door.close()
        await stack.stop()


async def test_http_429_when_one_request_needs_more_than_the_budget(tiny_llama_dir, device):
    stack = await start_stack(tiny_llama_dir, device=device)
    stack.target_engine.kv = KVBudget(capacity_tokens=20)
    door = await open_front_door(stack, tiny_llama_dir, device)
    try:
        body = {"model": str(tiny_llama_dir), "prompt": TINY_PROMPTS[0], "max_tokens": 8}
        error = assert_openai_error(await door.http.post("/v1/completions", json=body), 429)
        assert "tokens of KV, budget is 20" in error["message"]
    finally:
        await door.close()
        await stack.stop()


async def test_greedy_output_is_unchanged_when_sessions_waited(tiny_llama_dir, tiny_llama_perturbed_dir, device):
    """Room for one request at a time: the others queue, then each output is the target's own greedy one."""
    stack = await start_stack(tiny_llama_dir, tiny_llama_perturbed_dir, k=3, device=device)
    max_tokens, prompts = 16, TINY_PROMPTS[:3]
    _, tokenizer = load(str(tiny_llama_dir), device)
    # What the orchestrator reserves in each service: the prompt, max_tokens and one round's drafts and bonus.
    needs = [len(tokenizer.encode(p)) + max_tokens + MAX_DRAFT_TOKENS + 1 for p in prompts]
    stack.target_engine.kv = KVBudget(capacity_tokens=max(needs))
    try:
        async with TargetHold(stack.target_engine) as hold:  # the first request holds the whole budget
            first = asyncio.ensure_future(stack.generate(prompt=prompts[0], max_tokens=max_tokens, temperature=0.0))
            await hold.wait_held()
            others = [asyncio.ensure_future(stack.generate(prompt=p, max_tokens=max_tokens, temperature=0.0))
                      for p in prompts[1:]]
            await eventually(lambda: stack.target_engine.kv.waiting, 2)
            assert list(stack.target_engine.kv.reserved.values()) == needs[:1]
            # The draft opens a session once the target's first token is out: nothing for the waiting ones.
            await eventually(lambda: list(stack.draft_engine.kv.reserved.values()), needs[:1])
            assert stack.target_engine.kv.waiting == 2
        outputs = await asyncio.gather(first, *others)
        for prompt, (token_ids, _, _) in zip(prompts, outputs):
            assert tuple(token_ids) == target_greedy(str(tiny_llama_dir), device, prompt, max_tokens)
    finally:
        await stack.stop()


async def test_a_session_moved_to_another_target_replica_reserves_the_same_room(tiny_llama_dir):
    """Failover re-opens with what is left of max_new_tokens: the new replica's reservation equals the lost one's."""
    engines = [make_engine(tiny_llama_dir) for _ in range(2)]
    servers, addresses = {}, {}
    for index, engine in enumerate(engines):
        servers[f"target-{index}"], port = await start_model_server("target", engine)
        addresses[f"target-{index}"] = f"127.0.0.1:{port}"
    replicas = Replicas("target", servers, addresses)
    await replicas.pool.wait_serving(2, timeout=WORK_TIMEOUT_S)
    target = PooledTargetClient(replicas.pool)
    _, tokenizer = load(str(tiny_llama_dir), "cpu")
    gen = generation(tokenizer, target, None, k=0)
    limit = len(tokenizer.encode(FAILOVER_PROMPT)) + FAILOVER_MAX_TOKENS + MAX_DRAFT_TOKENS + 1
    try:
        async for _ in gen.tokens():
            if gen.stats.rounds == 2:
                lost = int(placed(target, gen)[-1])
                assert engines[lost].kv.reserved == {gen.session_id: limit}
                await replicas.stop(f"target-{lost}")
            if gen.stats.rounds == 3:
                assert engines[1 - lost].kv.reserved == {gen.session_id: limit}
        assert target.failovers == 1
    finally:
        await replicas.stop_all()
        await replicas.pool.stop()


async def test_a_burst_stays_within_the_budget_and_every_output_is_the_targets(tiny_llama_dir,
                                                                             tiny_llama_perturbed_dir, device):
    """64 concurrent greedy requests, room for 4 at a time in each service: the KV the sessions' caches hold
    never exceeds the budget, some requests wait, none is refused, every output is the target's own."""
    stack = await start_stack(tiny_llama_dir, tiny_llama_perturbed_dir, k=3, device=device)
    max_tokens, prompts = 12, [TINY_PROMPTS[i % len(TINY_PROMPTS)] for i in range(64)]
    _, tokenizer = load(str(tiny_llama_dir), device)
    room = 4 * (max(len(tokenizer.encode(p)) for p in prompts) + max_tokens + MAX_DRAFT_TOKENS + 1)
    engines = [stack.target_engine, stack.draft_engine]
    for engine in engines:
        engine.kv = KVBudget(capacity_tokens=room, bytes_per_token=kv_bytes_per_token(engine.model))
    held, waited, done = [0, 0], [0, 0], asyncio.Event()

    async def watch() -> None:  # samples, never synchronises: the burst runs whatever it sees
        while not done.is_set():
            for index, engine in enumerate(engines):
                held[index] = max(held[index], sum(s.cached_length for s in list(engine.sessions.values())))
                waited[index] = max(waited[index], engine.kv.waiting)
            await asyncio.sleep(0.005)
    watcher = asyncio.ensure_future(watch())
    try:
        outputs = await asyncio.gather(*(stack.generate(prompt=p, max_tokens=max_tokens, temperature=0.0)
                                         for p in prompts))
    finally:
        done.set()
        await watcher
        await stack.stop()
    for prompt, (token_ids, _, _) in zip(prompts, outputs):
        assert tuple(token_ids) == target_greedy(str(tiny_llama_dir), device, prompt, max_tokens)
    assert 0 < held[0] <= room and held[1] <= room and waited[0] > 0, (held, waited, room)


async def test_a_prefill_that_would_end_past_its_deadline_is_refused_at_once(tiny_llama_dir, device):
    """Admission by expected wait: behind the prompt rows already queued, at the rate prefills have
    been going in, this one would end past its call's deadline, so it is refused now (and holds no
    room) rather than prefilled in part and timed out; with time enough, the next one is admitted."""
    engine = budget_engine(tiny_llama_dir, device, tokens=1000)
    server, port = await start_model_server("target", engine)
    gate = threading.Event()
    held = asyncio.ensure_future(engine.run(gate.wait, 30))  # the worker is busy: prefills queue up
    try:
        async with open_channel(f"127.0.0.1:{port}") as channel:
            stub = target_pb2_grpc.TargetServiceStub(channel)
            queued = asyncio.ensure_future(stub.OpenSession(target_pb2.TargetOpenRequest(
                request_id="long", prompt_token_ids=list(range(5, 125)), max_new_tokens=8), timeout=60))
            await eventually(lambda: engine.queued_prefill_rows(), 119)
            engine.prefill_rate.observe(prefill_rows=10, seconds=1.0)  # as measured: 10 prompt rows a second
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.OpenSession(target_pb2.TargetOpenRequest(
                    request_id="late", prompt_token_ids=PROMPT, max_new_tokens=8), timeout=5)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "119 prompt tokens are queued ahead" in refused.value.details()
            assert "late" not in engine.kv.reserved and "late" not in engine.sessions
            admitted = asyncio.ensure_future(stub.OpenSession(target_pb2.TargetOpenRequest(
                request_id="patient", prompt_token_ids=PROMPT, max_new_tokens=8), timeout=60))
            gate.set()
            assert (await queued).committed_length == 121 and (await admitted).committed_length == len(PROMPT) + 1
    finally:
        gate.set()
        await held
        await server.stop(None)
