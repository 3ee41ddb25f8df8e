"""The OpenAI parameters in the gRPC API: n, user, and the checks on the new fields."""

from __future__ import annotations

import math

import grpc
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from front_door import bad_request_field
from harness import load, start_stack
from orchestrator.control.build import OrchestratorOptions
from orchestrator.serving.clients import open_channel
from orchestrator.control.build import create_servicer
from specmesh.v1 import common_pb2, generation_pb2, target_pb2, target_pb2_grpc
from benchmarks.tiny_models import TINY_PROMPTS

BAD_REQUESTS = [  # (request fields, the field the error must name)
    ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": math.nan}, "frequency_penalty"),
    ({"frequency_penalty": -math.inf}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"repetition_penalty": 11.0}, "repetition_penalty"),
    ({"logit_bias": {10**6: 1.0}}, "logit_bias"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"logit_bias": {5: 101.0}}, "logit_bias"),
    ({"logit_bias": {5: math.nan}}, "logit_bias"),
    ({"n": 0}, "n"),
    ({"n": 17}, "n"),
    ({"user": "u" * 257}, "user"),
]


@pytest.fixture
async def llama_stack(tiny_llama_dir, tiny_llama_perturbed_dir, device):
    stack = await start_stack(tiny_llama_dir, tiny_llama_perturbed_dir, k=3, device=device)
    yield stack
    await stack.stop()


async def choices(stack, **fields) -> tuple[dict[int, list[int]], dict[int, generation_pb2.GenerateResponse]]:
    """({index: token ids}, {index: last response}) of one Generate call."""
    tokens, last = {}, {}
    async for response in stack.stub.Generate(generation_pb2.GenerateRequest(**fields), timeout=120):
        assert response.index not in last, "a completion sent a response after its last one"
        tokens.setdefault(response.index, []).extend(response.token_ids)
        if response.finish_reason:
            last[response.index] = response
    return tokens, last


async def test_new_fields_are_checked_by_name(llama_stack):
    for fields, field in BAD_REQUESTS:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await llama_stack.generate(prompt="hi", max_tokens=4, **fields)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, fields
        assert bad_request_field(raised.value) == field, fields
    assert (await llama_stack.generate(prompt="hi", max_tokens=4, temperature=0.0))[2].finish_reason


async def test_greedy_n_gives_identical_choices(llama_stack):
    tokens, last = await choices(llama_stack, prompt=TINY_PROMPTS[0], max_tokens=12, temperature=0.0, n=3)
    single, _, _ = await llama_stack.generate(prompt=TINY_PROMPTS[0], max_tokens=12, temperature=0.0)
    assert sorted(tokens) == sorted(last) == [0, 1, 2]
    assert all(tokens[i] == single for i in range(3))
    assert all(last[i].stats.completion_tokens == len(single) for i in range(3))


async def test_seeded_n_samples_with_seed_plus_index(llama_stack):
    fields = {"prompt": TINY_PROMPTS[1], "max_tokens": 16, "temperature": 1.0}
    tokens, _ = await choices(llama_stack, n=3, seed=40, **fields)
    for index in range(3):
        alone, _, _ = await llama_stack.generate(seed=40 + index, **fields)
        assert tokens[index] == alone, index
    assert len({tuple(t) for t in tokens.values()}) > 1


async def test_cancelling_an_n_stream_frees_every_session(llama_stack):
    call = llama_stack.stub.Generate(generation_pb2.GenerateRequest(prompt="def f(x):", max_tokens=200,
                                                                    temperature=1.0, n=3), timeout=60)
    await call.read()
    call.cancel()
    assert await llama_stack.wait_sessions_freed() == (0, 0)


async def test_user_is_recorded_on_the_trace_and_changes_nothing(llama_stack, tiny_llama_dir, device):
    _, tokenizer = load(str(tiny_llama_dir), device)
    servicer = await create_servicer(tokenizer, OrchestratorOptions(
        f"127.0.0.1:{llama_stack.target_port}", f"127.0.0.1:{llama_stack.draft_port}"))
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    fields = {"prompt": TINY_PROMPTS[0], "max_tokens": 8, "temperature": 0.0}
    with provider.get_tracer("test").start_as_current_span("request"):
        with_user = [r async for r in servicer.generate(generation_pb2.GenerateRequest(
            user="alice", n=2, presence_penalty=0.5, **fields))]
    without, _, _ = await llama_stack.generate(presence_penalty=0.5, **fields)
    assert [t for r in with_user if r.index == 0 for t in r.token_ids] == without
    attributes = exporter.get_finished_spans()[0].attributes
    assert attributes["user.id"] == "alice" and attributes["gen_ai.request.choice.count"] == 2
    assert attributes["gen_ai.request.presence_penalty"] == 0.5


@pytest.mark.parametrize("sampling, field", [
    ({"presence_penalty": math.nan}, "sampling.presence_penalty"),
    ({"repetition_penalty": -2.0}, "sampling.repetition_penalty"),
    ({"logit_bias": {3: math.inf}}, "sampling.logit_bias"),
])
async def test_target_refuses_garbage_penalties_from_a_direct_caller(llama_stack, sampling, field):
    target = target_pb2_grpc.TargetServiceStub(open_channel(f"127.0.0.1:{llama_stack.target_port}"))
    request = target_pb2.TargetOpenRequest(request_id="direct", prompt_token_ids=[5, 6, 7],
                                           sampling=common_pb2.SamplingParams(**sampling))
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await target.OpenSession(request, timeout=10)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT and bad_request_field(raised.value) == field
    assert await llama_stack.open_sessions() == (0, 0)
