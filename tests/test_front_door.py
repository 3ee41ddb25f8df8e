"""The front door: oversized requests refused unread, every error naming its field in the API's own
shape, docs behind the key, prompts tokenized off the event loop."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import grpc
import pytest

from front_door import assert_openai_error, bad_request_fields, open_front_door
from harness import serve_config, start_stack
from orchestrator.serving import http_api
from orchestrator.cli.main import build_parser
from orchestrator.control.config_error import ConfigError
from orchestrator.serving.request_limits import request_size_limit
from specmesh.v1 import generation_pb2
from benchmarks.tiny_models import TINY_PROMPTS

BIG_PROMPT_BYTES = 20 * 1024 * 1024
API_KEY = "front-door-key"


@pytest.fixture(scope="module")
async def stack(tiny_llama_dir, tiny_llama_perturbed_dir, device):
    stack = await start_stack(tiny_llama_dir, tiny_llama_perturbed_dir, k=2, device=device)
    yield stack
    await stack.stop()


@pytest.fixture
async def door(stack, tiny_llama_dir, device):
    door = await open_front_door(stack, tiny_llama_dir, device)
    yield door
    await door.close()


def greedy(prompt: str, max_tokens: int) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(prompt=prompt, max_tokens=max_tokens, temperature=0.0)


async def test_a_20mb_prompt_is_refused_at_once_while_another_stream_completes(door):
    request = greedy(TINY_PROMPTS[0], 200)
    expected, _ = await door.generate(request)
    big_grpc = generation_pb2.GenerateRequest(prompt="x" * BIG_PROMPT_BYTES).SerializeToString()
    big_http = json.dumps({"prompt": "x" * BIG_PROMPT_BYTES}).encode()  # built before the stream: same event loop
    limit = request_size_limit(door.servicer.backends.limits.context_window)

    async def refused_grpc() -> grpc.aio.AioRpcError:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async for _ in door.raw_generate(big_grpc):
                pass
        return refused.value

    token_ids = []
    stream = door.stub.Generate(request, timeout=60)
    token_ids.extend((await anext(aiter(stream))).token_ids)  # the stream is under way
    started = time.monotonic()
    grpc_error, http_response = await asyncio.gather(refused_grpc(), door.http.post(
        "/v1/completions", content=big_http, headers={"content-type": "application/json"}))
    refused_within = time.monotonic() - started
    async for response in stream:
        token_ids.extend(response.token_ids)
    assert grpc_error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and str(limit) in grpc_error.details()
    error = assert_openai_error(http_response, 413, param=None)
    assert f"limit of {limit} bytes" in error["message"] and "--max-request-bytes" in error["message"]
    assert refused_within < 10.0  # generous: the benchmark measures it (well under a second)
    assert token_ids == expected


async def test_the_size_limit_is_configurable(stack, tiny_llama_dir, device):
    door = await open_front_door(stack, tiny_llama_dir, device, max_request_bytes=2000)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await door.generate(greedy("ab " * 1000, 4))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "2000" in refused.value.details()
        error = assert_openai_error(await door.http.post("/v1/completions", json={"prompt": "ab " * 1000}), 413)
        assert "limit of 2000 bytes" in error["message"]
        token_ids, finish = await door.generate(greedy(TINY_PROMPTS[1], 4))  # small ones still pass
        assert len(token_ids) == 4 and finish == generation_pb2.FINISH_REASON_LENGTH
    finally:
        await door.close()


async def test_a_streamed_body_is_cut_off_at_the_limit(door):
    """Without a Content-Length (chunked), the body is counted as it arrives and refused at the limit
    (read whole, this one would be a 400: its JSON string never ends)."""
    limit = request_size_limit(door.servicer.backends.limits.context_window)

    async def chunks():
        yield b'{"prompt": "'
        for _ in range(200):
            yield b"x" * 100_000
    response = await door.http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert f"limit of {limit} bytes" in assert_openai_error(response, 413, param=None)["message"]
    token_ids, _ = await door.generate(greedy(TINY_PROMPTS[0], 3))
    assert len(token_ids) == 3


async def test_a_prompt_within_the_bytes_but_beyond_the_context_names_prompt(door):
    long_prompt = "the quick brown fox " * 300  # 6 KB: under the byte limit, over 256 tokens
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await door.generate(greedy(long_prompt, 4))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad_request_fields(refused.value) == ["prompt"] and "context window" in refused.value.details()
    response = await door.http.post("/v1/completions", json={"prompt": long_prompt, "max_tokens": 4})
    assert "context window" in assert_openai_error(response, 400, "prompt")["message"]


@pytest.mark.parametrize("raw, field", [
    (generation_pb2.GenerateRequest(prompt="abc").SerializeToString().replace(b"abc", b"a\xffc"), "prompt"),
    (generation_pb2.GenerateRequest(prompt="hi", stop=["ok", "xyz"]).SerializeToString().replace(b"xyz", b"\xc3yz"),
     "stop"),
    (b"\xff\xff\xff", ""),  # truncated varint
    (b"\x0a\x05ab", ""),  # prompt longer than the message
    (generation_pb2.GenerateRequest(prompt="hi").SerializeToString() + b"\x98\x06\x01", ""),  # unknown field 99
])
async def test_undecodable_or_unknown_grpc_requests_are_invalid_argument(door, raw, field):
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        async for _ in door.raw_generate(raw):
            pass
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
    assert bad_request_fields(refused.value) == [field]
    token_ids, _ = await door.generate(greedy(TINY_PROMPTS[0], 3))  # and the server keeps serving
    assert len(token_ids) == 3


@pytest.mark.parametrize("route, body, param", [
    ("completions", {"prompt": "hi", "max_tokens": 2**40}, "max_tokens"),
    ("completions", {"prompt": "hi", "top_k": 2**40}, "top_k"),
    ("completions", {"prompt": "hi", "seed": -1}, "seed"),
    ("completions", {"prompt": "hi\ud800"}, "prompt"),
    ("completions", {"prompt": [5, 2**40]}, "prompt"),
    ("completions", {"prompt": "hi", "max_tokens": "3"}, "max_tokens"),  # strict: no string -> number
    ("completions", {"prompt": "hi", "temperature": "0.5"}, "temperature"),
    ("completions", {"prompt": "hi", "stream": "true"}, "stream"),
    ("completions", {"prompt": "hi", "stop": ["a", 3]}, "stop"),
    ("completions", {"prompt": "hi", "best_of": 2}, "best_of"),  # unknown or unimplemented: never ignored
    ("chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages.[0].content"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages.[0].content"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi", "name": "x"}]}, "messages.[0].name"),
    ("chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, "messages.[0].role"),
])
async def test_bad_http_fields_are_400_naming_the_parameter(door, route, body, param):
    response = await door.http.post(f"/v1/{route}", content=json.dumps(body),
                                    headers={"content-type": "application/json"})
    assert_openai_error(response, 400, param)


@pytest.mark.parametrize("method, path, content, status", [
    ("POST", "/v1/completions", b'{"prompt": "hi", "max_tokens": 4,,}', 400),  # JSON syntax: no param
    ("POST", "/v1/completions", b"[1, 2]", 400),
    ("POST", "/v1/completions", b"", 400),
    ("POST", "/v1/nowhere", b"{}", 404),
    ("GET", "/v1/completions", None, 405),
])
async def test_every_http_error_has_openai_shape(door, method, path, content, status):
    response = await door.http.request(method, path, content=content, headers={"content-type": "application/json"})
    assert_openai_error(response, status, param=None)


async def test_docs_sit_behind_the_api_key(stack, tiny_llama_dir, device):
    door = await open_front_door(stack, tiny_llama_dir, device, api_key=API_KEY)
    try:
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert_openai_error(await door.http.get(path, headers={"authorization": "Bearer wrong"}), 401)
            assert (await door.http.get(path)).status_code == 200
        assert "/v1/completions" in (await door.http.get("/openapi.json")).json()["paths"]
    finally:
        await door.close()
    assert (await (door := await open_front_door(stack, tiny_llama_dir, device)).http.get("/docs")).status_code == 200
    await door.close()


async def test_prompts_are_tokenized_off_the_event_loop(door, monkeypatch):
    loop_thread, threads = threading.get_ident(), []
    encode, chat_token_ids = door.servicer.encode, http_api.chat_token_ids

    def recording_encode(prompt):
        threads.append(threading.get_ident())
        return encode(prompt)

    def recording_chat_token_ids(tokenizer, messages):
        threads.append(threading.get_ident())
        return chat_token_ids(tokenizer, messages)
    monkeypatch.setattr(door.servicer, "encode", recording_encode)
    monkeypatch.setattr(http_api, "chat_token_ids", recording_chat_token_ids)
    await door.generate(greedy(TINY_PROMPTS[0], 2))
    assert (await door.http.post("/v1/completions", json={"prompt": TINY_PROMPTS[1], "max_tokens": 2})).is_success
    chat = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
    assert (await door.http.post("/v1/chat/completions", json=chat)).is_success
    assert len(threads) == 3 and loop_thread not in threads


@pytest.mark.parametrize("value, accepted", [(4096, True), (0, False), (-5, False), (1e6, False)])
def test_the_size_limit_setting_takes_a_positive_byte_count(value, accepted, tmp_path):
    config = serve_config(tmp_path, max_request_bytes=value)
    if accepted:
        assert build_parser().parse_args(["serve", *config]).max_request_bytes == value
    else:
        with pytest.raises(ConfigError, match="max-request-bytes"):
            build_parser().parse_args(["serve", *config])
