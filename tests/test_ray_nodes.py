"""Pools across the nodes of a real multi-node Ray cluster on this machine (ray.cluster_utils.Cluster:
a head and worker nodes, each its own raylet), placed by the resources the nodes offer, as on KubeRay
(deploy/kuberay): target nodes offer a GPU (logical: Ray counts what a node says it has) and
`specmesh_target`, CPU-only draft nodes `specmesh_draft`, and the head, where the orchestrator (this
process, the driver) runs, no CPU to actors at all.

Each replica's node is read inside its actor. A target node removed mid-run (its raylet and every
process on it killed) costs the streams nothing: they fail over to the other target replica, and Ray
starts the lost replica again on the node that replaces it. A role that no node offers any more waits
pending: a lost draft pool makes requests go target-only, a lost target pool answers UNAVAILABLE
within the request's wait for a replica, never a hang.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import psutil
import pytest

ray = pytest.importorskip("ray")
from ray._private import ray_constants  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from benchmarks.tiny_models import TINY_PROMPTS  # noqa: E402
from harness import WORK_TIMEOUT_S, eventually, load  # noqa: E402
from orchestrator.control.build import servicer_over_pools  # noqa: E402
from orchestrator.control.options import PoolsOptions  # noqa: E402
from orchestrator.control.pools import Pools  # noqa: E402
from orchestrator.decoding.request import LoopConfig  # noqa: E402
from orchestrator.serving.pool import PoolSpec  # noqa: E402
from orchestrator.serving.server import serve_grpc  # noqa: E402
from ray_stack import RayStack  # noqa: E402
from specmesh.server.metrics import OrchestratorMetrics  # noqa: E402
from specmesh.server.security import token_interceptors  # noqa: E402
from specmesh.server.service import ReplicaConfig, ServiceOptions  # noqa: E402

pytestmark = pytest.mark.xdist_group("ray")  # one Ray cluster at a time on a test machine

NAMESPACE = "specmesh-nodes"
TOKEN = "ray-nodes-internal-token"
LONG = 120  # tokens: streams still running when a node goes
# What each kind of node offers, and what each role's replicas ask (as in deploy/kuberay/serve-config.yaml).
TARGET_NODE = dict(num_cpus=1, num_gpus=1, resources={"specmesh_target": 1})  # one target replica per node
DRAFT_NODE = dict(num_cpus=2, resources={"specmesh_draft": 2})  # CPU only
ASKS = {"target": dict(num_gpus=1, resources={"specmesh_target": 1}), "draft": dict(resources={"specmesh_draft": 1})}
# A raylet killed without warning is found dead after 3 missed health checks 0.5 s apart (Ray's default
# waits longer); a live one under load still answers them (each may take up to Ray's 10 s timeout).
FAST_NODE_DEATH = {"health_check_period_ms": 500, "health_check_failure_threshold": 3,
                   "health_check_initial_delay_ms": 0}
# No idle workers started ahead (tests/test_ray_pools.py: on 2 cores they hold the worker-start slots).
NO_PRESTART = {"enable_worker_prestart": False, "prestart_worker_first_driver": False}
ACQUIRE_TIMEOUT_S = 10.0  # a request's wait for a serving target replica


class Nodes:
    """The cluster's worker nodes by kind, added and removed as a test goes."""

    def __init__(self, cluster: Cluster):
        self.cluster = cluster
        self.target: list = []
        self.draft: list = []

    def add(self, kind: str):
        node = self.cluster.add_node(**(TARGET_NODE if kind == "target" else DRAFT_NODE), wait=False)
        getattr(self, kind).append(node)
        return node

    def remove(self, node) -> None:
        """As a machine that fails: the node's raylet and every process on it are killed at once. (Ray's
        own removal kills the raylet and its agents; a worker, such as a replica, would notice and exit
        only a moment later, and might finish its streams meanwhile.)"""
        for kind in (self.target, self.draft):
            if node in kind:
                kind.remove(node)
        raylet = psutil.Process(node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid)
        for process in raylet.children(recursive=True):
            process.kill()
        self.cluster.remove_node(node, allow_graceful=False)

    def by_id(self, node_id: str):
        return next(n for n in self.target + self.draft if n.node_id == node_id)


