"""The OpenAI parameters clients send, through the official `openai` client against the real stack."""

from __future__ import annotations

import openai
import pytest

from harness import load, start_stack
from orchestrator.control.build import OrchestratorOptions
from orchestrator.serving.http_api import create_app, start_http_server, stop_http_server
from orchestrator.control.build import create_servicer
from specmesh.v1 import generation_pb2
from benchmarks.tiny_models import TINY_PROMPTS

PROMPT = TINY_PROMPTS[0]
MESSAGES = [{"role": "user", "content": "write a function"}]


@pytest.fixture
async def api(tiny_llama_dir, tiny_llama_perturbed_dir, device):
    """(stack, openai client, base url): the HTTP API over a real stack, as in test_http_api."""
    stack = await start_stack(tiny_llama_dir, tiny_llama_perturbed_dir, k=3, device=device)
    _, tokenizer = load(str(tiny_llama_dir), device)
    servicer = await create_servicer(tokenizer, OrchestratorOptions(
        f"127.0.0.1:{stack.target_port}", f"127.0.0.1:{stack.draft_port}"))
    server, port, task = await start_http_server(create_app(servicer), "127.0.0.1", 0)
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    yield stack, client, f"http://127.0.0.1:{port}/v1"
    await client.close()
    await stop_http_server(server, task)
    await stack.stop()


async def grpc_logprobs(stack, **fields) -> list:
    request = generation_pb2.GenerateRequest(logprobs=True, **fields)
    return [entry async for response in stack.stub.Generate(request, timeout=60) for entry in response.logprobs]


async def test_completion_logprobs_are_the_targets(api):
    stack, client, _ = api
    completion = await client.completions.create(model="", prompt=PROMPT, max_tokens=12, temperature=0, logprobs=3)
    logprobs = completion.choices[0].logprobs
    expected = await grpc_logprobs(stack, prompt=PROMPT, max_tokens=12, temperature=0.0, top_logprobs=3)
    assert "".join(logprobs.tokens) == completion.choices[0].text
    assert logprobs.token_logprobs == pytest.approx([entry.logprob for entry in expected], abs=1e-5)
    assert all(1 <= len(top) <= 3 and max(top.values()) >= chosen
               for top, chosen in zip(logprobs.top_logprobs, logprobs.token_logprobs))
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)
    streamed = {"tokens": [], "text_offset": []}
    async for chunk in await client.completions.create(model="", prompt=PROMPT, max_tokens=12, temperature=0,
                                                       logprobs=3, stream=True):
        chunk_logprobs = chunk.choices[0].logprobs
        for key in streamed:
            streamed[key] += getattr(chunk_logprobs, key) if chunk_logprobs else []
    assert streamed == {"tokens": logprobs.tokens, "text_offset": logprobs.text_offset}


async def test_chat_logprobs_streamed_and_not(api):
    _, client, _ = api
    fields = {"model": "", "messages": MESSAGES, "max_tokens": 10, "temperature": 0, "logprobs": True,
              "top_logprobs": 2}
    reply = await client.chat.completions.create(**fields)
    content = reply.choices[0].logprobs.content
    assert "".join(token.token for token in content) == reply.choices[0].message.content
    assert all(len(token.top_logprobs) == 2 and token.bytes == list(token.token.encode()) for token in content)
    assert all(token.logprob <= 0 and token.top_logprobs[0].logprob >= token.logprob for token in content)
    streamed = [token async for chunk in await client.chat.completions.create(stream=True, **fields)
                if chunk.choices and chunk.choices[0].logprobs for token in chunk.choices[0].logprobs.content]
    # Rounds may verify different numbers of rows: fp32 noise only.
    assert [t.token for t in streamed] == [t.token for t in content]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content], abs=1e-5)


async def test_n_choices_use_seed_plus_index(api):
    _, client, _ = api
    fields = {"model": "", "prompt": PROMPT, "max_tokens": 12, "temperature": 1.0}
    both = await client.completions.create(n=2, seed=5, **fields)
    assert [c.index for c in both.choices] == [0, 1]
    alone = [await client.completions.create(seed=5 + i, **fields) for i in range(2)]
    assert [c.text for c in both.choices] == [a.choices[0].text for a in alone]
    assert both.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    assert both.usage.prompt_tokens == alone[0].usage.prompt_tokens


