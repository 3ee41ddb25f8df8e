"""Rolling the draft pool over to another model on a running local deployment.

Real child processes (the local supervisor's), the real Admin service over gRPC. The
deployment starts with a draft that shares nothing with the target (acceptance near
zero) and is rolled to one close to it: generations paused between two rounds across
the whole swap, and gRPC streams running meanwhile, must all end with the target's
own greedy output, and afterwards the acceptance metrics name the new draft and show
it accepting far more. Bad rollouts (a missing model, another vocabulary, the target
pool) are refused before any old replica is touched. The tests share one deployment
and run in file order: the refusals first, then the rollout.
"""

from __future__ import annotations

import asyncio
import contextlib
import re

import grpc
import pytest

from front_door import bad_request_fields
from harness import eventually, load
from orchestrator.decoding.request import LoopConfig
from orchestrator.control.options import RestartPolicy
from orchestrator.serving.pool import PoolSpec
from orchestrator.control.pools import Pools
from orchestrator.control.options import PoolsOptions
from orchestrator.control.build import servicer_over_pools
from orchestrator.cli import main as cli
from orchestrator.serving.server import serve_grpc
from parity import target_greedy
from pools import LocalDeployment, MAX_TOKENS, PROMPT, RESTART_WAIT_S
from specmesh.server.metrics import OrchestratorMetrics
from specmesh.server.service import ReplicaConfig, ServiceOptions
from specmesh.v1 import admin_pb2, admin_pb2_grpc, generation_pb2, generation_pb2_grpc

DRAFT_REPLICAS = 2
ROLLOUT_TIMEOUT_S = 600.0  # four child processes start (import torch, load) on a shared 2-core machine
PAUSED_GENERATIONS = 3
STREAMING_CLIENTS = 2


def draft_spec(model) -> PoolSpec:
    # Short graces: a replica being removed waits this long for sessions paused by the test, which then
    # move to a new replica (the case under test) instead of finishing on the old one.
    service = ServiceOptions(model=str(model), shutdown_grace_s=1.0)
    return PoolSpec(ReplicaConfig("draft", service), replicas=DRAFT_REPLICAS, drain_grace_s=1.0)


@pytest.fixture(scope="module")
async def deployment(tiny_llama_dir, tiny_llama_unrelated_dir):
    options = PoolsOptions(backend="local", target=PoolSpec(ReplicaConfig("target", ServiceOptions(
                               model=str(tiny_llama_dir)))), draft=draft_spec(tiny_llama_unrelated_dir),
                           check_interval_s=0.1, acquire_timeout_s=RESTART_WAIT_S,
                           restart_policy=RestartPolicy(initial_backoff_s=0.05))
    metrics = OrchestratorMetrics()
    pools = Pools.from_options(options, metrics=metrics)
    _, tokenizer = load(str(tiny_llama_dir), "cpu")
    servicer = await servicer_over_pools(tokenizer, pools, LoopConfig(num_speculative_tokens=2))
    deployment = LocalDeployment(pools, servicer, metrics)
    await pools.pools["draft"].wait_serving(DRAFT_REPLICAS, RESTART_WAIT_S)
    deployment.server, port, _ = await serve_grpc(servicer)
    deployment.endpoint = f"127.0.0.1:{port}"
    deployment.channel = grpc.aio.insecure_channel(deployment.endpoint)
    deployment.admin = admin_pb2_grpc.AdminStub(deployment.channel)
    deployment.tokenizer = tokenizer
    yield deployment
    await deployment.channel.close()
    await deployment.server.stop(None)
    await pools.stop()


@pytest.fixture(scope="module")
def expected(tiny_llama_dir) -> list[int]:
    return list(target_greedy(str(tiny_llama_dir), "cpu", PROMPT, MAX_TOKENS))


async def generate(deployment) -> generation_pb2.GenerateResponse:
    """One greedy request over gRPC: every response's tokens, and the last response (with the stats)."""
    stub = generation_pb2_grpc.GenerationStub(deployment.channel)
    request = generation_pb2.GenerateRequest(prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0,
                                             num_speculative_tokens=2)
    tokens, last = [], None
    async for response in stub.Generate(request, timeout=120):
        tokens.extend(response.token_ids)
        last = response
    return tokens, last


def draft_pool(deployment) -> admin_pb2.PoolState:
    return deployment.pools.state("draft")


