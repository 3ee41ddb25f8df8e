"""Bad input, fallback when the draft fails, cancellation, determinism, health and reflection."""

from __future__ import annotations

import asyncio
import math

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from front_door import bad_request_field
from harness import TargetHold, eventually, load, make_engine, start_model_server, start_stack
from orchestrator.control.build import OrchestratorOptions
from orchestrator.serving.backends import TokenizerMismatch
from orchestrator.control.build import create_server
from parity import target_greedy
from specmesh.v1 import generation_pb2
from benchmarks.tiny_models import TINY_PROMPTS
from orchestrator.serving.clients import open_channel

BAD_REQUESTS = [  # (request fields, the field the error must name)
    ({"prompt": ""}, "prompt"),
    ({"prompt": "hi", "prompt_token_ids": [5]}, "prompt"),
    ({"prompt_token_ids": [5, 10**6]}, "prompt_token_ids"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": -3}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 10**6}, "max_tokens"),
    ({"prompt": "hi", "temperature": math.nan}, "temperature"),
    ({"prompt": "hi", "temperature": math.inf}, "temperature"),
    ({"prompt": "hi", "temperature": -0.5}, "temperature"),
    ({"prompt": "hi", "top_p": 0.0}, "top_p"),
    ({"prompt": "hi", "top_p": 1.5}, "top_p"),
    ({"prompt": "hi", "top_k": -1}, "top_k"),
    ({"prompt": "hi", "num_speculative_tokens": 33}, "num_speculative_tokens"),
    ({"prompt": "hi", "num_speculative_tokens": -1}, "num_speculative_tokens"),
    ({"prompt": "hi", "stop": [""]}, "stop"),
]


@pytest.fixture
async def llama_stack(tiny_llama_dir, tiny_llama_perturbed_dir, device):
    stack = await start_stack(tiny_llama_dir, tiny_llama_perturbed_dir, k=3, device=device)
    yield stack
    await stack.stop()


async def test_bad_requests_name_the_field_and_leave_other_streams_alone(llama_stack, tiny_llama_dir, device):
    prompt = TINY_PROMPTS[0]
    long_stream = asyncio.ensure_future(llama_stack.generate(prompt=prompt, max_tokens=48, temperature=0.0))
    for fields, field in BAD_REQUESTS:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await llama_stack.generate(**fields)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, fields
        assert field in raised.value.details() and bad_request_field(raised.value) == field, fields
    token_ids, _, last = await long_stream
    assert tuple(token_ids) == target_greedy(str(tiny_llama_dir), device, prompt, 48)
    assert (await llama_stack.generate(prompt=prompt, max_tokens=4, temperature=0.0))[2].finish_reason


async def test_draft_server_stopped_mid_generation_completes_identically(
        tiny_llama_dir, tiny_llama_perturbed_dir, device):
    stack = await start_stack(tiny_llama_dir, tiny_llama_perturbed_dir, k=2, device=device)
    prompt, token_ids = TINY_PROMPTS[1], []
    try:
        request = generation_pb2.GenerateRequest(prompt=prompt, max_tokens=60, temperature=0.0)
        async for response in stack.stub.Generate(request, timeout=60):
            token_ids.extend(response.token_ids)
            if "draft" in stack.servers and len(token_ids) >= 6:
                await stack.servers.pop("draft").stop(None)  # the draft dies mid-generation
            last = response
    finally:
        await stack.stop()
    assert tuple(token_ids) == target_greedy(str(tiny_llama_dir), device, prompt, 60)
    assert last.stats.draft_fallback and last.stats.draft_tokens > 0


async def test_slow_draft_falls_back_to_target_only(tiny_llama_dir, tiny_llama_perturbed_dir, device):
    stack = await start_stack(tiny_llama_dir, tiny_llama_perturbed_dir, k=4, device=device,
                              draft_timeout_s=1e-4)  # no draft round can finish in time
    try:
        token_ids, _, last = await stack.generate(prompt=TINY_PROMPTS[2], max_tokens=20, temperature=0.0)
    finally:
        await stack.stop()
    assert tuple(token_ids) == target_greedy(str(tiny_llama_dir), device, TINY_PROMPTS[2], 20)
    assert last.stats.draft_fallback and last.stats.draft_tokens == 0
    assert last.stats.target_forward_passes == len(token_ids)


async def test_cancelled_stream_frees_both_sessions(llama_stack):
    async with TargetHold(llama_stack.target_engine) as hold:  # the stream stalls after its prefill
        call = llama_stack.stub.Generate(generation_pb2.GenerateRequest(prompt="def f(x):", max_tokens=200,
                                                                        temperature=0.0), timeout=60)
        await call.read()
        await hold.wait_held()
        await eventually(llama_stack.open_sessions, (1, 1))  # the draft opens its session beside the prefill
        call.cancel()
    assert await llama_stack.wait_sessions_freed() == (0, 0)


async def test_finished_generation_frees_both_sessions(llama_stack):
    await llama_stack.generate(prompt="hello", max_tokens=5, temperature=0.0)
    assert await llama_stack.wait_sessions_freed() == (0, 0)


async def test_seeded_sampling_is_reproducible(llama_stack):
    runs = [await llama_stack.generate(prompt="The cat", max_tokens=24, temperature=1.0, seed=seed)
            for seed in (7, 7, 8)]
    assert runs[0][0] == runs[1][0]
    assert runs[0][0] != runs[2][0]


async def test_max_tokens_and_stats(llama_stack):
    token_ids, text, last = await llama_stack.generate(prompt="hello", max_tokens=17, temperature=0.0)
    stats = last.stats
    assert last.finish_reason in (generation_pb2.FINISH_REASON_LENGTH, generation_pb2.FINISH_REASON_STOP)
    assert stats.completion_tokens == len(token_ids) <= 17
    assert stats.accepted_tokens <= stats.draft_tokens
    assert stats.target_forward_passes == stats.rounds + 1
    assert len(token_ids) == 1 + stats.accepted_tokens + stats.rounds  # one recovered/bonus per round
    assert stats.e2e_ms >= stats.ttft_ms > 0


async def test_stop_string_ends_generation_without_it(llama_stack):
    full_ids, full_text, _ = await llama_stack.generate(prompt=TINY_PROMPTS[3], max_tokens=40, temperature=0.0)
    stop = full_text[10:13]
    token_ids, text, last = await llama_stack.generate(prompt=TINY_PROMPTS[3], max_tokens=40, temperature=0.0,
                                                       stop=[stop])
    assert text == full_text[: full_text.index(stop)]
    assert last.finish_reason == generation_pb2.FINISH_REASON_STOP
    assert token_ids == full_ids[: len(token_ids)] and len(token_ids) < len(full_ids)


async def test_health_and_reflection(llama_stack):
    channel = open_channel(f"127.0.0.1:{llama_stack.port}")
    health = health_pb2_grpc.HealthStub(channel)
    reply = await health.Check(health_pb2.HealthCheckRequest(service="specmesh.v1.Generation"), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    async for answer in reflection.ServerReflectionInfo(iter([request])):
        names = {s.name for s in answer.list_services_response.service}
    assert "specmesh.v1.Generation" in names and "grpc.health.v1.Health" in names
    await channel.close()


async def test_draft_with_another_vocabulary_is_refused(tiny_llama_dir, other_vocab_model_dir, device):
    stack = await start_stack(tiny_llama_dir, None, device=device)
    try:
        server, port = await start_model_server("draft", make_engine(other_vocab_model_dir, device, "draft"))
        _, tokenizer = load(str(tiny_llama_dir), device)
        options = OrchestratorOptions(f"127.0.0.1:{stack.target_port}", f"127.0.0.1:{port}")
        with pytest.raises(TokenizerMismatch, match="different tokenizer vocabularies"):
            await create_server(tokenizer, options)
        await server.stop(None)
    finally:
        await stack.stop()


async def test_clients_may_reuse_a_request_id(llama_stack):
    runs = await asyncio.gather(*(llama_stack.generate(prompt=p, max_tokens=12, temperature=0.0, request_id="same")
                                  for p in TINY_PROMPTS[:3]))
    assert all(len(token_ids) == 12 for token_ids, _, _ in runs)
    assert {last.request_id for _, _, last in runs} == {"same"}
