"""Hostile load on the client-facing ports: idle connections past the cap, floods of strangers' calls.

Real servers on 127.0.0.1 (the tiny target, no draft), configured with a small connection cap
and short timeouts so that the bounds are reached in seconds.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
import httpx
import pytest

from harness import load, start_stack
from orchestrator.control.build import OrchestratorOptions
from orchestrator.serving.http_api import create_app, start_http_server, stop_http_server
from orchestrator.control.build import create_servicer
from orchestrator.serving.server import serve_grpc
from specmesh.server.connections import ConnectionLimits, RateLimitedFilter, quiet_accept_errors
from specmesh.server.security import bearer_metadata
from specmesh.v1 import generation_pb2, generation_pb2_grpc

API_KEY = "limits-key"
CAP = 100
LIMITS = ConnectionLimits(max_connections=CAP, handshake_timeout_s=4.0, idle_timeout_s=30.0)
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]  # a stranger's own connection, as from another process
REQUEST = generation_pb2.GenerateRequest(prompt="def add(a, b):", max_tokens=4, temperature=0.0)


@pytest.fixture(scope="module")
async def door(tiny_llama_dir):
    stack = await start_stack(tiny_llama_dir)
    _, tokenizer = load(str(tiny_llama_dir), "cpu")
    servicer = await create_servicer(tokenizer, OrchestratorOptions(f"127.0.0.1:{stack.target_port}", None))
    grpc_server, port, _ = await serve_grpc(servicer, api_key=API_KEY, connection_limits=LIMITS)
    app = create_app(servicer, API_KEY)
    http_server, http_port, http_task = await start_http_server(app, "127.0.0.1", 0, limits=LIMITS)
    yield port, http_port, http_server
    await stop_http_server(http_server, http_task)
    await grpc_server.stop(None)
    await stack.stop()


async def generate(channel: grpc.aio.Channel, key: str | None = API_KEY, wait: bool = False) -> int:
    """Tokens of one Generate call (raises AioRpcError when refused)."""
    tokens = 0
    stub = generation_pb2_grpc.GenerationStub(channel)
    async for response in stub.Generate(REQUEST, timeout=30, metadata=bearer_metadata(key), wait_for_ready=wait):
        tokens += len(response.token_ids)
    return tokens


async def complete(http_port: int) -> httpx.Response:
    """An authenticated completion over a connection of its own (a newcomer, not a kept one)."""
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{http_port}", timeout=30,
                                 headers={"authorization": f"Bearer {API_KEY}"}) as client:
        return await client.post("/v1/completions", json={"prompt": "def add(a, b):", "max_tokens": 4})


async def open_idle(port: int, count: int) -> list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    """`count` TCP connections that never send a byte."""
    return list(await asyncio.gather(*(asyncio.open_connection("127.0.0.1", port) for _ in range(count))))


async def closing_times(connections, timeout_s: float) -> list[float]:
    """Seconds from now until the server closed each connection (EOF or reset); inf past timeout_s.

    A gRPC server sends its SETTINGS frame at once: what counts is the end of the stream, not data."""
    started = time.perf_counter()

    async def closed(reader: asyncio.StreamReader) -> float:
        try:
            async with asyncio.timeout(timeout_s):
                while await reader.read(1 << 16):
                    pass
        except TimeoutError:  # before OSError, which it is a subclass of
            return float("inf")
        except OSError:  # reset
            pass
        return time.perf_counter() - started
    try:
        return list(await asyncio.gather(*(closed(reader) for reader, _ in connections)))
    finally:
        for _, writer in connections:
            writer.close()


async def test_idle_connections_past_the_cap_cost_strangers_only(door, caplog):
    port, http_port, http_server = door
    caplog.set_level(logging.INFO)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as kept:
        assert await generate(kept) > 0  # a caller connected before the flood
        idle = {"grpc": await open_idle(port, 3 * CAP), "http": await open_idle(http_port, 3 * CAP)}
        bound = LIMITS.handshake_timeout_s + 20
        closing = {name: asyncio.ensure_future(closing_times(connections, bound))
                   for name, connections in idle.items()}
        # While strangers hold every slot: the kept channel, and a newcomer over HTTP (which displaces
        # the oldest idle connection), get through; a new gRPC channel gets in once the handshake
        # timeout has freed slots (gRPC refuses connections past the cap rather than evicting).
        assert await generate(kept) > 0
        assert (await complete(http_port)).status_code == 200
        assert len(http_server.config.http_protocol_class.open_connections) <= CAP
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as newcomer:
            assert await generate(newcomer, wait=True) > 0
        for name, times in closing.items():
            times = await times
            outlived = sum(t == float("inf") for t in times)
            assert outlived == 0, f"{name}: {outlived} idle connections outlived {bound} s"
            # Past the cap at once (refused or displaced), the rest by the handshake timeout.
            early = sum(t < LIMITS.handshake_timeout_s * 0.75 for t in times)
            assert early >= 2 * CAP - 1, (name, early)
        assert await generate(kept) > 0
    assert sum(len(record.getMessage()) for record in caplog.records) < 64 * 1024


async def test_a_flood_of_unauthenticated_calls_costs_only_itself(door):
    port, http_port, _ = door
    flood_size = 3000
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as kept, \
            grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=OWN_CONNECTION) as stranger:
        assert await generate(kept) > 0
        # Connected first, as a real client's channel is: its calls then queue behind the server's
        # stream limit instead of racing the SETTINGS frame that announces it (REFUSED_STREAM).
        await stranger.channel_ready()

        async def stranger_call():
            try:
                await generate(stranger, key=None)
            except grpc.aio.AioRpcError as error:
                return error.code()
            return grpc.StatusCode.OK

        async def authenticated_calls():
            return [await generate(kept) for _ in range(5)]
        flood = asyncio.gather(*(stranger_call() for _ in range(flood_size)))
        served, codes = await asyncio.gather(authenticated_calls(), flood)
    assert all(tokens > 0 for tokens in served)
    counts = {code: codes.count(code) for code in set(codes)}
    print("flood statuses:", counts)
    assert set(counts) <= {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.RESOURCE_EXHAUSTED}, counts
    assert counts.get(grpc.StatusCode.UNAUTHENTICATED, 0) > 0


async def test_http_strangers_get_401_before_their_body_is_read(door):
    _, http_port, _ = door
    limits = httpx.Limits(max_connections=50)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{http_port}", timeout=30, limits=limits) as stranger:
        # A declared body that never comes: answered at once, so nothing waited for it.
        refusals = await asyncio.gather(*(stranger.post("/v1/completions", content=b"{",
                                                        headers={"content-type": "application/json"})
                                          for _ in range(200)), complete(http_port))
    served = refusals.pop()
    assert served.status_code == 200
    assert {reply.status_code for reply in refusals} == {401}
    assert all(reply.json()["error"]["code"] == "invalid_api_key" for reply in refusals)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{http_port}", timeout=30) as open_door:
        assert (await open_door.get("/health")).status_code == 200  # probes need no key


def test_accept_errors_are_logged_once_per_interval(caplog):
    quiet = RateLimitedFilter(("Too many open files",), interval_s=60)
    logger = logging.getLogger("test.accept")
    logger.addFilter(quiet)
    caplog.set_level(logging.ERROR, logger="test.accept")
    try:
        for _ in range(1000):
            try:
                raise OSError(24, "Too many open files")
            except OSError:
                logger.exception("socket.accept() out of system resource")
        logger.error("something else")
    finally:
        logger.removeFilter(quiet)
    messages = [record.getMessage() for record in caplog.records]
    assert messages == ["socket.accept() out of system resource (0 more like it in the last 60 s left out)",
                        "something else"]
    assert quiet.dropped == 999 and caplog.records[0].exc_info is None
    assert quiet_accept_errors() in logging.getLogger("asyncio").filters