@pytest.fixture(scope="module")
def nodes():
    cluster = Cluster(initialize_head=True, head_node_args=dict(
        num_cpus=0, include_dashboard=False, _system_config={**NO_PRESTART, **FAST_NODE_DEATH}))
    nodes = Nodes(cluster)
    try:
        for kind in ("target", "target", "draft"):
            nodes.add(kind)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)
        yield nodes
    finally:
        ray.shutdown()
        cluster.shutdown()


def pool_spec(role: str, model_dir, replicas: int) -> PoolSpec:
    service = ServiceOptions(model=str(model_dir), num_threads=1, internal_token=TOKEN)
    return PoolSpec(ReplicaConfig(role, service), replicas=replicas, num_cpus=0.25, drain_grace_s=5.0, **ASKS[role])


class Stack(RayStack):
    async def start_streams(self) -> list[asyncio.Future]:
        """One long stream per prompt; returns once every one has its first token (its sessions are placed)."""
        started = [asyncio.Event() for _ in TINY_PROMPTS]
        streams = [asyncio.ensure_future(self.generate(p, LONG, e)) for p, e in zip(TINY_PROMPTS, started)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), WORK_TIMEOUT_S)
        return streams

    async def assert_identical(self, streams: list[asyncio.Future]) -> None:
        for prompt, tokens in zip(TINY_PROMPTS, await asyncio.gather(*streams)):
            assert tokens == self.expected(prompt, LONG), prompt

    def serving(self, role: str) -> int:
        pool = self.pools.pools[role]
        return len(pool.routable()) if len(pool.replicas) == self.pools.controllers[role].desired else -1

    async def node_of(self, role: str, name: str) -> str:
        """The Ray node the replica's actor runs on, as the actor itself reads it."""
        node_id = lambda actor: __import__("ray").get_runtime_context().get_node_id()  # noqa: E731  in the actor
        handle = self.pools.controllers[role].actors[name]
        return await asyncio.wait_for(handle.__ray_call__.remote(node_id), WORK_TIMEOUT_S)

    async def placement(self) -> dict[str, str]:
        return {name: await self.node_of(role, name)
                for role in ("target", "draft") for name in self.pools.controllers[role].actors}

    def restarts(self, role: str) -> float:
        return self.pools.metrics.registry.get_sample_value("specmesh_replica_restarts_total", {"role": role}) or 0


@pytest.fixture(scope="module")
async def stack(nodes, tiny_llama_dir, tiny_llama_perturbed_dir):
    options = PoolsOptions(namespace=NAMESPACE, target=pool_spec("target", tiny_llama_dir, 2),
                           draft=pool_spec("draft", tiny_llama_perturbed_dir, 1), check_interval_s=0.25,
                           acquire_timeout_s=ACQUIRE_TIMEOUT_S, start_timeout_s=2 * WORK_TIMEOUT_S)
    pools = Pools.from_options(options, token_interceptors(TOKEN), metrics=OrchestratorMetrics())
    _, tokenizer = load(str(tiny_llama_dir), "cpu")
    servicer = await servicer_over_pools(tokenizer, pools, LoopConfig(num_speculative_tokens=2))
    server, port, _ = await serve_grpc(servicer)
    stack = Stack(pools, servicer, server, grpc.aio.insecure_channel(f"127.0.0.1:{port}"), str(tiny_llama_dir))
    try:
        await eventually(lambda: (stack.serving("target"), stack.serving("draft")), (2, 1), 2 * WORK_TIMEOUT_S)
        yield stack
    finally:
        await stack.channel.close()
        await server.stop(None)
        await pools.stop()


