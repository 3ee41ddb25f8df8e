"""An orchestrator over replica pools: build the Generation servicer and the pool admin calls.

With `PoolsOptions.target` / `.draft` set, this orchestrator owns the pools (creates,
scales and replaces the replica actors); without, it joins pools that another
orchestrator owns, discovering their replicas as named actors in the namespace.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from opentelemetry.sdk.trace import TracerProvider
from transformers import PreTrainedTokenizerBase

from orchestrator.deployment.backends import STARTUP_TIMEOUT_S, backends_for
from orchestrator.frontend.servicer import GenerationServicer
from specmesh.telemetry import client_interceptors, tracer
from orchestrator.deployment.ray_controller import PoolController, PoolSpec, new_pool, ray_discovery
from orchestrator.deployment.failover import MAX_REPLICA_FAILURES, PooledDraftClient, PooledTargetClient
from orchestrator.deployment.pool import ReplicaPool
from specmesh.errors import InvalidArgument, NotManagedHere
from specmesh.security import TLSConfig, token_interceptors
from specmesh.v1 import admin_pb2

log = logging.getLogger(__name__)
START_TIMEOUT_S = 1800.0  # the first start may assemble and convert the embedded models
JOIN_DRAFT_WAIT_S = 10.0


@dataclass(frozen=True)
class PoolsOptions:
    namespace: str = "specmesh"
    target: PoolSpec | None = None  # None (both): join the pools in `namespace`
    draft: PoolSpec | None = None  # None while target is set: serve target-only
    check_interval_s: float = 1.0  # health checks and controller ticks
    max_replica_failures: int = MAX_REPLICA_FAILURES  # replicas one request may lose before it fails
    acquire_timeout_s: float = 10.0  # longest a request waits for a healthy target replica
    start_timeout_s: float = START_TIMEOUT_S
    channel_tls: TLSConfig | None = None  # the orchestrator's channels to replicas; None = plaintext

    @property
    def manage(self) -> bool:
        return self.target is not None


class Pools:
    """This orchestrator's pools, and their controllers where it owns the replicas."""

    def __init__(self, pools: dict[str, ReplicaPool], controllers: dict[str, PoolController] | None = None,
                 options: PoolsOptions = PoolsOptions()):
        self.pools = pools  # "target" (always) and "draft" (unless target-only)
        self.controllers = controllers or {}
        self.options = options

    @classmethod
    def from_options(cls, options: PoolsOptions, interceptors=()) -> "Pools":
        if not options.manage:
            return cls({role: new_pool(role, ray_discovery(role, options.namespace), options.check_interval_s,
                                       interceptors, options.channel_tls) for role in ("target", "draft")},
                       options=options)
        controllers = {spec.role: PoolController(spec, options.namespace, options.check_interval_s, interceptors,
                                                 options.channel_tls)
                       for spec in (options.target, options.draft) if spec is not None}
        return cls({role: c.pool for role, c in controllers.items()}, controllers, options)

    async def start(self) -> None:
        for role, pool in self.pools.items():
            if role in self.controllers:
                self.controllers[role].start()
            else:
                pool.start()
        await self.pools["target"].wait_serving(1, self.options.start_timeout_s)
        draft = self.pools.get("draft")
        if draft is not None:
            wait = self.options.start_timeout_s if "draft" in self.controllers else JOIN_DRAFT_WAIT_S
            try:
                await draft.wait_serving(1, wait)
            except Exception:  # noqa: BLE001 - joining: there may be no draft pool; requests go target-only
                log.warning("no draft replica found; serving target-only until one appears")

    async def stop(self) -> None:
        for role, pool in self.pools.items():
            await (self.controllers[role].stop() if role in self.controllers else pool.stop())

    def scale(self, role: str, replicas: int) -> admin_pb2.PoolState:
        controller = self.controllers.get(role)
        if role not in ("draft", "target"):
            raise InvalidArgument("pool", "must be 'draft' or 'target'")
        if controller is None:
            raise NotManagedHere(f"this orchestrator does not own a {role} pool; scale it where it was started")
        low, high = controller.spec.bounds
        if low < high and not low <= replicas <= high:
            raise InvalidArgument("replicas", f"must be within the {role} pool's autoscaling range [{low}, {high}]")
        if role == "target" and replicas < 1:
            raise InvalidArgument("replicas", "the target pool needs at least one replica")
        controller.scale_to(replicas)
        return self.state(role)

    def state(self, role: str) -> admin_pb2.PoolState:
        pool = self.pools[role]
        controller = self.controllers.get(role)
        low, high = controller.spec.bounds if controller else (0, 0)
        if low >= high:
            low = high = 0  # not autoscaling
        desired = controller.desired if controller else len([r for r in pool.replicas.values() if not r.draining])
        state = admin_pb2.PoolState(pool=role, desired_replicas=desired, min_replicas=low, max_replicas=high)
        for replica in sorted(pool.replicas.values(), key=lambda r: r.name):
            draining = replica.draining or bool(controller and replica.name in controller.draining)
            state.replicas.add(name=replica.name, address=replica.address or "",
                               state="draining" if draining else replica.state,
                               open_sessions=replica.open_sessions, routed_sessions=replica.routed)
        return state

    def list(self) -> admin_pb2.ListReplicasResponse:
        return admin_pb2.ListReplicasResponse(pools=[self.state(role) for role in sorted(self.pools)])


async def create_pooled_servicer(tokenizer: PreTrainedTokenizerBase, options, *,
                                 tracer_provider: TracerProvider | None = None, metrics=None):
    """The Generation servicer over pools; `options` is an OrchestratorOptions with `pools` set."""
    interceptors = [*client_interceptors(tracer_provider), *token_interceptors(options.internal_token)]
    pools = Pools.from_options(options.pools, interceptors)
    return await servicer_over_pools(tokenizer, pools, options.loop, tracer_provider=tracer_provider,
                                     metrics=metrics)


async def servicer_over_pools(tokenizer: PreTrainedTokenizerBase, pools: Pools, loop, *,
                              tracer_provider: TracerProvider | None = None, metrics=None):
    await pools.start()
    failures = pools.options.max_replica_failures
    target = PooledTargetClient(pools.pools["target"], max_replica_failures=failures,
                                acquire_timeout_s=pools.options.acquire_timeout_s)
    draft = None
    if "draft" in pools.pools:
        draft = PooledDraftClient(pools.pools["draft"], max_replica_failures=failures, acquire_timeout_s=1.0)
    draft_info = None
    if draft is not None and draft.pool.routable():
        draft_info = await draft.model_info(STARTUP_TIMEOUT_S)
    if loop.pipeline == "on":
        log.warning("replica pools serve sequentially: their failover draft client has no PreDraft yet")
    loop = dataclasses.replace(loop, pipeline="off")
    backends = await backends_for(tokenizer, target, draft, draft_info, loop)
    servicer = GenerationServicer(tokenizer, backends, loop, metrics, tracer(tracer_provider))
    servicer.pools = pools
    return servicer
