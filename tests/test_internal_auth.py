"""The internal draft and target services admit only their orchestrator: the internal token.

In-process servers (tests/harness.py) that require a token: calls without it or with a
wrong one are UNAUTHENTICATED, health stays open, the orchestrator that holds the token
generates the target's own tokens, a flood of unauthenticated OpenSession calls takes no
slot, and one caller cannot hold more than its share of the session slots.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import os
import re
import signal
import subprocess
import sys
import threading

import grpc
import httpx
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from draft_service.server import create_server as create_draft_server
from front_door import generate_with
from harness import load, serve_config, start_stack
from orchestrator.control.build import OrchestratorOptions
from orchestrator.control.build import create_servicer
from parity import target_greedy
from serve_cli import ROOT, start_serve
from specmesh.engine.model_engine import EngineConfig, ModelEngine
from specmesh.server.security import (INTERNAL_TOKEN_ENV, SecurityConfigError, bearer_metadata,
                                      internal_token_from_args, token_interceptors)
from specmesh.server.service import add_service_arguments, options_from_args
from specmesh.v1 import admin_pb2, admin_pb2_grpc, common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from target_service.server import create_server as create_target_server
from benchmarks.tiny_models import TINY_PROMPTS

TOKEN = "internal-t0ken"
MAX_TOKENS = 16
FLOOD = 300  # more unauthenticated OpenSession calls than the 256 session slots


@pytest.fixture(scope="module")
async def token_stack(tiny_llama_dir, tiny_llama_perturbed_dir):
    stack = await start_stack(tiny_llama_dir, tiny_llama_perturbed_dir, k=3, internal_token=TOKEN)
    yield stack
    await stack.stop()


def channel_to(port: int, token: str | None = None, own_connection: bool = False) -> grpc.aio.Channel:
    """A plaintext channel to 127.0.0.1:port sending `token`; `own_connection`: a caller of its own
    (gRPC otherwise shares one connection among a process's channels with the same settings)."""
    options = [("grpc.use_local_subchannel_pool", 1)] if own_connection else []
    # grpc's own interceptors only: the bidirectional calls' StreamCallMetadata is for open_channel's clients
    interceptors = [item for item in token_interceptors(token) if isinstance(item, grpc.aio.ClientInterceptor)]
    return grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options, interceptors=interceptors)


def open_request(role: str, request_id: str, prompt=(1, 2, 3)):
    if role == "draft":
        return draft_pb2.DraftOpenRequest(request_id=request_id, prompt_token_ids=prompt)
    return target_pb2.TargetOpenRequest(request_id=request_id, prompt_token_ids=prompt)


def service_stub(role: str, channel: grpc.aio.Channel):
    return (draft_pb2_grpc.DraftServiceStub if role == "draft" else target_pb2_grpc.TargetServiceStub)(channel)


def port_of(stack, role: str) -> int:
    return stack.draft_port if role == "draft" else stack.target_port


@pytest.mark.parametrize("role", ["draft", "target"])
@pytest.mark.parametrize("header", [None, "Bearer wrong-token", f"Basic {TOKEN}", f"Bearer {TOKEN}x"])
async def test_calls_without_the_token_are_unauthenticated(token_stack, role, header):
    metadata = (("authorization", header),) if header else ()
    async with channel_to(port_of(token_stack, role)) as channel:
        stub = service_stub(role, channel)
        calls = [stub.GetModelInfo(common_pb2.ModelInfoRequest(), timeout=10, metadata=metadata),
                 stub.OpenSession(open_request(role, f"stranger-{role}"), timeout=10, metadata=metadata)]
        for call in calls:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "internal token" in refused.value.details()
        if role == "draft":  # the server-streaming call is refused too
            stream = stub.PreDraft(draft_pb2.PreDraftRequest(request_id="stranger-draft"), timeout=10,
                                   metadata=metadata)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in stream:
                    pass
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    engine = token_stack.draft_engine if role == "draft" else token_stack.target_engine
    assert f"stranger-{role}" not in engine.sessions


@pytest.mark.parametrize("role", ["draft", "target"])
async def test_health_and_reflection_stay_open(token_stack, role):
    async with channel_to(port_of(token_stack, role)) as channel:
        health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                  timeout=10)
        services = [s.name async for reply in replies for s in reply.list_services_response.service]
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert f"specmesh.v1.{'DraftService' if role == 'draft' else 'TargetService'}" in services


async def test_the_orchestrator_with_the_token_generates_the_targets_tokens(token_stack, tiny_llama_dir):
    token_ids, _, last = await token_stack.generate(prompt=TINY_PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0.0)
    assert tuple(token_ids) == target_greedy(str(tiny_llama_dir), "cpu", TINY_PROMPTS[0], MAX_TOKENS)
    assert last.stats.draft_tokens > 0 and not last.stats.draft_fallback  # the draft channel carries it too
    assert await token_stack.wait_sessions_freed() == (0, 0)


