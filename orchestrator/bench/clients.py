"""Streaming clients that time one request each: gRPC Generate and the OpenAI HTTP API.

Over gRPC, chat prompts are turned into prompt ids with the target tokenizer's
chat template here in the client (the Generate API takes text or ids); over
HTTP they go to /v1/chat/completions, which applies the same template on the
server. Both paths send the target the same token ids. A prompt of n > 1 completions
is one request whose completions' responses interleave, each tagged with its index;
the timer keeps them apart (orchestrator.bench.metrics says what the figures mean then).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass

import grpc
import httpx

from orchestrator.bench.metrics import COUNTED, RequestRecord, token_digest
from orchestrator.bench.modes import is_peer_mode
from orchestrator.prompts.sets import BenchPrompt
from orchestrator.bench.round_parts import ByMode, RoundParts, scrape_round_parts
from orchestrator.serving.clients import open_channel
from specmesh.loading.models import chat_token_ids
from specmesh.v1 import admin_pb2, admin_pb2_grpc, generation_pb2, generation_pb2_grpc


@dataclass(frozen=True)
class RequestParams:
    max_tokens: int
    temperature: float
    seed: int | None
    speculation: bool
    num_speculative_tokens: int | None = None
    timeout_s: float = 600.0


class _Timer:
    """Client-side TTFT and inter-chunk gaps for one stream, per completion where it has several."""

    def __init__(self, record: RequestRecord, run_start: float, n: int = 1):
        self.record, self.start, self.lasts = record, time.perf_counter(), {}
        record.start_s, record.n = self.start - run_start, n

    def chunk(self, index: int = 0) -> None:
        """A chunk with tokens of completion `index`: TTFT at the first of any, ITL within each."""
        now = time.perf_counter()
        if not self.lasts:
            self.record.ttft_ms = (now - self.start) * 1e3
        if index in self.lasts:
            self.record.itl_ms.append((now - self.lasts[index]) * 1e3)
        self.lasts[index] = now

    def finish(self, stats: dict[int, dict], token_ids: dict[int, list[int]] | None = None) -> None:
        """`stats`: the server's stats of each finished completion, by index; summed over them.
        `token_ids`: each completion's generated ids, by index, where the client sees them."""
        self.record.e2e_ms = (time.perf_counter() - self.start) * 1e3
        if token_ids is not None:
            self.record.output_digest = token_digest([token_ids[index] for index in sorted(token_ids)])
        finished = [stats[index] for index in sorted(stats)]
        self.record.prompt_tokens = max((int(s.get("prompt_tokens", 0)) for s in finished), default=0)
        self.record.completion_tokens = [int(s.get("completion_tokens", 0)) for s in finished]
        self.record.output_tokens = sum(self.record.completion_tokens)
        for field in COUNTED:
            setattr(self.record, field, sum(int(s.get(field, 0)) for s in finished))
        if len(finished) < self.record.n:
            self.record.ok = False
            self.record.error = f"{len(finished)} of {self.record.n} completions finished"


class GrpcClient:
    def __init__(self, endpoint: str, tokenizer=None):
        self.channel = open_channel(endpoint)
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
        if item.n > 1:
            request.n = item.n
        return request

    async def send(self, item: BenchPrompt, params: RequestParams, record: RequestRecord, run_start: float) -> None:
        timer, stats, token_ids = _Timer(record, run_start, item.n), {}, {}
        try:
            async for response in self.stub.Generate(self.request(item, params), timeout=params.timeout_s):
                if response.token_ids:
                    timer.chunk(response.index)
                    token_ids.setdefault(response.index, []).extend(response.token_ids)
                if response.HasField("stats"):  # the last response of its completion
                    stats[response.index] = {f.name: getattr(response.stats, f.name)
                                             for f in response.stats.DESCRIPTOR.fields}
        except grpc.aio.AioRpcError as error:
            record.ok, record.error = False, f"{error.code().name}: {error.details()}"
            return
        timer.finish(stats, token_ids)

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
        if item.n > 1:
            body["n"] = item.n
        if item.messages is not None:
            return "/v1/chat/completions", {**body, "messages": list(item.messages)}
        return "/v1/completions", {**body, "prompt": item.prompt}

    async def send(self, item: BenchPrompt, params: RequestParams, record: RequestRecord, run_start: float) -> None:
        path, body = self.body(item, params)
        timer, stats = _Timer(record, run_start, item.n), {}
        timeout = httpx.Timeout(params.timeout_s)
        try:
            async with self.http.stream("POST", self.base + path, json=body, timeout=timeout) as response:
                if response.status_code != 200:
                    error = json.loads(await response.aread()).get("error", {})
                    record.ok, record.error = False, f"HTTP {response.status_code}: {error.get('message', '')}"
                    return
                async for line in response.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        read_chunk(json.loads(line[len("data: "):]), timer, stats)
        except httpx.HTTPError as error:
            record.ok, record.error = False, f"{type(error).__name__}: {error}"
            return
        except StreamError as error:
            record.ok, record.error = False, f"stream error: {error}"
            return
        timer.finish(stats)

    async def close(self) -> None:
        await self.http.aclose()


