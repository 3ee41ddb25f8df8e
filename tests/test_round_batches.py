"""Batch-level rounds: every session's round to a replica in one message (VerifyBatches, ProposeBatches).

Real servers over tiny models. A `StepGate` holds a model worker at the first step that verifies (or
drafts for) several sessions at once, so a batch is in flight at a known point however fast the tiny
models are; the fault is applied there, then the worker goes on.
"""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from harness import WORK_TIMEOUT_S, eventually, load, make_engine, start_model_server
from parity import target_greedy
from pools import MAX_TOKENS, Replicas, generation
from benchmarks.tiny_models import TINY_PROMPTS
from orchestrator.serving.clients import DraftClient, TargetClient, UpstreamError
from orchestrator.serving.failover import PooledDraftClient, PooledTargetClient
from specmesh.engine.sampling_params import SamplingParams
from specmesh.server.drain import drain_of
from specmesh.server.grpc_server import stop_server
from specmesh.v1 import target_pb2, target_pb2_grpc
from target_service.server import create_server as create_target_server

MIXED_K = (2, 0, 3, 2)  # drafting sessions beside a target-only one (it decodes ahead)


class StepGate:
    """Holds the engine's worker at the first step that carries decode rows of `sessions` sessions or more,
    until released."""

    def __init__(self, engine, sessions: int = 2):
        self.sessions = sessions
        self.gate, self.held = threading.Event(), threading.Event()
        self.held_sessions: frozenset[str] = frozenset()
        self._run_step = engine.scheduler.run_step
        engine.scheduler.run_step = self._step

    def _step(self, parts):
        decoding = frozenset(part.session.request_id for part in parts if not part.prefill)
        if not self.held.is_set() and len(decoding) >= self.sessions:
            self.held_sessions = decoding
            self.held.set()
            self.gate.wait(2 * WORK_TIMEOUT_S)  # release() ends it; this only bounds a test that never does
        return self._run_step(parts)

    def release(self) -> None:
        self.gate.set()


async def collect(gen) -> list[int]:
    tokens = []
    async for batch in gen.tokens():
        tokens.extend(batch)
    return tokens


def greedy_of(model_dir, prompts) -> list[list[int]]:
    return [list(target_greedy(str(model_dir), "cpu", prompt, MAX_TOKENS)) for prompt in prompts]


