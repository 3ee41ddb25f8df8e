"""The OpenAI-compatible HTTP API, driven by the `openai` client library against real servers."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from harness import TargetHold, eventually, load, start_stack
from orchestrator.serving.http_api import create_app, start_http_server, stop_http_server
from orchestrator.decoding.request import LoopConfig
from orchestrator.control.build import OrchestratorOptions
from orchestrator.control.build import create_servicer
from specmesh.server.metrics import OrchestratorMetrics
from benchmarks.tiny_models import TINY_PROMPTS


@pytest.fixture
async def served(tiny_llama_dir, tiny_llama_perturbed_dir, device):
    """(stack, the HTTP API's request metrics, base url) with the HTTP API over the stack's services."""
    stack = await start_stack(tiny_llama_dir, tiny_llama_perturbed_dir, k=3, device=device)
    _, tokenizer = load(str(tiny_llama_dir), device)
    metrics = OrchestratorMetrics()
    # The stack's fixed k: the default policy never waits for the draft's prefill, so on a loaded host a
    # short completion could end before the draft is open and draft nothing.
    servicer = await create_servicer(tokenizer, OrchestratorOptions(
        f"127.0.0.1:{stack.target_port}", f"127.0.0.1:{stack.draft_port}",
        loop=LoopConfig(num_speculative_tokens=3, adaptive_k=False)), metrics=metrics)
    server, port, task = await start_http_server(create_app(servicer), "127.0.0.1", 0)
    yield stack, metrics, f"http://127.0.0.1:{port}/v1"
    await stop_http_server(server, task)
    await stack.stop()


@pytest.fixture
async def api(served):
    """(stack, openai client, base url)."""
    stack, _, base = served
    client = openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0)
    yield stack, client, base
    await client.close()


async def test_completion_matches_grpc_and_reports_usage(api, tiny_llama_dir):
    stack, client, _ = api
    prompt = TINY_PROMPTS[0]
    token_ids, text, last = await stack.generate(prompt=prompt, max_tokens=20, temperature=0.0)
    completion = await client.completions.create(model=str(tiny_llama_dir), prompt=prompt, max_tokens=20,
                                                 temperature=0)
    assert completion.choices[0].text == text
    assert completion.choices[0].finish_reason in ("length", "stop")
    assert completion.usage.completion_tokens == len(token_ids)
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + len(token_ids)
    assert completion.model_extra["stats"]["draft_tokens"] > 0


async def test_streamed_completion_equals_unstreamed(api):
    _, client, _ = api
    whole = await client.completions.create(model=None, prompt=TINY_PROMPTS[1], max_tokens=24, temperature=0)
    pieces, finish = [], None
    async for chunk in await client.completions.create(prompt=TINY_PROMPTS[1], max_tokens=24, temperature=0,
                                                       model="", stream=True):
        pieces.append(chunk.choices[0].text)
        finish = chunk.choices[0].finish_reason or finish
    assert "".join(pieces) == whole.choices[0].text and finish == whole.choices[0].finish_reason


async def test_chat_completion_streaming_and_not(api, tiny_llama_dir):
    _, client, _ = api
    messages = [{"role": "user", "content": "write a function"}]
    reply = await client.chat.completions.create(model=str(tiny_llama_dir), messages=messages, max_tokens=16,
                                                 temperature=0)
    assert reply.choices[0].message.role == "assistant" and reply.usage.completion_tokens > 0
    streamed = ""
    async for chunk in await client.chat.completions.create(model=str(tiny_llama_dir), messages=messages,
                                                            max_tokens=16, temperature=0, stream=True):
        streamed += chunk.choices[0].delta.content or ""
    assert streamed == reply.choices[0].message.content


@pytest.mark.parametrize("params, param", [
    ({"temperature": -1}, "temperature"), ({"top_p": 2.0}, "top_p"), ({"max_tokens": 0}, "max_tokens"),
    ({"prompt": ""}, "prompt"), ({"n": 0}, "n"), ({"max_tokens": "many"}, "max_tokens"),
])
async def test_bad_parameters_are_400_naming_the_parameter(api, params, param):
    _, client, _ = api
    fields = {"model": "", "prompt": "hi", "max_tokens": 4, **params}
    with pytest.raises(openai.BadRequestError) as raised:
        await client.completions.create(**fields)
    assert raised.value.status_code == 400 and raised.value.body["param"] == param
    assert raised.value.body["type"] == "invalid_request_error"


async def test_unknown_model_is_404_and_models_lists_the_served_one(api, tiny_llama_dir):
    _, client, _ = api
    with pytest.raises(openai.NotFoundError) as raised:
        await client.completions.create(model="gpt-nope", prompt="hi", max_tokens=4)
    assert raised.value.body["code"] == "model_not_found"
    assert [m.id async for m in client.models.list()] == [str(tiny_llama_dir)]


def requests_in(metrics: OrchestratorMetrics, series: str) -> float:
    return sum(sample.value for family in metrics.registry.collect() for sample in family.samples
               if sample.name == series)


async def hang_up_mid_generation(stack, metrics: OrchestratorMetrics, hold: TargetHold, hang_up) -> None:
    """The target is held while the client hangs up, so the generation cannot finish first: the
    server must see the disconnect and abandon it; then both sessions must be freed."""
    try:
        await hold.wait_held()
        await hang_up()
        async def abandoned() -> bool:
            return requests_in(metrics, "specmesh_requests_running") + \
                requests_in(metrics, "specmesh_requests_waiting") == 0
        await eventually(abandoned)
    finally:
        hold.release()
    assert await stack.wait_sessions_freed() == (0, 0)
    assert requests_in(metrics, "specmesh_requests_total") == 0  # abandoned, never finished


async def test_disconnecting_client_frees_both_sessions(served):
    stack, metrics, base = served
    hold = TargetHold(stack.target_engine)
    async with httpx.AsyncClient(timeout=30) as http:
        body = {"prompt": "def f(x):", "max_tokens": 200, "temperature": 0, "stream": True}
        async with http.stream("POST", f"{base}/completions", json=body) as response:
            # Held in a name: a dropped line iterator is finalized by the loop, which closes the
            # connection, a hang-up of its own before the one under test.
            lines = response.aiter_lines()
            async for line in lines:
                if line.startswith("data: "):
                    break  # one event received: the generation is under way
            assert response.status_code == 200
            await eventually(stack.open_sessions, (1, 1))  # the draft opens its session beside the prefill
            await hang_up_mid_generation(stack, metrics, hold, response.aclose)


async def test_disconnect_during_unstreamed_completion_frees_sessions(served):
    stack, metrics, base = served
    hold = TargetHold(stack.target_engine)
    async with httpx.AsyncClient(timeout=30) as http:
        request = asyncio.ensure_future(http.post(f"{base}/completions", json={
            "prompt": "def f(x):", "max_tokens": 240, "temperature": 0}))
        await eventually(stack.open_sessions, (1, 1))  # the generation is under way

        async def hang_up() -> None:
            request.cancel()
            await asyncio.gather(request, return_exceptions=True)
        await hang_up_mid_generation(stack, metrics, hold, hang_up)
    assert request.cancelled()