async def test_an_orchestrator_with_a_wrong_token_fails_at_start_up(token_stack, tiny_llama_dir):
    """Not at the first request: connecting checks the draft and target with the token it holds."""
    _, tokenizer = load(str(tiny_llama_dir), "cpu")
    options = OrchestratorOptions(f"127.0.0.1:{token_stack.target_port}", f"127.0.0.1:{token_stack.draft_port}",
                                  internal_token="not-the-token")
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await create_servicer(tokenizer, options)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "internal token" in refused.value.details()


async def test_an_unauthenticated_flood_takes_no_session_slot(token_stack, tiny_llama_dir):
    async def open_unauthenticated(stub, role: str, index: int) -> grpc.StatusCode:
        try:
            await stub.OpenSession(open_request(role, f"flood-{index}"), timeout=30)
        except grpc.aio.AioRpcError as error:
            return error.code()
        return grpc.StatusCode.OK

    async with channel_to(token_stack.target_port) as target, channel_to(token_stack.draft_port) as draft:
        codes = await asyncio.gather(*(open_unauthenticated(service_stub(role, channel), role, index)
                                       for role, channel in (("target", target), ("draft", draft))
                                       for index in range(FLOOD)))
    assert set(codes) == {grpc.StatusCode.UNAUTHENTICATED} and len(codes) == 2 * FLOOD
    assert not token_stack.target_engine.sessions and not token_stack.draft_engine.sessions
    token_ids, _, last = await token_stack.generate(prompt=TINY_PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0.0)
    assert tuple(token_ids) == target_greedy(str(tiny_llama_dir), "cpu", TINY_PROMPTS[1], MAX_TOKENS)
    assert last.stats.draft_tokens > 0


@pytest.mark.parametrize("role", ["draft", "target"])
async def test_one_caller_cannot_take_every_session_slot(role, tiny_llama_dir):
    model, tokenizer = load(str(tiny_llama_dir), "cpu")
    engine = ModelEngine(model, tokenizer, EngineConfig(model_name="tiny", max_sessions=4, max_sessions_per_caller=2))
    create = create_draft_server if role == "draft" else create_target_server
    server, port, _ = await create(engine, internal_token=TOKEN)
    first, second = channel_to(port, TOKEN, own_connection=True), channel_to(port, TOKEN, own_connection=True)
    try:
        greedy = service_stub(role, first)
        for index in range(2):
            await greedy.OpenSession(open_request(role, f"first-{index}"), timeout=30)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await greedy.OpenSession(open_request(role, "first-2"), timeout=30)
        await service_stub(role, second).OpenSession(open_request(role, "second-0"), timeout=30)
        await greedy.CloseSession(common_pb2.CloseSessionRequest(request_id="first-0"), timeout=10)
        await greedy.OpenSession(open_request(role, "first-3"), timeout=30)  # a freed slot is its own again
    finally:
        await first.close()
        await second.close()
        await server.stop(None)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "per-caller limit is 2 of 4" in refused.value.details()
    assert sorted(engine.sessions) == ["first-1", "first-3", "second-0"]


def test_default_per_caller_limit_leaves_a_quarter_to_others():
    assert EngineConfig("m").caller_limit == 192
    assert EngineConfig("m", max_sessions=1).caller_limit == 1
    assert EngineConfig("m", max_sessions=8, max_sessions_per_caller=8).caller_limit == 8


def test_standalone_services_take_the_token_from_a_file_or_the_environment(tmp_path, monkeypatch):
    parser = argparse.ArgumentParser()
    add_service_arguments(parser, default_model="m")
    monkeypatch.delenv(INTERNAL_TOKEN_ENV, raising=False)
    assert options_from_args(parser.parse_args([])).internal_token is None
    monkeypatch.setenv(INTERNAL_TOKEN_ENV, "from-env")
    assert options_from_args(parser.parse_args([])).internal_token == "from-env"
    token_file = tmp_path / "token"
    token_file.write_text(" from-file\n")
    options = options_from_args(parser.parse_args(["--internal-token-file", str(token_file),
                                                   "--max-sessions-per-caller", "3"]))
    assert (options.internal_token, options.max_sessions_per_caller) == ("from-file", 3)
    with pytest.raises(SecurityConfigError, match="--internal-token-file: cannot read"):
        internal_token_from_args(argparse.Namespace(internal_token_file=str(tmp_path / "missing")))
    token_file.write_text("\n")
    with pytest.raises(SystemExit, match="--internal-token-file: .* is empty"):
        options_from_args(parser.parse_args(["--internal-token-file", str(token_file)]))


