"""Transport security on real servers: TLS, mutual TLS on every channel, and the API key."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import ssl

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from front_door import generate_with
from harness import load, serve_config, start_stack
from orchestrator.cli.main import build_parser, main as cli_main
from orchestrator.serving.clients import open_channel
from orchestrator.serving.http_api import create_app, start_http_server, stop_http_server
from orchestrator.control.build import OrchestratorOptions
from orchestrator.control.build import create_servicer
from parity import target_greedy
from pki import make_pki
from serve_cli import start_serve
from specmesh.server.security import SecurityConfigError, TLSConfig, security_from_args
from specmesh.server.service import ServiceOptions, add_service_arguments
from specmesh.v1 import admin_pb2, admin_pb2_grpc, common_pb2, target_pb2_grpc
from benchmarks.tiny_models import TINY_PROMPTS

API_KEY = "s3cret-key"
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


def client_tls(pki, issued=None, ca=None) -> TLSConfig:
    """A client's side: trusts `ca` (default: the servers' CA), presents `issued` when given."""
    return TLSConfig.load(issued and str(issued.cert), issued and str(issued.key), str(ca or pki.ca))


@pytest.fixture(scope="module")
async def mtls_stack(pki, tiny_llama_dir, tiny_llama_perturbed_dir):
    """Every server requires client certificates; the orchestrator and the test client present one."""
    server_tls = TLSConfig.load(str(pki.server.cert), str(pki.server.key), str(pki.ca))
    stack = await start_stack(tiny_llama_dir, tiny_llama_perturbed_dir, k=3, server_tls=server_tls,
                              channel_tls=client_tls(pki, pki.client), client_tls=client_tls(pki, pki.client))
    yield stack
    await stack.stop()


async def test_server_tls_generates_the_targets_tokens(pki, tiny_llama_dir, tiny_llama_perturbed_dir):
    server_tls = TLSConfig.load(str(pki.server.cert), str(pki.server.key), None)
    stack = await start_stack(tiny_llama_dir, tiny_llama_perturbed_dir, k=3, server_tls=server_tls,
                              channel_tls=client_tls(pki), client_tls=client_tls(pki))
    try:
        token_ids, _, last = await stack.generate(prompt=TINY_PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0.0)
        async with open_channel(f"127.0.0.1:{stack.port}") as plaintext:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await generate_with(plaintext)
    finally:
        await stack.stop()
    assert tuple(token_ids) == target_greedy(str(tiny_llama_dir), "cpu", TINY_PROMPTS[0], MAX_TOKENS)
    assert last.stats.draft_tokens > 0 and not last.stats.draft_fallback  # the draft channel works too
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_mutual_tls_stack_generates_the_targets_tokens(mtls_stack, tiny_llama_dir):
    token_ids, _, last = await mtls_stack.generate(prompt=TINY_PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0.0)
    assert tuple(token_ids) == target_greedy(str(tiny_llama_dir), "cpu", TINY_PROMPTS[0], MAX_TOKENS)
    assert last.stats.draft_tokens > 0 and not last.stats.draft_fallback


@pytest.mark.parametrize("who", ["no certificate", "foreign CA's certificate"])
async def test_mutual_tls_refuses_clients_without_a_trusted_certificate(mtls_stack, pki, who):
    tls = client_tls(pki) if who == "no certificate" else client_tls(pki, pki.foreign_client)
    for port in (mtls_stack.port, mtls_stack.target_port):  # the client-facing and an internal service
        async with open_channel(f"127.0.0.1:{port}", tls) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                if port == mtls_stack.port:
                    await generate_with(channel)
                else:
                    await target_pb2_grpc.TargetServiceStub(channel).GetModelInfo(common_pb2.ModelInfoRequest(),
                                                                                  timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, port


async def test_cli_generate_over_mutual_tls(mtls_stack, pki, tiny_llama_dir, capsys):
    argv = ["generate", TINY_PROMPTS[0], "--endpoint", f"127.0.0.1:{mtls_stack.port}", "--json",
            "--max-tokens", str(MAX_TOKENS), "--tls-root-ca", str(pki.ca),
            "--tls-client-cert", str(pki.client.cert), "--tls-client-key", str(pki.client.key)]
    assert await asyncio.to_thread(cli_main, argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert tuple(result["token_ids"]) == target_greedy(str(tiny_llama_dir), "cpu", TINY_PROMPTS[0], MAX_TOKENS)
    assert await asyncio.to_thread(cli_main, argv[:-4]) == 2  # no client certificate: refused
    assert "UNAVAILABLE" in capsys.readouterr().err


async def test_https_api_with_mutual_tls(mtls_stack, pki, tiny_llama_dir):
    _, tokenizer = load(str(tiny_llama_dir), "cpu")
    servicer = await create_servicer(tokenizer, OrchestratorOptions(
        f"127.0.0.1:{mtls_stack.target_port}", None, channel_tls=client_tls(pki, pki.client)))
    server_tls = TLSConfig.load(str(pki.server.cert), str(pki.server.key), str(pki.ca))
    server, port, task = await start_http_server(create_app(servicer), "127.0.0.1", 0, server_tls)
    trusted = ssl.create_default_context(cafile=str(pki.ca))
    with_cert = ssl.create_default_context(cafile=str(pki.ca))
    with_cert.load_cert_chain(str(pki.client.cert), str(pki.client.key))
    try:
        async with httpx.AsyncClient(verify=with_cert) as client:
            reply = await client.post(f"https://localhost:{port}/v1/completions",
                                      json={"prompt": TINY_PROMPTS[0], "max_tokens": 4, "temperature": 0})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] > 0
        async with httpx.AsyncClient(verify=trusted) as client:
            with pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)):
                (await client.get(f"https://localhost:{port}/health")).raise_for_status()
    finally:
        await stop_http_server(server, task)


@pytest.fixture(scope="module")
async def keyed_stack(tiny_llama_dir, tiny_llama_perturbed_dir):
    stack = await start_stack(tiny_llama_dir, tiny_llama_perturbed_dir, k=3, api_key=API_KEY)
    yield stack
    await stack.stop()


@pytest.mark.parametrize("header", [None, "Bearer wrong-key", f"Basic {API_KEY}", f"Bearer {API_KEY}x"])
async def test_grpc_refuses_a_missing_or_wrong_api_key(keyed_stack, header):
    metadata = (("authorization", header),) if header else ()
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await generate_with(keyed_stack.channel, metadata)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    admin = admin_pb2_grpc.AdminStub(keyed_stack.channel)  # the kill switch is guarded too
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await admin.SetSpeculation(admin_pb2.SetSpeculationRequest(enabled=False), timeout=10, metadata=metadata)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.aio.AioRpcError) as refused:  # and replacing the draft's model
        await admin.ReplaceModel(admin_pb2.ReplaceModelRequest(pool="draft", model="x"), timeout=10, metadata=metadata)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_grpc_right_api_key_works_and_health_stays_open(keyed_stack):
    token_ids, _, last = await keyed_stack.generate(prompt=TINY_PROMPTS[1], max_tokens=8, temperature=0.0)
    assert token_ids and last.finish_reason
    admin = admin_pb2_grpc.AdminStub(keyed_stack.channel)
    state = await admin.GetSpeculation(admin_pb2.GetSpeculationRequest(), timeout=10,
                                       metadata=(("authorization", f"Bearer {API_KEY}"),))
    assert state.enabled
    with pytest.raises(grpc.aio.AioRpcError) as no_pools:  # past the key: fixed endpoints have no pool to roll
        await admin.ReplaceModel(admin_pb2.ReplaceModelRequest(pool="draft", model="x"), timeout=10,
                                 metadata=(("authorization", f"Bearer {API_KEY}"),))
    assert no_pools.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    health = await health_pb2_grpc.HealthStub(keyed_stack.channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING


async def test_http_api_key(keyed_stack, tiny_llama_dir):
    _, tokenizer = load(str(tiny_llama_dir), "cpu")
    servicer = await create_servicer(tokenizer, OrchestratorOptions(f"127.0.0.1:{keyed_stack.target_port}", None))
    server, port, task = await start_http_server(create_app(servicer, API_KEY), "127.0.0.1", 0)
    base = f"http://127.0.0.1:{port}"
    try:
        async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="wrong-key", max_retries=0) as client:
            with pytest.raises(openai.AuthenticationError) as refused:
                await client.completions.create(model=None, prompt=TINY_PROMPTS[0], max_tokens=4)
        assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"
        async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0) as client:
            completion = await client.completions.create(model=None, prompt=TINY_PROMPTS[0], max_tokens=4)
        assert completion.usage.completion_tokens > 0
        async with httpx.AsyncClient() as client:
            assert (await client.get(f"{base}/health")).status_code == 200
            missing = await client.post(f"{base}/v1/completions", json={"prompt": "x", "max_tokens": 4})
            assert (await client.get(f"{base}/v1/models")).status_code == 401
        assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
        assert missing.headers["www-authenticate"] == "Bearer"
    finally:
        await stop_http_server(server, task)


def test_unreadable_files_fail_at_start_naming_the_flag(pki, tmp_path, capsys):
    with pytest.raises(SecurityConfigError, match="--tls-key: cannot read"):
        TLSConfig.load(str(pki.server.cert), str(tmp_path / "missing.key"), None)
    not_pem = tmp_path / "ca.txt"
    not_pem.write_text("hello")
    with pytest.raises(SecurityConfigError, match="--tls-root-ca: .* is not a PEM file"):
        TLSConfig.load(None, None, str(not_pem), flags=("--tls-client-cert", "--tls-client-key", "--tls-root-ca"))
    assert cli_main(["serve", "--tls-cert", str(pki.server.cert), "--tls-key", str(tmp_path / "no.key")]) == 2
    assert "--tls-key: cannot read" in capsys.readouterr().err
    assert cli_main(["generate", "x", "--api-key-file", str(tmp_path / "no-key")]) == 2
    assert "--api-key-file: cannot read" in capsys.readouterr().err


def test_serve_security_needs_matching_channel_settings(pki, tmp_path):
    server = ["serve", "--tls-cert", str(pki.server.cert), "--tls-key", str(pki.server.key), "--tls-ca", str(pki.ca)]
    with pytest.raises(SecurityConfigError, match="--tls-client-cert"):
        security_from_args(build_parser().parse_args(server))
    security = security_from_args(build_parser().parse_args(
        server + serve_config(tmp_path, tls_client_cert=str(pki.client.cert), tls_client_key=str(pki.client.key))))
    assert security.server_tls.mutual and security.channel_tls.ca == pki.ca.read_bytes()  # root CA from --tls-ca


async def test_serve_processes_with_mutual_tls_and_api_key(pki, tiny_llama_dir, tiny_llama_perturbed_dir, tmp_path,
                                                           monkeypatch, capsys):
    """`specmesh serve` as users run it: the settings reach all three processes and their channels;
    the client takes its settings from the environment."""
    key_file = tmp_path / "api-key"
    key_file.write_text(API_KEY + "\n")
    process, endpoint, _ = await asyncio.to_thread(
        start_serve, "--target", str(tiny_llama_dir), "--draft", str(tiny_llama_perturbed_dir), "--metrics-port", "-1",
        "--http-port", "-1", "--tls-cert", str(pki.server.cert), "--tls-key", str(pki.server.key),
        "--tls-ca", str(pki.ca), "--api-key-file", str(key_file),
        *serve_config(tmp_path, tls_client_cert=str(pki.client.cert), tls_client_key=str(pki.client.key)))
    for name, value in (("SPECMESH_TLS_ROOT_CA", pki.ca), ("SPECMESH_TLS_CLIENT_CERT", pki.client.cert),
                        ("SPECMESH_TLS_CLIENT_KEY", pki.client.key), ("SPECMESH_API_KEY", API_KEY)):
        monkeypatch.setenv(name, str(value))
    capsys.readouterr()
    try:
        # A fixed k: every round asks the draft, over its mutual-TLS channel (the adaptive policy may
        # rightly find that the tiny draft does not pay, and then no round would reach it).
        code = await asyncio.to_thread(cli_main, ["generate", "--endpoint", endpoint, "--max-tokens", str(MAX_TOKENS),
                                                  "--num-speculative-tokens", "3", "--json", TINY_PROMPTS[0]])
        async with open_channel(endpoint, client_tls(pki, pki.client)) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as unkeyed:
                await generate_with(channel)
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert tuple(result["token_ids"]) == target_greedy(str(tiny_llama_dir), "cpu", TINY_PROMPTS[0], MAX_TOKENS)
    assert result["stats"]["draft_tokens"] > 0 and not result["stats"]["draft_fallback"]
    assert unkeyed.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_everything_binds_loopback_unless_told_otherwise():
    service = argparse.ArgumentParser()
    add_service_arguments(service, default_model="m")
    assert build_parser().parse_args(["serve"]).host == "127.0.0.1"  # gRPC, HTTP API and metrics alike
    assert service.parse_args([]).host == ServiceOptions(model="m").host == "127.0.0.1"
