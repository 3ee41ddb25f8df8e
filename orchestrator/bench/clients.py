"""Streaming clients that time one request each: gRPC Generate and the OpenAI HTTP API.

Over gRPC, chat prompts are turned into prompt ids with the target tokenizer's
chat template here in the client (the Generate API takes text or ids); over
HTTP they go to /v1/chat/completions, which applies the same template on the
server. Both paths send the target the same token ids.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import grpc
import httpx

from orchestrator.bench.metrics import RequestRecord
from orchestrator.bench.prompts import BenchPrompt
from specmesh.models import chat_token_ids
from specmesh.v1 import generation_pb2, generation_pb2_grpc


@dataclass(frozen=True)
class RequestParams:
    max_tokens: int
    temperature: float
    seed: int | None
    speculation: bool
    num_speculative_tokens: int | None = None
    timeout_s: float = 600.0


class _Timer:
    """Client-side TTFT and inter-chunk gaps for one stream."""

    def __init__(self, record: RequestRecord, run_start: float):
        self.record, self.start, self.last = record, time.perf_counter(), None
        record.start_s = self.start - run_start

    def chunk(self) -> None:
        now = time.perf_counter()
        if self.last is None:
            self.record.ttft_ms = (now - self.start) * 1e3
        else:
            self.record.itl_ms.append((now - self.last) * 1e3)
        self.last = now

    def finish(self, stats: dict) -> None:
        self.record.e2e_ms = (time.perf_counter() - self.start) * 1e3
        self.record.prompt_tokens = int(stats.get("prompt_tokens", 0))
        self.record.output_tokens = int(stats.get("completion_tokens", 0))
        for field in ("draft_tokens", "accepted_tokens", "rounds", "lookup_tokens", "lookup_accepted_tokens"):
            setattr(self.record, field, int(stats.get(field, 0)))


class GrpcClient:
    def __init__(self, endpoint: str, tokenizer=None):
        self.channel = grpc.aio.insecure_channel(endpoint)
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)
        self.tokenizer = tokenizer  # for chat prompts

    def request(self, item: BenchPrompt, params: RequestParams) -> generation_pb2.GenerateRequest:
        request = generation_pb2.GenerateRequest(max_tokens=params.max_tokens, temperature=params.temperature,
                                                 speculation=params.speculation, prompt_class=item.kind)
        if item.messages is not None:
            if self.tokenizer is None:
                raise ValueError("chat prompts over gRPC need the target tokenizer (--tokenizer)")
            request.prompt_token_ids.extend(chat_token_ids(self.tokenizer, list(item.messages)))
        else:
            request.prompt = item.prompt
        if params.seed is not None:
            request.seed = params.seed
        if params.num_speculative_tokens:
            request.num_speculative_tokens = params.num_speculative_tokens
        return request

    async def send(self, item: BenchPrompt, params: RequestParams, record: RequestRecord, run_start: float) -> None:
        timer, last = _Timer(record, run_start), None
        try:
            async for response in self.stub.Generate(self.request(item, params), timeout=params.timeout_s):
                if response.token_ids:
                    timer.chunk()
                last = response
        except grpc.aio.AioRpcError as error:
            record.ok, record.error = False, f"{error.code().name}: {error.details()}"
            return
        timer.finish({f.name: getattr(last.stats, f.name) for f in last.stats.DESCRIPTOR.fields})

    async def close(self) -> None:
        await self.channel.close()


class HttpClient:
    def __init__(self, endpoint: str):
        base = endpoint if endpoint.startswith(("http://", "https://")) else f"http://{endpoint}"
        self.base = base.rstrip("/").removesuffix("/v1")
        self.http = httpx.AsyncClient(timeout=None)

    def body(self, item: BenchPrompt, params: RequestParams) -> tuple[str, dict]:
        body = {"max_tokens": params.max_tokens, "temperature": params.temperature, "stream": True,
                "speculation": params.speculation, "prompt_class": item.kind,
                "stream_options": {"include_usage": True}}
        if params.seed is not None:
            body["seed"] = params.seed
        if params.num_speculative_tokens:
            body["num_speculative_tokens"] = params.num_speculative_tokens
        if item.messages is not None:
            return "/v1/chat/completions", {**body, "messages": list(item.messages)}
        return "/v1/completions", {**body, "prompt": item.prompt}

    async def send(self, item: BenchPrompt, params: RequestParams, record: RequestRecord, run_start: float) -> None:
        path, body = self.body(item, params)
        timer, stats = _Timer(record, run_start), None
        timeout = httpx.Timeout(params.timeout_s)
        try:
            async with self.http.stream("POST", self.base + path, json=body, timeout=timeout) as response:
                if response.status_code != 200:
                    error = json.loads(await response.aread()).get("error", {})
                    record.ok, record.error = False, f"HTTP {response.status_code}: {error.get('message', '')}"
                    return
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[len("data: "):])
                    if _chunk_text(chunk):
                        timer.chunk()
                    stats = chunk.get("stats", stats)
        except httpx.HTTPError as error:
            record.ok, record.error = False, f"{type(error).__name__}: {error}"
            return
        timer.finish(stats or {})

    async def close(self) -> None:
        await self.http.aclose()


def _chunk_text(chunk: dict) -> str:
    choice = (chunk.get("choices") or [{}])[0]
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


def make_client(protocol: str, endpoint: str, tokenizer=None):
    return GrpcClient(endpoint, tokenizer) if protocol == "grpc" else HttpClient(endpoint)