def acceptance(deployment, draft_model) -> tuple[float, float]:
    """(accepted, drafted) tokens the metrics count for `draft_model`."""
    labels = {"draft_model": str(draft_model)}
    sample = deployment.metrics.registry.get_sample_value
    return (sample("specmesh_draft_model_accepted_tokens_total", labels) or 0.0,
            sample("specmesh_draft_model_draft_tokens_total", labels) or 0.0)


async def replace_model(deployment, pool: str, model) -> admin_pb2.PoolState:
    return await deployment.admin.ReplaceModel(admin_pb2.ReplaceModelRequest(pool=pool, model=str(model)),
                                               timeout=ROLLOUT_TIMEOUT_S)


async def assert_untouched(deployment, before: admin_pb2.PoolState, draft_model, expected) -> None:
    """The draft pool is as it was, and its draft still speculates (no fallback)."""
    after = draft_pool(deployment)
    assert [(r.name, r.model) for r in after.replicas] == [(r.name, r.model) for r in before.replicas]
    assert after.model == str(draft_model) and after.desired_replicas == DRAFT_REPLICAS and not after.rollout
    tokens, last = await generate(deployment)
    assert tokens == expected
    assert last.stats.draft_tokens > 0 and not last.stats.draft_fallback


async def test_the_target_pool_cannot_be_replaced(deployment, tiny_llama_perturbed_dir):
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await replace_model(deployment, "target", tiny_llama_perturbed_dir)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad_request_fields(raised.value) == ["pool"] and "target" in raised.value.details()


async def test_a_missing_model_fails_and_the_old_draft_keeps_serving(deployment, tmp_path, tiny_llama_unrelated_dir,
                                                                     expected):
    before = draft_pool(deployment)
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await replace_model(deployment, "draft", tmp_path / "no-such-model")
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad_request_fields(raised.value) == ["model"] and "no-such-model" in raised.value.details()
    await assert_untouched(deployment, before, tiny_llama_unrelated_dir, expected)


async def test_a_model_with_another_vocabulary_fails_and_the_old_draft_keeps_serving(
        deployment, other_vocab_model_dir, tiny_llama_unrelated_dir, expected):
    before = draft_pool(deployment)
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await replace_model(deployment, "draft", other_vocab_model_dir)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad_request_fields(raised.value) == ["model"] and "vocabularies" in raised.value.details()
    await assert_untouched(deployment, before, tiny_llama_unrelated_dir, expected)
    assert deployment.metrics.registry.get_sample_value(
        "specmesh_draft_model_info", {"model": str(tiny_llama_unrelated_dir)}) == 1


async def paused_generations(deployment) -> list:
    """Generations stopped between two rounds, each holding a session on a draft replica of the old model."""
    paused = []
    for _ in range(PAUSED_GENERATIONS):
        generation = deployment.generation(deployment.tokenizer)
        tokens = generation.tokens()
        received = [t for t in await anext(tokens)]
        while generation.stats.rounds < 2:
            received.extend(await anext(tokens))
        paused.append((generation, tokens, received))
    holders = {deployment.servicer.backends.draft.model_of(g.session_id) for g, _, _ in paused}
    assert len(holders) == 1 and None not in holders  # each session is on a replica of the old draft
    return paused


async def stream_until(deployment, done: asyncio.Event, expected) -> int:
    """gRPC streams one after another until `done`; each must end with the target's output. Returns how many."""
    count = 0
    while not done.is_set() or count == 0:
        tokens, last = await generate(deployment)
        assert tokens == expected and last.finish_reason
        count += 1
    return count


