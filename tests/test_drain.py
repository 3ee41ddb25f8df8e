"""Graceful drain (specmesh.server.drain): in-flight streams finish, new requests are refused, late ones
are cut off with a clear status, health says NOT_SERVING.

In process, a stream is held in flight by occupying the target engine's one worker thread with a
gate; in the `specmesh serve` tests, by freezing the target process (SIGSTOP). Either way the
stream cannot finish until the test lets it, so the drain is exercised every time.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import threading

import grpc
import httpx
import openai
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from harness import WORK_TIMEOUT_S, TargetHold, eventually, load, make_engine, serve_config, start_stack
from orchestrator.control.build import OrchestratorOptions
from orchestrator.serving.http_api import create_app, start_http_server, stop_http_server
from orchestrator.serving.server import ADMIN_SERVICE_NAME, SERVICE_NAME, serve_grpc
from orchestrator.control.build import create_servicer
from parity import target_greedy
from serve_cli import start_serve
from specmesh.server.drain import drain_of
from specmesh.server.grpc_server import stop_server
from specmesh.v1 import admin_pb2, admin_pb2_grpc, generation_pb2, generation_pb2_grpc
from target_service.server import SERVICE_NAME as TARGET_SERVICE_NAME
from target_service.server import create_server as create_target_server
from benchmarks.tiny_models import TINY_PROMPTS
from orchestrator.serving.clients import open_channel

PROMPT, MAX_TOKENS = TINY_PROMPTS[0], 48
LONG = 200  # the target's greedy output for PROMPT has no EOS this early: a stream that runs for a while
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def request(max_tokens: int = MAX_TOKENS) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(prompt=PROMPT, max_tokens=max_tokens, temperature=0.0)


async def wait_for_health(channel: grpc.aio.Channel, service: str, wanted: int,
                          timeout_s: float = WORK_TIMEOUT_S) -> None:
    """Until `service` reports `wanted` (a Watch stream: no polling); DEADLINE_EXCEEDED otherwise."""
    watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=service),
                                                      timeout=timeout_s)
    try:
        async for response in watch:
            if response.status == wanted:
                return
    finally:
        watch.cancel()  # an open Watch would hold the server's stop for its whole grace


async def health_of(channel: grpc.aio.Channel, service: str) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return (await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)).status


async def read_rest(call: grpc.aio.UnaryStreamCall) -> list[int]:
    tokens = []
    while (response := await call.read()) is not grpc.aio.EOF:
        tokens.extend(response.token_ids)
    return tokens


async def assert_refused(stub: generation_pb2_grpc.GenerationStub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await read_rest(stub.Generate(request(4), timeout=30))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in refused.value.details()


class Orchestrator:
    """An orchestrator's gRPC server and HTTP API (one drain) over an in-process stack."""

    @classmethod
    async def start(cls, target_dir, draft_dir) -> Orchestrator:
        self = cls()
        self.stack = await start_stack(target_dir, draft_dir, k=3)
        _, tokenizer = load(str(target_dir), "cpu")
        servicer = await create_servicer(tokenizer, OrchestratorOptions(
            f"127.0.0.1:{self.stack.target_port}", f"127.0.0.1:{self.stack.draft_port}"))
        self.server, port, self.health = await serve_grpc(servicer)
        self.http, http_port, self.http_task = await start_http_server(
            create_app(servicer, drain=drain_of(self.server)), "127.0.0.1", 0)
        self.base = f"http://127.0.0.1:{http_port}"
        self.channel = open_channel(f"127.0.0.1:{port}")
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)
        return self

    @contextlib.asynccontextmanager
    async def target_held(self):
        """The target's worker thread waits on a gate: streams stall at their next Verify."""
        gate = threading.Event()
        blocker = asyncio.ensure_future(self.stack.target_engine.run(gate.wait, 60))
        try:
            yield
        finally:
            gate.set()
            await blocker

    async def stop(self) -> None:
        await self.channel.close()
        await stop_http_server(self.http, self.http_task)
        await self.server.stop(None)
        await self.stack.stop()


@pytest.fixture
async def orchestrator(tiny_llama_dir, tiny_llama_perturbed_dir):
    orchestrator = await Orchestrator.start(tiny_llama_dir, tiny_llama_perturbed_dir)
    yield orchestrator
    await orchestrator.stop()


async def test_in_flight_stream_finishes_while_new_requests_are_refused(orchestrator, tiny_llama_dir):
    async with TargetHold(orchestrator.stack.target_engine) as hold:  # the stream stalls after its prefill
        call = orchestrator.stub.Generate(request(), timeout=WORK_TIMEOUT_S)
        tokens = list((await call.read()).token_ids)
        await hold.wait_held()
        stopping = asyncio.ensure_future(stop_server(orchestrator.server, orchestrator.health, 60.0))
        await wait_for_health(orchestrator.channel, SERVICE_NAME, NOT_SERVING)
        assert {await health_of(orchestrator.channel, name) for name in ("", ADMIN_SERVICE_NAME)} == {NOT_SERVING}
        await assert_refused(orchestrator.stub)
        async with httpx.AsyncClient(base_url=orchestrator.base, timeout=30) as http:
            health = await http.get("/health")
            refused = await http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4})
        assert health.status_code == 503 and refused.status_code == 503
        assert refused.json()["error"]["code"] == "server_shutting_down"
        assert set(refused.json()["error"]) == {"message", "type", "param", "code"}
        assert not stopping.done()  # the held stream is still in flight
    tokens += await read_rest(call)
    assert tuple(tokens) == target_greedy(str(tiny_llama_dir), "cpu", PROMPT, MAX_TOKENS)
    await asyncio.wait_for(stopping, WORK_TIMEOUT_S)
    assert await orchestrator.stack.wait_sessions_freed() == (0, 0)