# ---- `specmesh serve` as users run it: every port it opens


def listening_sockets(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every listening TCP socket of process `pid` and its children.

    gRPC listens on IPv6 sockets; an IPv4 bind shows as its v4-mapped form, normalised here."""
    processes = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    sockets = set()
    for connection in (c for p in processes for c in p.net_connections(kind="inet")):
        if connection.status == psutil.CONN_LISTEN:
            address = ipaddress.ip_address(connection.laddr.ip)
            sockets.add((str(getattr(address, "ipv4_mapped", None) or address), connection.laddr.port))
    return sockets


def printed_ports(lines: list[str]) -> dict[str, int]:
    """The ports `serve` printed, by name: orchestrator, http, internal target/draft, metrics per service."""
    text = "\n".join(lines)
    ports = {"orchestrator": int(re.search(r"client endpoint 127\.0\.0\.1:(\d+)", text).group(1)),
             "http": int(re.search(r"OpenAI API http://127\.0\.0\.1:(\d+)/v1", text).group(1))}
    internal = re.search(r"internal services \(.*\): (.*)", text).group(1)
    ports.update({name: int(port) for name, port in re.findall(r"(target|draft) 127\.0\.0\.1:(\d+)", internal)})
    metrics = re.search(r"metrics: (.*)", text).group(1)
    ports.update({f"{name} metrics": int(port)
                  for name, port in re.findall(r"(\w+) http://127\.0\.0\.1:(\d+)/metrics", metrics)})
    return ports


async def internal_call_code(port: int, role: str, metadata=()) -> grpc.StatusCode:
    async with channel_to(port) as channel:
        try:
            await service_stub(role, channel).GetModelInfo(common_pb2.ModelInfoRequest(), timeout=10,
                                                            metadata=metadata)
        except grpc.aio.AioRpcError as error:
            return error.code()
    return grpc.StatusCode.OK


async def health_status(port: int) -> int:
    async with channel_to(port) as channel:
        return (await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)).status


@pytest.mark.parametrize("api_key", [None, "serve-api-key"], ids=["generated token", "api key"])
async def test_serve_refuses_unauthenticated_calls_on_every_port(api_key, tiny_llama_dir, tiny_llama_perturbed_dir,
                                                                 tmp_path):
    key_args = []
    if api_key:
        (tmp_path / "api-key").write_text(api_key)
        key_args = ["--api-key-file", str(tmp_path / "api-key")]
    process, _, lines = await asyncio.to_thread(
        start_serve, "--target", str(tiny_llama_dir), "--draft", str(tiny_llama_perturbed_dir),
        "--metrics-port", "0", *key_args, expect_metrics=True)
    try:
        ports = printed_ports(lines)
        listening = listening_sockets(process.pid)
        keyed = bearer_metadata(api_key)
        internal = {role: await internal_call_code(ports[role], role) for role in ("target", "draft")}
        internal_with_key = {role: await internal_call_code(ports[role], role, keyed) for role in ("target", "draft")}
        health = [await health_status(ports[name]) for name in ("orchestrator", "target", "draft")]
        async with channel_to(ports["orchestrator"]) as channel:
            try:
                unkeyed = await generate_with(channel)
            except grpc.aio.AioRpcError as error:
                unkeyed = error.code()
            keyed_tokens = await generate_with(channel, keyed)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{ports['http']}") as http:
            completion = await http.post("/v1/completions", json={"prompt": TINY_PROMPTS[0], "max_tokens": 4})
            http_health = (await http.get("/health")).status_code
            metrics = [(await http.get(f"http://127.0.0.1:{ports[f'{name} metrics']}/metrics")).status_code
                       for name in ("orchestrator", "target", "draft")]
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    # Every listening socket is one `serve` printed, and all of them bind --host (127.0.0.1).
    assert listening == {("127.0.0.1", port) for port in ports.values()}, (listening, ports)
    assert internal == {"target": grpc.StatusCode.UNAUTHENTICATED, "draft": grpc.StatusCode.UNAUTHENTICATED}
    assert internal_with_key == internal  # the internal token is the deployment's own, not the API key
    assert health == [health_pb2.HealthCheckResponse.SERVING] * 3 and http_health == 200
    assert metrics == [200, 200, 200]  # plain HTTP, open as before
    expected = list(target_greedy(str(tiny_llama_dir), "cpu", TINY_PROMPTS[0], MAX_TOKENS))
    assert keyed_tokens == expected  # the orchestrator holds the internal token
    if api_key:
        assert unkeyed == grpc.StatusCode.UNAUTHENTICATED and completion.status_code == 401
    else:
        assert unkeyed == expected and completion.status_code == 200


@pytest.mark.xdist_group("ray")
async def test_serve_on_ray_with_an_api_key_refuses_unauthenticated_calls(tiny_llama_dir, tiny_llama_perturbed_dir,
                                                                          tmp_path):
    """Ray mode: the replicas' internal token is the API key; without it every specmesh port refuses."""
    pytest.importorskip("ray")
    (tmp_path / "api-key").write_text("ray-api-key")
    process, endpoint, lines = await asyncio.to_thread(
        start_serve, "--target", str(tiny_llama_dir), "--draft", str(tiny_llama_perturbed_dir),
        "--backend", "ray", "--metrics-port", "-1", "--api-key-file", str(tmp_path / "api-key"),
        *serve_config(tmp_path, target_replicas=1, draft_replicas=1))
    keyed = bearer_metadata("ray-api-key")
    try:
        async with grpc.aio.insecure_channel(endpoint) as channel:
            try:
                unkeyed = await generate_with(channel)
            except grpc.aio.AioRpcError as error:
                unkeyed = error.code()
            keyed_tokens = await generate_with(channel, keyed)
            pools = (await admin_pb2_grpc.AdminStub(channel).ListReplicas(admin_pb2.ListReplicasRequest(), timeout=10,
                                                                          metadata=keyed)).pools
        replicas = {pool.pool: replica.address for pool in pools for replica in pool.replicas}
        internal = {}
        for role, address in replicas.items():
            port = int(address.rsplit(":", 1)[1])
            internal[role] = (address.rsplit(":", 1)[0], await internal_call_code(port, role),
                              await internal_call_code(port, role, bearer_metadata("wrong")),
                              await internal_call_code(port, role, keyed), await health_status(port))
        http_port = re.search(r"OpenAI API http://127\.0\.0\.1:(\d+)/v1", "\n".join(lines)).group(1)
        async with httpx.AsyncClient() as http:
            completion = await http.post(f"http://127.0.0.1:{http_port}/v1/completions",
                                         json={"prompt": TINY_PROMPTS[0], "max_tokens": 4})
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=120) == 0
    assert unkeyed == grpc.StatusCode.UNAUTHENTICATED and completion.status_code == 401
    assert keyed_tokens == list(target_greedy(str(tiny_llama_dir), "cpu", TINY_PROMPTS[0], MAX_TOKENS))
    refused, serving = grpc.StatusCode.UNAUTHENTICATED, health_pb2.HealthCheckResponse.SERVING
    assert internal == {role: ("127.0.0.1", refused, refused, grpc.StatusCode.OK, serving)
                        for role in ("draft", "target")}