async def test_streamed_n_interleaves_by_index_and_ends_with_usage(api):
    _, client, _ = api
    fields = {"model": "", "messages": MESSAGES, "max_tokens": 12, "temperature": 1.0, "seed": 3, "n": 3}
    whole = await client.chat.completions.create(**fields)
    texts, chunks = {}, []
    async for chunk in await client.chat.completions.create(stream=True, stream_options={"include_usage": True},
                                                            **fields):
        chunks.append(chunk)
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert all(chunk.usage is None for chunk in chunks[:-1])


async def test_greedy_n_gives_identical_choices(api):
    _, client, _ = api
    reply = await client.completions.create(model="", prompt=PROMPT, max_tokens=10, temperature=0, n=2)
    assert reply.choices[0].text == reply.choices[1].text


async def test_echo_prepends_the_prompt(api):
    _, client, _ = api
    fields = {"model": "", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    plain = await client.completions.create(**fields)
    echoed = await client.completions.create(echo=True, **fields)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    streamed = "".join([chunk.choices[0].text async for chunk in
                        await client.completions.create(echo=True, stream=True, **fields)])
    assert streamed == echoed.choices[0].text


@pytest.mark.parametrize("penalties", [
    {"presence_penalty": 1.5, "frequency_penalty": 1.0},
    {"extra_body": {"repetition_penalty": 1.5}},
])
async def test_penalties_reach_the_generation(api, penalties):
    stack, client, _ = api
    fields = {"model": "", "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    plain = await client.completions.create(**fields)
    penalized = await client.completions.create(**fields, **penalties)
    grpc_fields = penalties.get("extra_body", penalties)
    _, expected, _ = await stack.generate(prompt=PROMPT, max_tokens=24, temperature=0.0, **grpc_fields)
    assert penalized.choices[0].text == expected != plain.choices[0].text


async def test_logit_bias_bans_a_token(api):
    stack, client, _ = api
    fields = {"model": "", "prompt": PROMPT, "max_tokens": 16, "temperature": 0}
    token_ids, _, _ = await stack.generate(prompt=PROMPT, max_tokens=16, temperature=0.0)
    banned = token_ids[0]
    biased = await client.completions.create(logit_bias={str(banned): -100}, logprobs=0, **fields)
    tokens, _, _ = await stack.generate(prompt=PROMPT, max_tokens=16, temperature=0.0, logit_bias={banned: -100})
    assert banned not in tokens and biased.usage.completion_tokens == len(tokens)


async def test_user_and_no_op_values_of_unimplemented_parameters_are_accepted(api):
    _, client, _ = api
    reply = await client.chat.completions.create(model="", messages=MESSAGES, max_tokens=4, user="alice",
                                                 response_format={"type": "text"}, tool_choice="none")
    assert reply.choices[0].finish_reason in ("length", "stop")
    completion = await client.completions.create(model="", prompt=PROMPT, max_tokens=4, best_of=2, n=2)
    assert len(completion.choices) == 2


@pytest.mark.parametrize("endpoint, fields, param", [
    ("completions", {"logprobs": 6}, "logprobs"),
    ("completions", {"logprobs": 2, "echo": True}, "echo"),
    ("completions", {"suffix": "return x"}, "suffix"),
    ("completions", {"best_of": 3}, "best_of"),
    ("completions", {"n": 17}, "n"),
    ("completions", {"presence_penalty": 3}, "presence_penalty"),
    ("completions", {"logit_bias": {"abc": 1}}, "logit_bias"),
    ("completions", {"logit_bias": {"5": 200}}, "logit_bias"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ("chat", {"response_format": {"type": "json_object"}}, "response_format"),
    ("chat", {"extra_body": {"functions": [{"name": "f"}]}}, "functions"),
    ("chat", {"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
])
async def test_unsupported_and_bad_parameters_are_400_naming_them(api, endpoint, fields, param):
    stack, client, _ = api
    with pytest.raises(openai.BadRequestError) as raised:
        if endpoint == "chat":
            await client.chat.completions.create(model="", messages=MESSAGES, max_tokens=4, **fields)
        else:
            await client.completions.create(model="", prompt=PROMPT, max_tokens=4, **fields)
    assert raised.value.status_code == 400 and raised.value.body["param"] == param
    assert raised.value.body["type"] == "invalid_request_error" and param in raised.value.body["message"]
    assert await stack.wait_sessions_freed() == (0, 0)


async def test_unknown_model_is_not_found(api):
    _, client, _ = api
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(model="gpt-nope", messages=MESSAGES, max_tokens=4, logprobs=True)
