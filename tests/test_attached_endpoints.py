"""`specmesh serve` over draft and target services it did not start, attached by address.

Real grpc.aio model servers on 127.0.0.1:0 over the tiny models, each started as `python -m
target_service` / `draft_service` starts one (with an internal token), attached through the
settings of a config file and served by the same builder `specmesh serve` uses (`create_servicer`
over the PoolsOptions its command line makes); the last test runs the real commands as processes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest

from attached import (ACQUIRE_TIMEOUT_S, Orchestrator, Service, TOKEN, pools_of, serve_args, start_service, stop_all,
                      token_file_in)
from harness import WORK_TIMEOUT_S, eventually, load, serve_config
from orchestrator.decoding.options import loop_config
from orchestrator.control.attached import AttachedUnavailable, parse_endpoints
from orchestrator.control.pools import Pools
from orchestrator.control.build import servicer_over_pools
from orchestrator.cli.main import build_parser, main, metrics_ports_of, pools_description, serve_pools_options
from orchestrator.control.config_error import ConfigError
from parity import target_greedy
from pools import MAX_TOKENS, PROMPT, generation, placed
from serve_cli import ROOT, specmesh, start_serve
from specmesh.server.security import Security
from specmesh.server.grpc_server import stop_server
from specmesh.v1 import admin_pb2
from benchmarks.tiny_models import TINY_PROMPTS


# ---- attached services, and `specmesh serve`'s orchestrator over them


def attaching(directory, targets: list[Service], drafts: list[Service], token_file=None,
              **settings) -> argparse.Namespace:
    config = dict(target_endpoints=[t.address for t in targets], speculation_policy="fixed",
                  num_speculative_tokens=2, **settings)
    if drafts:
        config["draft_endpoints"] = [d.address for d in drafts]
    if token_file is not None:
        config["internal_token_file"] = str(token_file)
    return serve_args(directory, **config)


def expected(model_dir, prompt: str = PROMPT, max_tokens: int = MAX_TOKENS) -> list[int]:
    return list(target_greedy(str(model_dir), "cpu", prompt, max_tokens))


@contextlib.asynccontextmanager
async def two_targets_and_a_draft(directory, target_dir, draft_dir):
    """Two attached targets (target-ext-0, target-ext-1) serving, an attached draft and the orchestrator
    over them; all stopped at the end."""
    targets = {f"target-ext-{i}": await start_service("target", target_dir) for i in range(2)}
    draft = await start_service("draft", draft_dir)
    orchestrator = await Orchestrator.start(target_dir, attaching(directory, list(targets.values()), [draft],
                                                                  token_file_in(directory)))
    try:
        await orchestrator.pool("target").wait_serving(2, WORK_TIMEOUT_S)
        yield targets, draft, orchestrator
    finally:
        await orchestrator.stop()
        await stop_all(*targets.values(), draft)


# ---- the settings


@pytest.mark.unit
def test_a_config_file_attaches_services_in_place_of_replicas(tmp_path):
    args = serve_args(tmp_path, target_endpoints=["10.0.0.1:50061", "10.0.0.2:50061"],
                      draft_endpoints="10.0.0.3:50062", internal_token_file=str(token_file_in(tmp_path)))
    pools, own_token = serve_pools_options(args, Security(), metrics_ports_of(-1))
    assert pools.attached == {"target": ("10.0.0.1:50061", "10.0.0.2:50061"), "draft": ("10.0.0.3:50062",)}
    assert pools.target is None and pools.draft is None  # serve starts no model process at all
    assert pools.attached_token == TOKEN and own_token != TOKEN and TOKEN not in repr(pools)
    assert pools.manage and pools_description("local", pools) == "attached services"
    built = Pools.from_options(pools)
    assert set(built.pools) == {"target", "draft"} and not built.controllers


@pytest.mark.unit
def test_one_role_attached_and_the_other_started_here(tmp_path, caplog):
    args = serve_args(tmp_path, target_endpoints=["[::1]:50061"])
    with caplog.at_level(logging.WARNING):
        pools, _ = serve_pools_options(args, Security(), metrics_ports_of(-1))
    assert pools.attached == {"target": ("[::1]:50061",)} and pools.target is None
    assert pools.draft is not None and pools.draft.replica.role == "draft"  # a local child of serve
    assert pools.attached_token is None and "sends no internal token to the attached services" in caplog.text
    assert pools_description("local", pools) == "local replica processes and attached services"
    ray = serve_pools_options(serve_args(tmp_path, backend="ray", draft_endpoints=["h:1"]), Security(),
                              metrics_ports_of(-1))[0]
    assert ray.backend == "ray" and ray.target is not None and ray.draft is None  # only the target is a Ray actor


@pytest.mark.unit
@pytest.mark.parametrize("value, problem", [
    ("host-without-port", "is not host:port"),
    (["h:0"], "from 1 to 65535"),
    (["h:65536"], "from 1 to 65535"),
    ("h:grpc", "from 1 to 65535"),
    ([], "an empty endpoint"),
    ("a:1,,b:2", "an empty endpoint"),
    (["::1:50061"], "in brackets"),
    (["h:1", "h:01"], "h:1 given more than once"),
])
@pytest.mark.parametrize("key", ["target-endpoints", "draft-endpoints"])
def test_a_malformed_endpoint_is_an_error_naming_the_key(tmp_path, capsys, key, value, problem):
    config = serve_config(tmp_path, **{key.replace("-", "_"): value})
    with pytest.raises(ConfigError, match=re.escape(f"key {key!r}")) as raised:
        build_parser().parse_args(["serve", *config])
    assert problem in str(raised.value)
    assert main(["serve", *config]) == 2  # before anything starts, in one line
    assert capsys.readouterr().err.count("\n") == 1


@pytest.mark.unit
def test_parse_endpoints_keeps_the_order_and_normalises_ports():
    assert parse_endpoints(" a:50061, [::1]:0050062 ") == ("a:50061", "[::1]:50062")


@pytest.mark.unit
@pytest.mark.parametrize("settings, named", [
    (dict(target_endpoints=["h:1"], target_replicas=2), "target-replicas sizes the target replicas serve starts"),
    (dict(draft_endpoints=["h:1"], draft_max_replicas=3), "draft-max-replicas"),
    (dict(draft_endpoints=["h:1"], draft="none"), "draft-endpoints attaches draft services, but draft is 'none'"),
    (dict(target_endpoints=["h:1"], internal_token_file="no-such-file"), "--internal-token-file: cannot read"),
])
def test_contradicting_settings_stop_serve_before_anything_starts(tmp_path, capsys, settings, named):
    assert main(["serve", *serve_config(tmp_path, **settings)]) == 2
    error = capsys.readouterr().err
    assert named in error and error.count("\n") == 1


# ---- served over attached services


async def test_two_attached_targets_and_an_attached_draft_serve_the_targets_own_tokens(
        tmp_path, tiny_llama_dir, tiny_llama_perturbed_dir):
    async with two_targets_and_a_draft(tmp_path, tiny_llama_dir, tiny_llama_perturbed_dir) as (
            targets, draft, orchestrator):
        prompts = TINY_PROMPTS[:4]
        outputs = await asyncio.gather(*(orchestrator.generate(prompt) for prompt in prompts))
        assert outputs == [expected(tiny_llama_dir, prompt) for prompt in prompts]
        pool = orchestrator.pool("target")
        assert pool.replicas["target-ext-0"].placed > 0 and pool.replicas["target-ext-1"].placed > 0  # spread
        assert orchestrator.pool("draft").replicas["draft-ext-0"].placed == len(prompts)  # it drafted for each
        listed = await orchestrator.replicas()
        assert {name: (r.address, r.state) for name, r in listed.items()} == {
            **{name: (target.address, "serving") for name, target in targets.items()},
            "draft-ext-0": (draft.address, "serving")}
        for call in (orchestrator.admin.ScalePool(admin_pb2.ScalePoolRequest(pool="target", replicas=3)),
                     orchestrator.admin.ReplaceModel(admin_pb2.ReplaceModelRequest(pool="draft", model="m"))):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "-endpoints" in refused.value.details()


async def test_an_attached_target_stopped_mid_generation_fails_over_to_the_other(
        tmp_path, tiny_llama_dir, tiny_llama_perturbed_dir):
    _, tokenizer = load(str(tiny_llama_dir), "cpu")
    async with two_targets_and_a_draft(tmp_path, tiny_llama_dir, tiny_llama_perturbed_dir) as (
            targets, _, orchestrator):
        backends = orchestrator.servicer.backends
        gen, tokens, stopped = generation(tokenizer, backends.target, backends.draft), [], None
        async for batch in gen.tokens():
            tokens.extend(batch)
            if stopped is None and gen.stats.rounds == 2:
                stopped = placed(backends.target, gen)
                await targets[stopped].stop()
            elif stopped is not None and gen.session_id in backends.target.sessions:
                assert placed(backends.target, gen) != stopped
        assert stopped is not None and tokens == expected(tiny_llama_dir)
        assert backends.target.failovers == 1 and gen.stats.draft_tokens > 0


async def test_a_draining_attached_target_finishes_its_session_while_new_ones_go_to_the_other(
        tmp_path, tiny_llama_dir, tiny_llama_perturbed_dir):
    _, tokenizer = load(str(tiny_llama_dir), "cpu")
    stopping = None
    async with two_targets_and_a_draft(tmp_path, tiny_llama_dir, tiny_llama_perturbed_dir) as (
            targets, _, orchestrator):
        backends, pool = orchestrator.servicer.backends, orchestrator.pool("target")
        try:
            gen, tokens = generation(tokenizer, backends.target, backends.draft), []
            stream = gen.tokens()
            while gen.stats.rounds < 1:
                tokens.extend(await stream.__anext__())
            draining = placed(backends.target, gen)
            (other,) = set(targets) - {draining}
            # SIGTERM's drain (specmesh.server.grpc_server.serve_until_signal): health NOT_SERVING, new sessions refused
            stopping = asyncio.ensure_future(stop_server(targets[draining].server, targets[draining].health,
                                                         WORK_TIMEOUT_S))
            await eventually(lambda: pool.replicas[draining].serving, False)
            placed_on_draining = pool.replicas[draining].placed
            assert await orchestrator.generate(TINY_PROMPTS[1]) == expected(tiny_llama_dir, TINY_PROMPTS[1])
            assert pool.replicas[draining].placed == placed_on_draining and pool.replicas[other].placed == 1
            assert (await orchestrator.replicas())[other].state == "serving"
            async for batch in stream:  # the draining target's own session runs on to its end there
                tokens.extend(batch)
                if gen.session_id in backends.target.sessions:
                    assert placed(backends.target, gen) == draining
            assert tokens == expected(tiny_llama_dir) and backends.target.failovers == 0
            await asyncio.wait_for(stopping, WORK_TIMEOUT_S)  # the drain ends once that session is closed
            assert not targets[draining].engine.sessions
        finally:
            if stopping is not None:
                stopping.cancel()


async def test_an_attached_target_holding_another_token_is_refused(tmp_path, caplog, tiny_llama_dir,
                                                                   tiny_llama_perturbed_dir):
    wrong = await start_service("target", tiny_llama_dir, token="another-t0ken")  # target-ext-0: first by name
    right = await start_service("target", tiny_llama_dir)
    draft = await start_service("draft", tiny_llama_perturbed_dir)
    orchestrator = await Orchestrator.start(tiny_llama_dir, attaching(tmp_path, [wrong, right], [draft],
                                                                      token_file_in(tmp_path)))
    pool = orchestrator.pool("target")
    try:
        await eventually(lambda: pool.replicas["target-ext-0"].refused_us)
        assert f"target replica target-ext-0 at {wrong.address} refuses this orchestrator" in caplog.text
        assert await orchestrator.generate(PROMPT) == expected(tiny_llama_dir)  # the right token works
        assert pool.replicas["target-ext-0"].placed == 0 and pool.replicas["target-ext-1"].placed == 1
        assert {name: r.state for name, r in (await orchestrator.replicas()).items()} == {
            "target-ext-0": "unhealthy", "target-ext-1": "serving", "draft-ext-0": "serving"}
        await right.stop()
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await orchestrator.generate(PROMPT)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "target-ext-0" in refused.value.details() and "internal token" in refused.value.details()
        assert time.monotonic() - started < ACQUIRE_TIMEOUT_S + 10.0  # within the wait, never a hang
    finally:
        await orchestrator.stop()
        await stop_all(wrong, right, draft)


async def test_serve_stops_at_once_when_every_attached_target_refuses_it(tmp_path, tiny_llama_dir):
    wrong = await start_service("target", tiny_llama_dir, token="another-t0ken")
    _, tokenizer = load(str(tiny_llama_dir), "cpu")
    args = attaching(tmp_path, [wrong], [], token_file_in(tmp_path), draft="none")
    pools = Pools.from_options(pools_of(args))  # start_timeout_s is serve's 30 minutes: this must not wait it out
    started = time.monotonic()
    try:
        with pytest.raises(AttachedUnavailable, match="every attached target service refuses this orchestrator"):
            await servicer_over_pools(tokenizer, pools, loop_config(args))
        assert time.monotonic() - started < WORK_TIMEOUT_S
    finally:
        await pools.stop()
        await wrong.stop()


# ---- the real commands: `python -m target_service` on its own, `specmesh serve` attaching it


def start_target_process(model_dir, token_file) -> tuple[subprocess.Popen, str]:
    """`python -m target_service` with a token file, as on another machine; returns it and its address."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    process = subprocess.Popen([sys.executable, "-m", "target_service", "--model", str(model_dir), "--port", "0",
                                "--cpu-linear", "torch", "--internal-token-file", str(token_file)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    lines = []
    for line in process.stdout:
        lines.append(line.strip())
        found = re.search(r"target listening on (\S+)", line)
        if found:
            threading.Thread(target=process.stdout.read, daemon=True).start()  # keep the pipe drained
            return process, found.group(1).rstrip(",")
    raise AssertionError("target_service exited before it listened:\n" + "\n".join(lines[-30:]))