def start_module(module: str, *args: str, env: dict[str, str]) -> tuple[subprocess.Popen, int]:
    """`python -m module args`; return the process and the port its 'listening on' line names."""
    process = subprocess.Popen([sys.executable, "-m", module, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env=dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", **env),
                               cwd=ROOT)
    lines = []
    for line in process.stdout:
        lines.append(line.strip())
        found = re.search(r"listening on 127\.0\.0\.1:(\d+)", line)
        if found:
            threading.Thread(target=process.stdout.read, daemon=True).start()  # keep the pipe drained
            return process, int(found.group(1))
    raise AssertionError(f"{module} exited before it was ready:\n" + "\n".join(lines[-30:]))


async def test_standalone_services_and_orchestrator_share_a_token_file(tiny_llama_dir, tmp_path):
    """Multi-machine set-up: the target reads the token from the environment, the orchestrator from a file."""
    (tmp_path / "token").write_text("standalone-token\n")
    target, target_port = await asyncio.to_thread(
        start_module, "target_service", "--model", str(tiny_llama_dir), env={INTERNAL_TOKEN_ENV: "standalone-token"})
    processes = [target]
    try:
        unauthenticated = await internal_call_code(target_port, "target")
        authenticated = await internal_call_code(target_port, "target", bearer_metadata("standalone-token"))
        orchestrator, port = await asyncio.to_thread(
            start_module, "orchestrator", "--target", f"127.0.0.1:{target_port}", "--tokenizer", str(tiny_llama_dir),
            "--port", "0", "--internal-token-file", str(tmp_path / "token"), env={})
        processes.append(orchestrator)
        async with channel_to(port) as channel:
            token_ids = await generate_with(channel)
    finally:
        for process in processes:
            process.send_signal(signal.SIGTERM)
        for process in processes:
            assert process.wait(timeout=60) == 0
    assert (unauthenticated, authenticated) == (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.OK)
    assert token_ids == list(target_greedy(str(tiny_llama_dir), "cpu", TINY_PROMPTS[0], MAX_TOKENS))