async def test_rolling_the_draft_fails_no_request_and_raises_acceptance(
        deployment, tiny_llama_unrelated_dir, tiny_llama_perturbed_dir, expected):
    _, last = await generate(deployment)
    old_names = {r.name for r in draft_pool(deployment).replicas}
    old_accepted, old_drafted = acceptance(deployment, tiny_llama_unrelated_dir)
    assert old_drafted > 0
    paused = await paused_generations(deployment)

    done = asyncio.Event()
    streams = [asyncio.ensure_future(stream_until(deployment, done, expected)) for _ in range(STREAMING_CLIENTS)]
    rollout = asyncio.ensure_future(replace_model(deployment, "draft", tiny_llama_perturbed_dir))
    try:
        await eventually(lambda: deployment.pools.rollout is not None and deployment.pools.rollout.running, timeout_s=60)
        with pytest.raises(grpc.aio.AioRpcError) as second:  # one rollout at a time
            await replace_model(deployment, "draft", tiny_llama_unrelated_dir)
        assert second.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert str(tiny_llama_perturbed_dir) in second.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as scaled:  # nor scaling meanwhile
            await deployment.admin.ScalePool(admin_pb2.ScalePoolRequest(pool="draft", replicas=3), timeout=10)
        assert scaled.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        state = await rollout
    finally:
        done.set()
        streamed = await asyncio.gather(*streams)
        with contextlib.suppress(Exception):
            await rollout
    assert all(count >= 1 for count in streamed)

    assert state.model == str(tiny_llama_perturbed_dir) and state.desired_replicas == DRAFT_REPLICAS
    assert not state.rollout
    assert len(state.replicas) == DRAFT_REPLICAS and not {r.name for r in state.replicas} & old_names
    assert all(r.model == str(tiny_llama_perturbed_dir) and r.state == "serving" for r in state.replicas)

    failovers = deployment.servicer.backends.draft.failovers
    for generation, tokens, received in paused:  # their old replicas are gone: each goes on elsewhere
        received.extend([t async for batch in tokens for t in batch])
        assert received == expected and not generation.stats.draft_fallback
    assert deployment.servicer.backends.draft.failovers == failovers + PAUSED_GENERATIONS  # moved, re-opened

    new_before = acceptance(deployment, tiny_llama_perturbed_dir)
    _, after = await generate(deployment)
    assert not after.stats.draft_fallback
    accepted, drafted = (now - was for now, was in zip(acceptance(deployment, tiny_llama_perturbed_dir),
                                                         new_before))
    assert drafted > 0 and accepted / drafted > old_accepted / old_drafted + 0.3
    assert after.stats.acceptance_rate > last.stats.acceptance_rate + 0.3
    info = deployment.metrics.registry.get_sample_value
    assert info("specmesh_draft_model_info", {"model": str(tiny_llama_perturbed_dir)}) == 1
    assert info("specmesh_draft_model_info", {"model": str(tiny_llama_unrelated_dir)}) is None


async def test_the_rollout_command_rolls_back_printing_progress(deployment, tiny_llama_unrelated_dir, capsys,
                                                               expected):
    """`specmesh rollout draft MODEL` against the running deployment (after the rollout above)."""
    endpoint = deployment.endpoint
    code = await asyncio.to_thread(cli.main, ["rollout", "draft", str(tiny_llama_unrelated_dir),
                                              "--endpoint", endpoint])
    out = capsys.readouterr().out
    assert code == 0, out
    # Progress, polled each second: each child's start (torch import, model load) alone takes longer.
    assert re.search(rf"^rolling out {re.escape(repr(str(tiny_llama_unrelated_dir)))}: \d of {DRAFT_REPLICAS} "
                     "replicas replaced$", out, re.MULTILINE), out
    assert f"draft: {DRAFT_REPLICAS} replicas desired (autoscaling off), model {tiny_llama_unrelated_dir}" in out
    assert out.count("serving") == DRAFT_REPLICAS and out.count(str(tiny_llama_unrelated_dir)) >= 3
    tokens, last = await generate(deployment)
    assert tokens == expected and last.stats.acceptance_rate == 0.0  # the unrelated draft again

    missing = await asyncio.to_thread(cli.main, ["rollout", "draft", "", "--endpoint", endpoint])
    assert missing == 2 and "INVALID_ARGUMENT" in capsys.readouterr().err


async def test_a_rollout_goes_on_when_its_caller_goes_away(deployment, tiny_llama_perturbed_dir, expected):
    call = asyncio.ensure_future(replace_model(deployment, "draft", tiny_llama_perturbed_dir))
    await eventually(lambda: deployment.pools.rollout is not None and deployment.pools.rollout.running, timeout_s=60)
    call.cancel()  # the client's call ends mid-rollout
    with contextlib.suppress(asyncio.CancelledError):
        await call
    await asyncio.wait_for(asyncio.shield(deployment.pools.rollout.task), ROLLOUT_TIMEOUT_S)
    state = draft_pool(deployment)
    assert state.model == str(tiny_llama_perturbed_dir) and len(state.replicas) == DRAFT_REPLICAS
    assert all(r.model == str(tiny_llama_perturbed_dir) for r in state.replicas)
    tokens, _ = await generate(deployment)
    assert tokens == expected