def test_serve_attaches_a_target_process_and_starts_only_the_draft(tmp_path, tiny_llama_dir, tiny_llama_perturbed_dir):
    token_file = token_file_in(tmp_path)
    target, address = start_target_process(tiny_llama_dir, token_file)
    serve = None
    try:
        config = serve_config(tmp_path, target_endpoints=[address], internal_token_file=str(token_file),
                              cpu_linear="torch")
        serve, endpoint, lines = start_serve("--target", str(tiny_llama_dir), "--draft", str(tiny_llama_perturbed_dir),
                                             "--num-speculative-tokens", "3", "--speculation-policy", "fixed",
                                             "--metrics-port", "-1", *config)
        assert any("(local replica processes and attached services;" in line for line in lines)
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        done = subprocess.run(specmesh("generate", "--endpoint", endpoint, "--max-tokens", "12", "--json", PROMPT),
                              capture_output=True, text=True, env=env, timeout=WORK_TIMEOUT_S)
        assert done.returncode == 0, done.stderr
        result = json.loads(done.stdout)
        assert result["token_ids"] == expected(tiny_llama_dir, PROMPT, 12) and result["stats"]["draft_tokens"] > 0
        listed = subprocess.run(specmesh("replicas", "--endpoint", endpoint), capture_output=True, text=True, env=env,
                                timeout=WORK_TIMEOUT_S)
        assert re.search(rf"target-ext-0 +serving +{re.escape(address)}", listed.stdout), listed.stdout
        assert re.search(r"draft-0 +serving", listed.stdout), listed.stdout
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=WORK_TIMEOUT_S) == 0
        assert target.poll() is None  # serve stops what it started, never an attached service
    finally:
        for process in (serve, target):
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGTERM)
                process.wait(timeout=WORK_TIMEOUT_S)
