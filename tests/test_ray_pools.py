"""Ray replica pools end to end: one local Ray cluster, 2 draft + 2 target replica actors.

Concurrent greedy streams equal the target's own output; killing a draft and a
target replica mid-stream changes nothing a client sees, and Ray restarts them
into their pools; scaling pools up and down under load loses nothing. The
cluster and the replicas are shared by the module's tests (a Ray start and a
replica start each cost seconds). The replicas require an internal token, which the
orchestrators' pools send.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

ray = pytest.importorskip("ray")

from harness import WORK_TIMEOUT_S, load  # noqa: E402
from orchestrator.decoding.request import LoopConfig  # noqa: E402
from orchestrator.control.ray_controller import PoolSpec, replica_runtime_env  # noqa: E402
from ray_stack import RayStack  # noqa: E402
from specmesh.server.service import ReplicaConfig  # noqa: E402
from orchestrator.control.pools import Pools  # noqa: E402
from orchestrator.control.options import PoolsOptions
from orchestrator.control.build import servicer_over_pools
from orchestrator.serving.server import serve_grpc  # noqa: E402
from specmesh.loading import openmp  # noqa: E402
from specmesh.server.metrics import OrchestratorMetrics  # noqa: E402
from specmesh.roles import DRAFT  # noqa: E402
from specmesh.server.security import token_interceptors  # noqa: E402
from orchestrator.distill.online_cycle import DistillJob, run_on_ray  # noqa: E402
from orchestrator.control.ray_replica import ReplicaActor  # noqa: E402
from specmesh.server.service import ServiceOptions  # noqa: E402
from specmesh.v1 import admin_pb2, common_pb2, draft_pb2_grpc, generation_pb2, target_pb2_grpc  # noqa: E402
from benchmarks.tiny_models import TINY_PROMPTS  # noqa: E402
from orchestrator.serving.clients import open_channel

pytestmark = pytest.mark.xdist_group("ray")  # one Ray cluster at a time on a test machine

NAMESPACE = "specmesh-test"
LONG = 200  # tokens: long enough streams to lose replicas in the middle of
TOKEN = "ray-internal-token"


@pytest.fixture(scope="module")
def ray_cluster():
    # No idle workers started ahead: every replica starts its own (its runtime_env differs from the
    # default), and on 2 cores the prestarted ones would hold Ray's worker-start slots (as many as cores).
    ray.init(num_cpus=4, include_dashboard=False, namespace=NAMESPACE, log_to_driver=False,
             object_store_memory=100 * 1024 * 1024,
             _system_config={"enable_worker_prestart": False, "prestart_worker_first_driver": False})
    yield
    ray.shutdown()


def pool_spec(role: str, model_dir) -> PoolSpec:
    service = ServiceOptions(model=str(model_dir), num_threads=1, internal_token=TOKEN)
    return PoolSpec(ReplicaConfig(role, service), replicas=2, num_cpus=0.25, drain_grace_s=20.0)


@pytest.fixture(scope="module")
async def ray_stack(ray_cluster, tiny_llama_dir, tiny_llama_perturbed_dir):
    options = PoolsOptions(namespace=NAMESPACE, target=pool_spec("target", tiny_llama_dir),
                           draft=pool_spec("draft", tiny_llama_perturbed_dir), check_interval_s=0.25,
                           start_timeout_s=2 * WORK_TIMEOUT_S)  # four replica processes start at once
    pools = Pools.from_options(options, token_interceptors(TOKEN), metrics=OrchestratorMetrics())
    _, tokenizer = load(str(tiny_llama_dir), "cpu")
    servicer = await servicer_over_pools(tokenizer, pools, LoopConfig(num_speculative_tokens=2))
    server, port, _ = await serve_grpc(servicer)
    stack = RayStack(pools, servicer, server, open_channel(f"127.0.0.1:{port}"), str(tiny_llama_dir))
    await stack.wait_serving("target", 2)
    await stack.wait_serving("draft", 2)
    yield stack
    await stack.channel.close()
    await server.stop(None)
    await pools.stop()


async def test_concurrent_streams_equal_their_solo_output(ray_stack):
    outputs = await asyncio.gather(*(ray_stack.generate(p, 32) for p in TINY_PROMPTS))
    for prompt, tokens in zip(TINY_PROMPTS, outputs):
        assert tokens == ray_stack.expected(prompt, 32), prompt
    replicas = (await ray_stack.admin.ListReplicas(admin_pb2.ListReplicasRequest(), timeout=10)).pools
    assert [(p.pool, [r.state for r in p.replicas]) for p in replicas] == [
        ("draft", ["serving", "serving"]), ("target", ["serving", "serving"])]


async def test_a_second_orchestrator_joins_the_pools(ray_stack, tiny_llama_dir):
    """Discovery through Ray: named replica actors in the namespace, owned by the first orchestrator."""
    joined = Pools.from_options(PoolsOptions(namespace=NAMESPACE, check_interval_s=0.25), token_interceptors(TOKEN))
    _, tokenizer = load(str(tiny_llama_dir), "cpu")
    servicer = await servicer_over_pools(tokenizer, joined, LoopConfig(num_speculative_tokens=2))
    try:
        assert sorted(joined.pools["target"].replicas) == ["specmesh-target-0", "specmesh-target-1"]
        assert len(joined.pools["draft"].routable()) == 2
        request = generation_pb2.GenerateRequest(prompt=TINY_PROMPTS[0], max_tokens=16, temperature=0.0)
        tokens = [t async for r in servicer.generate(request) for t in r.token_ids]
        assert tokens == ray_stack.expected(TINY_PROMPTS[0], 16)
        with pytest.raises(Exception, match="does not own"):
            joined.scale("target", 3)
    finally:
        await joined.stop()


async def test_replicas_bind_the_host_and_refuse_calls_without_the_token(ray_stack):
    stubs = {"draft": draft_pb2_grpc.DraftServiceStub, "target": target_pb2_grpc.TargetServiceStub}
    for role, stub in stubs.items():
        for replica in ray_stack.pools.pools[role].routable():
            assert replica.address.startswith("127.0.0.1:"), replica  # --host, not every interface
            async with open_channel(replica.address) as channel:
                health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub(channel).GetModelInfo(common_pb2.ModelInfoRequest(), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, replica


async def test_draft_replicas_start_with_a_short_openmp_spin_and_targets_with_libgomps_own(ray_stack):
    """In each actor's environment before it loaded torch: its role's runtime_env (specmesh.loading.openmp)."""
    if any(name in os.environ for name in openmp.USER_SETTINGS):
        pytest.skip("this environment sets OpenMP's wait itself, which the replicas keep")
    read_spin = lambda actor: __import__("os").environ.get("GOMP_SPINCOUNT")  # noqa: E731  runs in the actor
    for role, expected in (("draft", DRAFT.openmp_spin_count), ("target", None)):
        names = list(ray_stack.pools.controllers[role].actors)
        assert names
        for name in names:
            assert await ray_stack.actor(role, name).__ray_call__.remote(read_spin) == expected, name


async def test_replicas_run_at_the_priority_of_the_process_that_started_ray(ray_stack):
    """Not at the niceness Ray gives its workers (15): a replica serves requests, and on a busy node
    a reniced one would get a sliver of the CPU."""
    niceness = lambda actor: __import__("os").nice(0)  # noqa: E731  runs in the actor
    for role in ("draft", "target"):
        for name in ray_stack.pools.controllers[role].actors:
            assert await ray_stack.actor(role, name).__ray_call__.remote(niceness) == os.nice(0), name


async def test_a_wildcard_host_binds_only_the_nodes_address(ray_cluster, tiny_llama_dir):
    """--host 0.0.0.0 on a cluster: a replica listens on the address it advertises, not on every interface."""
    config = ReplicaConfig("target", ServiceOptions(model=str(tiny_llama_dir), host="0.0.0.0", num_threads=1,
                                                    internal_token=TOKEN))
    replica = ray.remote(ReplicaActor).options(num_cpus=0.25, runtime_env=replica_runtime_env("target")).remote(config)
    try:
        address = await asyncio.wait_for(replica.address.remote(), WORK_TIMEOUT_S)
        host, port = address.rsplit(":", 1)
        bound = {ipaddress.ip_address(c.laddr.ip) for c in psutil.net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == int(port)}
    finally:
        ray.kill(replica, no_restart=True)
    assert host == ray.util.get_node_ip_address()
    assert {getattr(ip, "ipv4_mapped", None) or ip for ip in bound} == {ipaddress.ip_address(host)}
async def start_streams(stack: RayStack) -> list[asyncio.Future]:
    """One long stream per prompt; returns once every one has its first token (its sessions are placed)."""
    started = [asyncio.Event() for _ in TINY_PROMPTS]
    streams = [asyncio.ensure_future(stack.generate(p, LONG, e)) for p, e in zip(TINY_PROMPTS, started)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), WORK_TIMEOUT_S)
    return streams


async def test_killed_replicas_cost_nothing_and_rejoin(ray_stack):
    target = ray_stack.servicer.backends.target
    failovers = target.failovers
    streams = await start_streams(ray_stack)
    # Both target replicas hold running sessions now; kill one of each pool (Ray restarts them).
    ray.kill(ray_stack.actor("target", "specmesh-target-0"), no_restart=False)
    ray.kill(ray_stack.actor("draft", "specmesh-draft-0"), no_restart=False)
    outputs = await asyncio.gather(*streams)  # no client error
    for prompt, tokens in zip(TINY_PROMPTS, outputs):
        assert tokens == ray_stack.expected(prompt, LONG), prompt
    assert target.failovers > failovers, "the kill should have hit running sessions"
    await ray_stack.wait_serving("target", 2)  # restarted on a new port and back in the pool
    await ray_stack.wait_serving("draft", 2)
    for role in ("target", "draft"):  # counted as in local mode: back at a new address
        assert ray_stack.pools.metrics.registry.get_sample_value("specmesh_replica_restarts_total", {"role": role}) == 1
    assert [await ray_stack.generate(p, 16) for p in TINY_PROMPTS[:2]] == [
        ray_stack.expected(p, 16) for p in TINY_PROMPTS[:2]]


async def scale(stack: RayStack, pool: str, replicas: int) -> admin_pb2.PoolState:
    return await stack.admin.ScalePool(admin_pb2.ScalePoolRequest(pool=pool, replicas=replicas), timeout=10)


async def test_scaling_under_load_loses_nothing(ray_stack):
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await scale(ray_stack, "target", 0)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    streams = await start_streams(ray_stack)
    assert (await scale(ray_stack, "target", 3)).desired_replicas == 3
    assert (await scale(ray_stack, "draft", 3)).desired_replicas == 3
    for prompt, tokens in zip(TINY_PROMPTS, await asyncio.gather(*streams)):
        assert tokens == ray_stack.expected(prompt, LONG), prompt
    await ray_stack.wait_serving("target", 3)  # the new replicas get traffic once healthy
    await ray_stack.wait_serving("draft", 3)
    streams = await start_streams(ray_stack)
    # A scale-down marks its replicas draining before anything else runs: the answer shows exactly that.
    target_states = [r.state for r in (await scale(ray_stack, "target", 1)).replicas]
    draft_states = [r.state for r in (await scale(ray_stack, "draft", 2)).replicas]
    assert sorted(target_states) == ["draining", "draining", "serving"], target_states
    assert sorted(draft_states) == ["draining", "serving", "serving"], draft_states
    for prompt, tokens in zip(TINY_PROMPTS, await asyncio.gather(*streams)):
        assert tokens == ray_stack.expected(prompt, LONG), prompt
    await ray_stack.wait_serving("target", 1)  # the drained replicas leave once their sessions are done
    await ray_stack.wait_serving("draft", 2)
    replicas = (await ray_stack.admin.ListReplicas(admin_pb2.ListReplicasRequest(), timeout=10)).pools
    assert [(p.pool, [r.state for r in p.replicas]) for p in replicas] == [
        ("draft", ["serving", "serving"]), ("target", ["serving"])]


async def replace_model(stack: RayStack, model) -> admin_pb2.PoolState:
    request = admin_pb2.ReplaceModelRequest(pool="draft", model=str(model))
    return await stack.admin.ReplaceModel(request, timeout=300)


async def test_rolling_the_draft_over_on_ray_loses_nothing(ray_stack, tiny_llama_unrelated_dir,
                                                           other_vocab_model_dir):
    """After the scaling test (2 draft replicas): a bad model is refused, a good one replaces every actor."""
    old = {r.name for r in ray_stack.pools.state("draft").replicas}
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await replace_model(ray_stack, other_vocab_model_dir)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "vocabularies" in refused.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as missing:  # the actor's load fails (a RayTaskError)
        await replace_model(ray_stack, "/no/such/model")
    assert missing.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "/no/such/model" in missing.value.details()
    assert {r.name for r in ray_stack.pools.state("draft").replicas} == old
    assert set(ray_stack.pools.controllers["draft"].actors) == old  # the refused ones were killed

    streams = await start_streams(ray_stack)
    state = await replace_model(ray_stack, tiny_llama_unrelated_dir)
    for prompt, tokens in zip(TINY_PROMPTS, await asyncio.gather(*streams)):
        assert tokens == ray_stack.expected(prompt, LONG), prompt
    assert state.model == str(tiny_llama_unrelated_dir) and len(state.replicas) == 2
    assert not {r.name for r in state.replicas} & old
    assert all(r.model == str(tiny_llama_unrelated_dir) for r in state.replicas)
    assert ray_stack.pools.controllers["draft"].spec.replica.service.model == str(tiny_llama_unrelated_dir)


@pytest.mark.parametrize("flags, timeout_s, outcome", [(("--no-such-flag",), 120.0, "failed"),
                                                       ((), 0.5, "timed_out")])
async def test_an_online_distillation_run_is_a_ray_task_with_its_own_resources(ray_cluster, tmp_path, flags,
                                                                               timeout_s, outcome):
    """The Ray backend's cycle: the same `specmesh distill` child, inside a task holding a CPU; a crash
    names its status, an overrun is stopped at its deadline."""
    job = DistillJob("target", "draft", tmp_path / "prompts.jsonl", tmp_path / "v1", tmp_path / "report.json",
                     tmp_path / "distill.log", extra_args=flags)
    result = await run_on_ray(job, timeout_s, num_cpus=1, num_gpus=0)
    assert result.outcome == outcome and result.report is None
    if outcome == "failed":
        assert "exit status 2" in result.detail and "--no-such-flag" in job.log.read_text()