async def test_streams_still_running_at_the_end_of_the_grace_are_cut_off(orchestrator):
    drain = drain_of(orchestrator.server)
    client = openai.AsyncOpenAI(base_url=f"{orchestrator.base}/v1", api_key="unused", max_retries=0)
    async with client:
        http_stream = await client.completions.create(model="", prompt=PROMPT, max_tokens=LONG,
                                                      temperature=0, stream=True)
        await anext(http_stream)  # streaming: the SSE error event path
        async with orchestrator.target_held():  # from here on no request can finish
            call = orchestrator.stub.Generate(request(), timeout=WORK_TIMEOUT_S)
            whole = asyncio.ensure_future(client.completions.create(model="", prompt=PROMPT, max_tokens=MAX_TOKENS,
                                                                     temperature=0))

            async def in_flight() -> int:
                return drain.in_flight
            await eventually(in_flight, 3)  # the SSE stream, and the other two waiting for their prefill
            await stop_server(orchestrator.server, orchestrator.health, 0.3)
            with pytest.raises(grpc.aio.AioRpcError) as cut:
                await read_rest(call)
            with pytest.raises(openai.APIError) as http_cut:
                async for _ in http_stream:
                    pass
            with pytest.raises(openai.InternalServerError) as whole_cut:
                await whole
    assert cut.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "shutting down" in cut.value.details() and "0.3 s shutdown grace" in cut.value.details()
    assert http_cut.value.body["code"] == "server_shutting_down" and "grace" in http_cut.value.message
    assert whole_cut.value.status_code == 503 and whole_cut.value.body["code"] == "server_shutting_down"
    assert await orchestrator.stack.wait_sessions_freed() == (0, 0)



async def test_a_draining_model_service_serves_its_open_sessions_and_refuses_new_ones(tiny_llama_dir):
    """Ctrl-C reaches every process of `specmesh serve` at once: the target must not fail the
    orchestrator's in-flight stream, only turn new sessions away."""
    engine = make_engine(tiny_llama_dir)
    target, target_port, target_health = await create_target_server(engine)
    _, tokenizer = load(str(tiny_llama_dir), "cpu")
    servicer = await create_servicer(tokenizer, OrchestratorOptions(f"127.0.0.1:{target_port}", None))
    server, port, _ = await serve_grpc(servicer)
    try:
        async with open_channel(f"127.0.0.1:{port}") as channel, \
                open_channel(f"127.0.0.1:{target_port}") as target_channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            hold = TargetHold(engine)  # the stream stalls in flight after its prefill
            call = stub.Generate(request(), timeout=WORK_TIMEOUT_S)
            tokens = list((await call.read()).token_ids)
            await hold.wait_held()
            stopping = asyncio.ensure_future(stop_server(target, target_health, 60.0))
            try:
                await wait_for_health(target_channel, TARGET_SERVICE_NAME, NOT_SERVING)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await read_rest(stub.Generate(request(4), timeout=30))
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in refused.value.details()
                assert not stopping.done() and len(engine.sessions) == 1
            finally:
                hold.release()
            tokens += await read_rest(call)
        assert tuple(tokens) == target_greedy(str(tiny_llama_dir), "cpu", PROMPT, MAX_TOKENS)
        await asyncio.wait_for(stopping, WORK_TIMEOUT_S)  # done once the orchestrator closed the session
        assert not engine.sessions
    finally:
        await server.stop(None)
        await target.stop(None)


# ---- `specmesh serve` as a user runs it: SIGTERM to the serve process


class Serve:
    """`specmesh serve` on the tiny pair, with the target process (its child, or its replica template's) to freeze it."""

    def __init__(self, target_dir, draft_dir, grace_s: float, config_dir):
        self.output: list[str] = []  # what it prints after the ready lines: the drain logs there
        self.process, self.endpoint, lines = start_serve(
            "--target", str(target_dir), "--draft", str(draft_dir), "--num-speculative-tokens", "3",
            "--metrics-port", "0", *serve_config(config_dir, shutdown_grace=grace_s), expect_metrics=True,
            output=self.output)
        self.http = re.search(r"OpenAI API (http://[^/\s]+)", "\n".join(lines)).group(1)
        metrics = dict(part.strip().split(" ") for part in lines[-1].removeprefix("metrics: ").split(","))
        target_metrics_port = int(re.search(r":(\d+)/metrics", metrics["target"]).group(1))
        self.target = next(child for child in psutil.Process(self.process.pid).children(recursive=True)
                           if any(c.laddr.port == target_metrics_port and c.status == psutil.CONN_LISTEN
                                  for c in child.net_connections(kind="tcp")))

    @contextlib.contextmanager
    def target_frozen(self):
        """SIGSTOP: the target computes nothing, so every stream stalls at its next Verify."""
        self.target.suspend()
        try:
            yield
        finally:
            self.target.resume()

    def exit_code(self) -> int:
        return self.process.wait(timeout=120)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)


