"""Local replica pools: real child processes (the supervisor's), SIGKILLed mid-generation.

The same routing and failover as the Ray pools, with replicas that are `specmesh serve`'s
own children. The loop's token stream is an async generator, so a test kills a replica
between two rounds at an exact point and checks what the following rounds do.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from functools import partial
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from harness import eventually, load
from orchestrator.control.pools import pool_health_name, same_gpu
from orchestrator.control.options import RestartPolicy
from orchestrator.serving.server import serve_grpc
from parity import target_greedy
from pools import LocalDeployment, MAX_TOKENS, PROMPT, RESTART_WAIT_S
from specmesh.loading import openmp
from specmesh.roles import DRAFT
from specmesh.v1 import generation_pb2, generation_pb2_grpc


@pytest.fixture(scope="module")
async def deployment(tiny_llama_dir, tiny_llama_perturbed_dir):
    """One replica per role, each allowed one restart in 10 minutes (the crash-loop tests use the second death),
    then retried after 2 s: long enough that a test sees it backing off, short enough to see it come back."""
    policy = RestartPolicy(initial_backoff_s=0.05, max_restarts=1, window_s=600.0, crash_loop_backoff_s=2.0,
                           max_crash_loop_backoff_s=4.0)
    deployment = await LocalDeployment.start(tiny_llama_dir, tiny_llama_perturbed_dir, policy)
    deployment.server, port, _ = await serve_grpc(deployment.servicer)
    deployment.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield deployment
    await deployment.channel.close()
    await deployment.server.stop(None)
    await deployment.pools.stop()


async def generate_killing(deployment: LocalDeployment, tokenizer, role: str, at_round: int):
    """Generate greedily, SIGKILLing the role's replica once `at_round` rounds are done."""
    gen, tokens, killed = deployment.generation(tokenizer), [], None
    async for batch in gen.tokens():
        tokens.extend(batch)
        if killed is None and gen.stats.rounds == at_round:
            killed = deployment.kill(role)
    assert killed is not None, "the generation ended before the kill"
    return gen, tokens, killed


def start_environment(pid: int) -> dict[str, str]:
    """The environment a process started with (Linux's /proc)."""
    entries = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
    return dict(entry.split("=", 1) for entry in entries if "=" in entry)


async def test_the_draft_replica_starts_with_a_short_openmp_spin_and_the_target_with_libgomps_own(deployment):
    """Each replica must have its role's GOMP_SPINCOUNT when it loads torch (specmesh.loading.openmp): from the
    environment it was spawned with. The spawning process's own environment is left as it was."""
    for role in ("draft", "target"):
        await asyncio.wait_for(deployment.replica(role).resolve(), RESTART_WAIT_S)
    draft, target = (start_environment(deployment.replica(role).process.pid) for role in ("draft", "target"))
    users_own = os.environ.get("GOMP_SPINCOUNT")  # a user's own setting, kept by both roles
    user_set = any(name in os.environ for name in openmp.USER_SETTINGS)
    assert draft.get("GOMP_SPINCOUNT") == (users_own if user_set else DRAFT.openmp_spin_count)
    assert target.get("GOMP_SPINCOUNT") == users_own


async def test_draft_killed_mid_stream_changes_nothing_and_speculation_returns(deployment, tiny_llama_dir):
    _, tokenizer = load(str(tiny_llama_dir), "cpu")
    expected = list(target_greedy(str(tiny_llama_dir), "cpu", PROMPT, MAX_TOKENS))
    assert len(expected) > 12, "the prompt must run long enough to lose the draft mid-generation"
    restarts = deployment.restarts("draft")
    gen, tokens, old = await generate_killing(deployment, tokenizer, "draft", at_round=2)
    assert tokens == expected  # went on target-only from the committed prefix, without a client error
    assert gen.stats.draft_fallback
    await deployment.wait_serving_elsewhere("draft", old)
    assert deployment.restarts("draft") == restarts + 1
    again = deployment.generation(tokenizer)
    assert [t async for batch in again.tokens() for t in batch] == expected
    assert again.stats.draft_tokens > 0 and not again.stats.draft_fallback  # speculating again


async def test_target_killed_mid_stream_resumes_on_the_restarted_replica(deployment, tiny_llama_dir):
    _, tokenizer = load(str(tiny_llama_dir), "cpu")
    expected = list(target_greedy(str(tiny_llama_dir), "cpu", PROMPT, MAX_TOKENS))
    failovers, restarts = deployment.servicer.backends.target.failovers, deployment.restarts("target")
    gen, tokens, old = await generate_killing(deployment, tokenizer, "target", at_round=2)
    assert tokens == expected  # re-prefilled from the committed tokens: none lost, none repeated
    assert deployment.servicer.backends.target.failovers == failovers + 1
    assert deployment.restarts("target") == restarts + 1
    assert deployment.replica("target").address.result() != old