async def test_a_batchs_parts_share_a_step_and_a_bad_part_fails_alone(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    steps: list[frozenset[str]] = []
    engine.scheduler.observers.append(lambda parts, ns: steps.append(frozenset(p.session.request_id for p in parts)))
    server, port = await start_model_server("target", engine)
    prompt, drafts = [5, 6, 7, 8], [9, 10]
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            client = TargetClient(channel)
            for session in ("a", "b", "bad", "behind", "twin"):
                await client.open(session, prompt, SamplingParams(0.0), timeout=WORK_TIMEOUT_S)
            position = len(prompt) + 1
            parts = [target_pb2.VerifyRequest(request_id="a", round=1, position=position, draft_token_ids=drafts),
                     target_pb2.VerifyRequest(request_id="bad", round=1, position=position,
                                              draft_token_ids=[engine.vocab_size + 5]),
                     target_pb2.VerifyRequest(request_id="behind", round=1, position=position + 3,
                                              draft_token_ids=drafts),
                     target_pb2.VerifyRequest(request_id="b", round=1, position=position, draft_token_ids=drafts)]
            call = target_pb2_grpc.TargetServiceStub(channel).VerifyBatches(timeout=WORK_TIMEOUT_S)
            await call.write(target_pb2.VerifyBatch(batch_id=7, parts=parts))
            await call.done_writing()
            answered = {}
            async for result in call:
                assert result.batch_id == 7
                answered.update({part.index: part for part in result.parts})
            assert sorted(answered) == [0, 1, 2, 3]
            assert answered[1].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            assert "draft_token_ids" in answered[1].error.message
            assert answered[2].error.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
            twin = await client.verify("twin", 1, position, drafts, [], timeout=WORK_TIMEOUT_S)
            for index in (0, 3):
                assert answered[index].response.accepted_count == twin.accepted_count
                assert answered[index].response.next_token_id == twin.next_token_id
            assert any({"a", "b"} <= step for step in steps)  # one forward verified both parts
            # the refused parts lost nothing: their sessions verify as the twin did
            again = await client.verify("bad", 1, position, drafts, [], timeout=WORK_TIMEOUT_S)
            assert (again.accepted_count, again.next_token_id) == (twin.accepted_count, twin.next_token_id)
    finally:
        await server.stop(None)


async def test_rounds_asked_together_go_out_as_one_batch(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    server, port = await start_model_server("target", engine)
    sessions = [f"s{index}" for index in range(5)]
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            client = TargetClient(channel, round_calls="batch")
            for session in sessions:
                await client.open(session, [5, 6, 7], SamplingParams(0.0), timeout=WORK_TIMEOUT_S)
            verified = await asyncio.gather(*(client.verify(session, 1, 4, [9], [], timeout=WORK_TIMEOUT_S)
                                              for session in sessions))
            assert [v.request_id for v in verified] == sessions
            assert client.batches.batches_sent == 1
            # a part past its deadline fails alone, DEADLINE_EXCEEDED, as its unary call would
            with pytest.raises(UpstreamError) as late:
                await client.verify("s0", 2, 6, [9], [], timeout=0.0)
            assert late.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        await server.stop(None)


async def two_servers(role: str, model_dir, count: int):
    engines = [make_engine(model_dir, role_name=role) for _ in range(count)]
    servers, addresses = {}, {}
    for index, engine in enumerate(engines):
        server, port = await start_model_server(role, engine)
        servers[f"{role}-{index}"], addresses[f"{role}-{index}"] = server, f"127.0.0.1:{port}"
    replicas = Replicas(role, servers, addresses, round_calls="batch")
    await replicas.pool.wait_serving(count, timeout=WORK_TIMEOUT_S)
    return replicas, dict(zip(servers, engines))


async def test_a_replica_lost_with_a_mixed_batch_in_flight_changes_no_output(tiny_llama_dir, tiny_llama_perturbed_dir):
    targets, engines = await two_servers("target", tiny_llama_dir, 2)
    drafts, _ = await two_servers("draft", tiny_llama_perturbed_dir, 1)
    target, draft = PooledTargetClient(targets.pool), PooledDraftClient(drafts.pool)
    gates = {name: StepGate(engine) for name, engine in engines.items()}
    _, tokenizer = load(str(tiny_llama_dir), "cpu")
    prompts = TINY_PROMPTS[:len(MIXED_K)]
    gens = [generation(tokenizer, target, draft, k=k, prompt=prompt) for k, prompt in zip(MIXED_K, prompts)]
    runs = [asyncio.ensure_future(collect(gen)) for gen in gens]
    try:
        await eventually(lambda: any(gate.held.is_set() for gate in gates.values()))
        lost = next(name for name, gate in gates.items() if gate.held.is_set())
        held = gates[lost].held_sessions
        await targets.stop(lost)  # its batch is in flight on the held worker
        for gate in gates.values():
            gate.release()
        outputs = await asyncio.wait_for(asyncio.gather(*runs), WORK_TIMEOUT_S)
        assert outputs == greedy_of(tiny_llama_dir, prompts)
        assert target.failovers >= len(held) >= 2  # every session of the lost batch moved
    finally:
        for gate in gates.values():
            gate.release()
        for run in runs:
            run.cancel()
        await targets.stop_all()
        await drafts.stop_all()
        await targets.pool.stop()
        await drafts.pool.stop()


async def stack_of_two(tiny_llama_dir, tiny_llama_perturbed_dir):
    """A target server (with its health servicer, to drain it) and a draft server; batch clients to both."""
    target_engine, draft_engine = make_engine(tiny_llama_dir), make_engine(tiny_llama_perturbed_dir, role_name="draft")
    target_server, target_port, health = await create_target_server(target_engine)
    draft_server, draft_port = await start_model_server("draft", draft_engine)
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}") for port in (target_port, draft_port)]
    clients = TargetClient(channels[0], round_calls="batch"), DraftClient(channels[1], round_calls="batch")
    return (target_engine, draft_engine), (target_server, health, draft_server), channels, clients


async def test_a_request_cancelled_inside_a_batch_leaves_the_others_whole(tiny_llama_dir, tiny_llama_perturbed_dir):
    engines, (target_server, _, draft_server), channels, (target, draft) = await stack_of_two(
        tiny_llama_dir, tiny_llama_perturbed_dir)
    gate = StepGate(engines[0])
    _, tokenizer = load(str(tiny_llama_dir), "cpu")
    prompts = TINY_PROMPTS[:3]
    gens = [generation(tokenizer, target, draft, k=2, prompt=prompt) for prompt in prompts]
    runs = [asyncio.ensure_future(collect(gen)) for gen in gens]
    try:
        await eventually(gate.held.is_set)
        cancelled = next(index for index, gen in enumerate(gens) if gen.session_id in gate.held_sessions)
        runs[cancelled].cancel()  # its part is in the held step, beside another's
        gate.release()
        kept = [index for index in range(len(gens)) if index != cancelled]
        done = await asyncio.wait_for(asyncio.gather(*(runs[index] for index in kept)), WORK_TIMEOUT_S)
        expected = greedy_of(tiny_llama_dir, prompts)
        assert done == [expected[index] for index in kept]
        assert runs[cancelled].cancelled()
        await eventually(lambda: not engines[0].sessions and not engines[1].sessions)  # the cancelled one's too
    finally:
        gate.release()
        for server in (target_server, draft_server):
            await server.stop(None)
        for channel in channels:
            await channel.close()


async def test_a_drain_with_a_batch_in_flight_finishes_its_sessions(tiny_llama_dir, tiny_llama_perturbed_dir):
    engines, (target_server, health, draft_server), channels, (target, draft) = await stack_of_two(
        tiny_llama_dir, tiny_llama_perturbed_dir)
    gate = StepGate(engines[0])
    _, tokenizer = load(str(tiny_llama_dir), "cpu")
    prompts = TINY_PROMPTS[:3]
    runs = [asyncio.ensure_future(collect(generation(tokenizer, target, draft, k=2, prompt=prompt)))
            for prompt in prompts]
    stopping = None
    try:
        await eventually(gate.held.is_set)
        stopping = asyncio.ensure_future(stop_server(target_server, health, 60.0))
        await eventually(lambda: drain_of(target_server).draining)
        with pytest.raises(Exception) as refused:  # new sessions are turned away meanwhile
            await target.open("new", [5, 6, 7], SamplingParams(0.0), timeout=WORK_TIMEOUT_S)
        assert refused.value.code == grpc.StatusCode.UNAVAILABLE
        gate.release()
        outputs = await asyncio.wait_for(asyncio.gather(*runs), WORK_TIMEOUT_S)
        assert outputs == greedy_of(tiny_llama_dir, prompts)
        await asyncio.wait_for(stopping, WORK_TIMEOUT_S)  # the open batch stream does not hold the drain
        assert not engines[0].sessions
    finally:
        gate.release()
        if stopping is not None and not stopping.done():
            stopping.cancel()
        await target_server.stop(None)
        await draft_server.stop(None)
        for channel in channels:
            await channel.close()