async def test_sigterm_on_serve_drains_then_exits_0(tiny_llama_dir, tiny_llama_perturbed_dir, tmp_path):
    serve = await asyncio.to_thread(Serve, tiny_llama_dir, tiny_llama_perturbed_dir, 60.0, tmp_path)
    try:
        async with open_channel(serve.endpoint) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            call = stub.Generate(request(LONG), timeout=WORK_TIMEOUT_S)
            tokens = list((await call.read()).token_ids)
            with serve.target_frozen():
                serve.process.send_signal(signal.SIGTERM)
                await wait_for_health(channel, SERVICE_NAME, NOT_SERVING)
                await assert_refused(stub)
                async with httpx.AsyncClient(base_url=serve.http, timeout=30) as http:
                    health = await http.get("/health")
                    refused = await http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4})
                assert health.status_code == 503 and refused.status_code == 503
                assert refused.json()["error"]["code"] == "server_shutting_down"
                assert serve.process.poll() is None
            tokens += await read_rest(call)  # the model services outlived the orchestrator's drain
        assert tuple(tokens) == target_greedy(str(tiny_llama_dir), "cpu", PROMPT, LONG)
        assert await asyncio.to_thread(serve.exit_code) == 0
        # The orchestrator (in the serve process) drained with the stream in flight.
        assert any("MainProcess INFO draining: 1 in flight" in line for line in serve.output), serve.output
    finally:
        serve.kill()


async def test_sigterm_with_a_short_grace_cuts_the_stream_off_and_exits_0(tiny_llama_dir, tiny_llama_perturbed_dir,
                                                                           tmp_path):
    serve = await asyncio.to_thread(Serve, tiny_llama_dir, tiny_llama_perturbed_dir, 0.5, tmp_path)
    try:
        async with open_channel(serve.endpoint) as channel:
            call = generation_pb2_grpc.GenerationStub(channel).Generate(request(LONG), timeout=WORK_TIMEOUT_S)
            await call.read()
            with serve.target_frozen():
                serve.process.send_signal(signal.SIGTERM)
                with pytest.raises(grpc.aio.AioRpcError) as cut:
                    await read_rest(call)
        assert cut.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "shutting down" in cut.value.details() and "0.5 s shutdown grace" in cut.value.details()
        assert await asyncio.to_thread(serve.exit_code) == 0
    finally:
        serve.kill()


def listening_process(port: int) -> psutil.Process:
    return next(psutil.Process(c.pid) for c in psutil.net_connections(kind="tcp")
                if c.laddr.port == port and c.status == psutil.CONN_LISTEN and c.pid)


@pytest.mark.xdist_group("ray")
async def test_sigterm_on_serve_with_ray_pools_drains_before_ray_shutdown(tiny_llama_dir, tiny_llama_perturbed_dir,
                                                                          tmp_path):
    """Ray mode: the driver drains while the replica actors still serve, then takes them down."""
    pytest.importorskip("ray")
    process, endpoint, _ = await asyncio.to_thread(
        start_serve, "--target", str(tiny_llama_dir), "--draft", str(tiny_llama_perturbed_dir),
        "--num-speculative-tokens", "3", "--metrics-port", "-1", "--backend", "ray",
        *serve_config(tmp_path, shutdown_grace=60, target_replicas=1, draft_replicas=1, target_num_cpus=0.5,
                      draft_num_cpus=0.5, ray_namespace="specmesh-drain-test"))
    try:
        async with open_channel(endpoint) as channel:
            pools = (await admin_pb2_grpc.AdminStub(channel).ListReplicas(admin_pb2.ListReplicasRequest(),
                                                                          timeout=30)).pools
            target_address = next(p for p in pools if p.pool == "target").replicas[0].address
            target = listening_process(int(target_address.rsplit(":", 1)[1]))
            stub = generation_pb2_grpc.GenerationStub(channel)
            call = stub.Generate(request(LONG), timeout=WORK_TIMEOUT_S)
            tokens = list((await call.read()).token_ids)
            target.suspend()  # the stream stays in flight until the checks below are done
            try:
                process.send_signal(signal.SIGTERM)
                await wait_for_health(channel, SERVICE_NAME, NOT_SERVING)
                await assert_refused(stub)
            finally:
                target.resume()
            tokens += await read_rest(call)
        assert tuple(tokens) == target_greedy(str(tiny_llama_dir), "cpu", PROMPT, LONG)
        assert await asyncio.to_thread(process.wait, 120) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