async def kill_until_failed(deployment: LocalDeployment, role: str) -> int:
    """Kill the role's replica, letting it restart, until it is crash-looping (the role failed); the kills."""
    kills = 0
    while role not in deployment.pools.failed:
        old, kills = deployment.kill(role), kills + 1
        await eventually(lambda: role in deployment.pools.failed or any(
            r.address != old for r in deployment.pools.pools[role].routable()), timeout_s=RESTART_WAIT_S)
    return kills


async def health_of(deployment: LocalDeployment, name: str) -> int:
    reply = await health_pb2_grpc.HealthStub(deployment.channel).Check(
        health_pb2.HealthCheckRequest(service=name), timeout=10)
    return reply.status


async def wait_health(deployment: LocalDeployment, names, status: int, timeout_s: float = RESTART_WAIT_S) -> None:
    for name in names:
        await eventually(partial(health_of, deployment, name), status, timeout_s=timeout_s)


def role_failed(deployment: LocalDeployment, role: str) -> float | None:
    return deployment.metrics.registry.get_sample_value("specmesh_role_failed", {"role": role})


async def generate(deployment: LocalDeployment) -> tuple[int, ...]:
    stub = generation_pb2_grpc.GenerationStub(deployment.channel)
    request = generation_pb2.GenerateRequest(prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0)
    return tuple([t async for response in stub.Generate(request, timeout=60) for t in response.token_ids])


TARGET_HEALTH = ("", "specmesh.v1.Generation", pool_health_name("target"))


async def test_a_stopped_target_shows_in_health_until_it_answers_again(deployment):
    """SIGSTOP: the process lives, so no restart, but it answers nothing; the pool's checks time out."""
    pid = deployment.replica("target").process.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        await wait_health(deployment, TARGET_HEALTH, health_pb2.HealthCheckResponse.NOT_SERVING, timeout_s=30)
        assert await health_of(deployment, pool_health_name("draft")) == health_pb2.HealthCheckResponse.SERVING
    finally:
        os.kill(pid, signal.SIGCONT)
    await wait_health(deployment, TARGET_HEALTH, health_pb2.HealthCheckResponse.SERVING, timeout_s=30)
    assert deployment.replica("target").process.pid == pid and role_failed(deployment, "target") == 0


async def test_a_draft_past_its_restart_cap_comes_back_by_itself(deployment, tiny_llama_dir):
    _, tokenizer = load(str(tiny_llama_dir), "cpu")
    expected = target_greedy(str(tiny_llama_dir), "cpu", PROMPT, MAX_TOKENS)
    restarts = deployment.restarts("draft")
    kills = await kill_until_failed(deployment, "draft")
    (replica,) = deployment.pools.state("draft").replicas
    assert replica.state == "backoff" and 0 < replica.retry_in_s <= 2.0  # what `specmesh replicas` shows
    await wait_health(deployment, [pool_health_name("draft")], health_pb2.HealthCheckResponse.NOT_SERVING)
    assert await health_of(deployment, "") == health_pb2.HealthCheckResponse.SERVING
    assert role_failed(deployment, "draft") == 1
    assert await generate(deployment) == expected  # target-only, or drafting again: the same tokens

    await eventually(lambda: "draft" in deployment.pools.failed, False, timeout_s=RESTART_WAIT_S)  # untouched
    assert role_failed(deployment, "draft") == 0
    await wait_health(deployment, [pool_health_name("draft")], health_pb2.HealthCheckResponse.SERVING)
    assert deployment.restarts("draft") == restarts + kills  # each restart counted, the crash loop's too
    again = deployment.generation(tokenizer)
    assert tuple([t async for batch in again.tokens() for t in batch]) == expected
    assert again.stats.draft_tokens > 0 and not again.stats.draft_fallback  # speculating again


async def test_a_target_past_its_restart_cap_comes_back_by_itself(deployment, tiny_llama_dir):
    expected = target_greedy(str(tiny_llama_dir), "cpu", PROMPT, MAX_TOKENS)
    restarts = deployment.restarts("target")
    kills = await kill_until_failed(deployment, "target")
    await wait_health(deployment, TARGET_HEALTH, health_pb2.HealthCheckResponse.NOT_SERVING)
    assert role_failed(deployment, "target") == 1
    started = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await generate(deployment)
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE and "target" in raised.value.details()
    assert time.monotonic() - started < 10  # a failed role answers at once, not after the request's wait

    await eventually(lambda: "target" in deployment.pools.failed, False, timeout_s=RESTART_WAIT_S)  # untouched
    await wait_health(deployment, TARGET_HEALTH, health_pb2.HealthCheckResponse.SERVING)
    assert role_failed(deployment, "target") == 0
    assert await generate(deployment) == expected  # the same `serve`, serving again
    assert deployment.restarts("target") == restarts + kills


def test_a_draft_on_the_targets_gpu_waits_for_the_target_to_size_its_kv():
    """Pools.start starts such a draft once the target is ready (each allocates a fraction of what it finds free)."""
    assert same_gpu("cuda", "cuda:0") and same_gpu("cuda:1", "cuda:1")
    assert not same_gpu("cuda:0", "cuda:1") and not same_gpu("cpu", "cpu") and not same_gpu("cuda", "cpu")