class StreamError(Exception):
    """An error event in the middle of a stream (the server shut down before the request ended)."""


def read_chunk(chunk: dict, timer: _Timer, stats: dict[int, dict]) -> None:
    """One streamed chunk: a chunk with text times its choice; a finishing one carries that choice's stats."""
    if "error" in chunk:
        raise StreamError((chunk["error"] or {}).get("message", ""))
    for choice in chunk.get("choices") or []:
        index = int(choice.get("index", 0))
        if choice.get("text") or (choice.get("delta") or {}).get("content"):
            timer.chunk(index)
        if "stats" in chunk:  # a chunk carries one choice, and the stats of the one it finishes
            stats[index] = chunk["stats"]


async def clear_suffix_index(endpoint: str) -> None:
    """Empty the server's suffix index (Admin.ClearSuffixIndex), so that what earlier configurations
    generated is not proposed to this one."""
    async with open_channel(endpoint) as channel:
        await admin_pb2_grpc.AdminStub(channel).ClearSuffixIndex(admin_pb2.ClearSuffixIndexRequest(), timeout=30)


async def served_weights(endpoint: str) -> dict[str, tuple[str, str]]:
    """(precision, cpu_linear) by pool ("target", "draft") as the server's replicas report running them
    (Admin.ListReplicas); a pool whose replicas have not reported yet is missing, and all are where the
    call fails (said on stderr: the peer then loads as the flags say)."""
    try:
        async with open_channel(endpoint) as channel:
            listed = await admin_pb2_grpc.AdminStub(channel).ListReplicas(admin_pb2.ListReplicasRequest(),
                                                                          timeout=30)
    except grpc.aio.AioRpcError as error:
        print(f"specmesh bench: could not read what the replicas run ({error.code().name}: {error.details()}); "
              "the peer loads as --target-dtype, --draft-dtype and --cpu-linear say", file=sys.stderr)
        return {}
    return {pool.pool: (replica.precision, replica.cpu_linear)
            for pool in listed.pools for replica in pool.replicas if replica.precision}


class RunClient:
    """The run's one client: a request goes to the served stack, or in a peer mode to the peer
    (orchestrator.bench.peer.PeerClient); and where each mode's rounds spent their time
    (orchestrator.bench.round_parts), the served modes' from the orchestrator's /metrics where the
    bench knows it (a stack it started)."""

    def __init__(self, served, peer=None, metrics_url: str | None = None):
        self.served, self.peer, self.metrics_url = served, peer, metrics_url
        self.rounds = ByMode(self._snapshot)

    async def _snapshot(self, mode: str) -> RoundParts | None:
        if is_peer_mode(mode):
            return await self.peer.round_parts(mode)
        return None if self.metrics_url is None else await scrape_round_parts(self.metrics_url)

    async def send(self, item: BenchPrompt, params: RequestParams, record: RequestRecord, run_start: float) -> None:
        client = self.peer if is_peer_mode(record.mode) else self.served
        if client is None:
            raise ValueError(f"no peer loaded for mode {record.mode!r}")
        await self.rounds.enter(record.mode)
        try:
            await client.send(item, params, record, run_start)
        finally:
            await self.rounds.leave(record.mode)

    async def close(self) -> None:
        await self.served.close()


def make_client(protocol: str, endpoint: str, tokenizer=None, peer=None, metrics_url: str | None = None) -> RunClient:
    served = GrpcClient(endpoint, tokenizer) if protocol == "grpc" else HttpClient(endpoint)
    return RunClient(served, peer, metrics_url)