def offered(node_id: str) -> dict[str, float]:
    """What a live node offers, as the cluster knows it."""
    return next(n["Resources"] for n in ray.nodes() if n["NodeID"] == node_id and n["Alive"])


async def test_replicas_sit_on_the_nodes_that_offer_their_resources(nodes, stack):
    placement = await stack.placement()
    target_nodes = {n.node_id for n in nodes.target}
    targets = [placement[name] for name in stack.pools.controllers["target"].actors]
    drafts = [placement[name] for name in stack.pools.controllers["draft"].actors]
    assert sorted(targets) == sorted(target_nodes)  # one per target node: each offers one
    assert set(drafts) == {nodes.draft[0].node_id}
    for node_id in targets:
        assert offered(node_id).get("GPU") == 1 and "specmesh_target" in offered(node_id)
    for node_id in drafts:
        assert "GPU" not in offered(node_id) and "specmesh_target" not in offered(node_id)
    # The orchestrator runs where `specmesh serve` does: this process, the driver, on the head, which
    # offers no CPU to actors and so hosts no replica.
    head = nodes.cluster.head_node.node_id
    assert ray.get_runtime_context().get_node_id() == head and head not in placement.values()
    assert offered(head).get("CPU", 0) == 0
    outputs = await asyncio.gather(*(stack.generate(p, 24) for p in TINY_PROMPTS))
    assert outputs == [stack.expected(p, 24) for p in TINY_PROMPTS]


async def test_a_lost_node_costs_nothing_and_its_replica_starts_again_on_another(nodes, stack):
    target = stack.servicer.backends.target
    failovers = target.failovers
    before = await stack.placement()
    lost = nodes.by_id(before["specmesh-target-0"])
    # The node that will replace it: a spare, the only target node with room. (Ray starts a node on the
    # thread that handles signals, the loop's own; starting it under the streams would stall them.)
    replacement = nodes.add("target")
    await asyncio.to_thread(nodes.cluster.wait_for_nodes)
    streams = await stack.start_streams()  # both target replicas hold running sessions now
    await asyncio.to_thread(nodes.remove, lost)
    await stack.assert_identical(streams)  # no client error, the target's own output
    assert target.failovers > failovers, "the lost node should have held running sessions"
    await eventually(lambda: stack.serving("target"), 2)
    after = await stack.placement()
    assert after["specmesh-target-0"] == replacement.node_id != lost.node_id  # Ray started it again there
    assert {k: v for k, v in after.items() if k != "specmesh-target-0"} == {
        k: v for k, v in before.items() if k != "specmesh-target-0"}
    assert stack.restarts("target") == 1 and stack.restarts("draft") == 0
    assert [await stack.generate(p, 16) for p in TINY_PROMPTS[:2]] == [stack.expected(p, 16) for p in TINY_PROMPTS[:2]]


async def test_a_role_no_node_offers_waits_pending_and_never_hangs_a_request(nodes, stack):
    """The draft node lost with none to replace it: the draft replica waits for one, requests go on
    target-only with the same output. Every target node lost: a request is answered UNAVAILABLE once its
    wait for a target replica is over."""
    drafts = dict(stack.pools.controllers["draft"].actors)
    streams = await stack.start_streams()
    await asyncio.to_thread(nodes.remove, nodes.draft[0])
    await stack.assert_identical(streams)
    await eventually(lambda: stack.serving("draft"), 0)
    assert stack.pools.controllers["draft"].actors == drafts  # kept, pending: Ray places it when a node joins
    assert [await stack.generate(p, 16) for p in TINY_PROMPTS[:2]] == [stack.expected(p, 16) for p in TINY_PROMPTS[:2]]

    for node in list(nodes.target):
        await asyncio.to_thread(nodes.remove, node)
    await eventually(lambda: stack.serving("target"), 0)
    started = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await stack.generate(TINY_PROMPTS[0], 16)
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value
    assert "no healthy target replica" in failed.value.details()
    assert time.monotonic() - started < ACQUIRE_TIMEOUT_S + 10
