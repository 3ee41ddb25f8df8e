"""An orchestrator's replica pools and their controllers: health, metrics, scaling, rollouts (the Admin calls;
`pool_state` shows a pool to it).

Every deployment serves this way: each role is a `ReplicaPool` (routing, health) behind a
failover client, and a controller per role keeps its replicas running, either as local
child processes (`supervisor.LocalPoolController`, backend "local", plain `specmesh serve`)
or as Ray actors (`ray_controller.PoolController`, backend "ray"). A role in
`PoolsOptions.attached` has no controller: its pool is the services at those addresses,
started elsewhere (`attached`). With neither a target spec nor an attached target, this
orchestrator joins Ray pools that another one owns, discovering their replicas as named
actors in the namespace.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace

from grpc_health.v1 import health_pb2

from orchestrator.control.draft_training import DraftTrainer
from orchestrator.control.attached import attached_pools, not_managed, wait_for_attached
from orchestrator.control.options import BACKENDS, PoolsOptions
from orchestrator.control.pool_state import pool_state
from orchestrator.serving.failover import PooledTargetClient
from orchestrator.serving.pool import PoolHooks, PoolSpec, ReplicaPool, new_pool
from orchestrator.control.ray_controller import PoolController, ray_discovery
from orchestrator.control.rollout import Rollout
from orchestrator.control.supervisor import LocalPoolController
from orchestrator.decoding.background import spawn_background
from orchestrator.serving.step_reports import StepReports
from specmesh.errors import InvalidArgument, NotManagedHere, RolloutInProgress
from specmesh.server.metrics import OrchestratorMetrics
from specmesh.v1 import admin_pb2

log = logging.getLogger(__name__)
JOIN_DRAFT_WAIT_S = 10.0
HEALTH_PREFIX = "specmesh.pool."  # grpc.health.v1 service "specmesh.pool.<role>": the role's state


def same_gpu(device: str, other: str) -> bool:
    """Whether two --device values name one CUDA device ("cuda" is device 0 of the process)."""
    def index(name: str) -> int | None:
        if name == "cuda":
            return 0
        return int(name[5:]) if name.startswith("cuda:") and name[5:].isdigit() else None
    return index(device) is not None and index(device) == index(other)


def pool_health_name(role: str) -> str:
    return HEALTH_PREFIX + role


class Pools:
    """This orchestrator's pools, and their controllers where it owns the replicas."""

    def __init__(self, pools: dict[str, ReplicaPool], controllers: dict | None = None,
                 options: PoolsOptions = PoolsOptions(), step_reports: StepReports | None = None,
                 metrics: OrchestratorMetrics | None = None):
        self.pools = pools  # "target" (always) and "draft" (unless target-only)
        self.controllers = controllers or {}  # LocalPoolController or PoolController, by role
        self.options = options
        self.failed: set[str] = set()  # roles with no replica up: each crash-looping or given up
        # What each replica's forward steps cost, as its health checks report them (the pools' on_info hook);
        # the servicer's backends read it.
        self.step_reports = StepReports() if step_reports is None else step_reports
        # Replica restarts, failed roles, the draft's model; the servicer over these pools counts its requests there too.
        self.metrics = OrchestratorMetrics() if metrics is None else metrics
        self.rollout: Rollout | None = None  # the draft pool's latest rollout
        # With online distillation on and a draft pool here: the trainer, made by `start()`, to be started by
        # whoever feeds it the finished requests (orchestrator.control.build).
        self.online: DraftTrainer | None = None
        self._health = None  # the orchestrator's grpc.health.v1 servicer, once it serves
        self._serving_names: tuple[str, ...] = ()

    @classmethod
    def from_options(cls, options: PoolsOptions, interceptors=(), tracing=(), client_options=None,
                     metrics: OrchestratorMetrics | None = None) -> "Pools":
        """`interceptors`: of the channels to this orchestrator's replicas (tracing and its internal token);
        `tracing`: of those to attached services, which get their own token (`options.attached_token`);
        `client_options`: keyword arguments of every replica's client (orchestrator.serving.clients);
        `metrics`: the orchestrator's (None: new ones)."""
        if options.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, not {options.backend!r}")
        pools = cls({}, options=options, metrics=metrics)
        # Ray restarts actors itself: a restart shows as a replica back at a new address. The local
        # supervisor counts its own (on_restart), also those the pool never saw serving.
        hooks = PoolHooks(client_options or {}, on_info=pools.step_reports.update, on_serving=pools._serving_changed,
                          on_restarted=pools._replica_restarted)
        if not options.manage:
            for role in ("target", "draft"):
                pools.pools[role] = new_pool(role, ray_discovery(role, options.namespace), options.check_interval_s,
                                             interceptors, options.channel_tls, hooks)
            return pools
        for spec in (options.target, options.draft):
            if spec is not None:
                pools.controllers[spec.role] = pools._controller(spec, interceptors, hooks)
                pools.pools[spec.role] = pools.controllers[spec.role].pool
        pools.pools.update(attached_pools(options, tracing, hooks))
        return pools

    def _controller(self, spec: PoolSpec, interceptors, hooks: PoolHooks):
        options = self.options
        if options.backend == "local":
            return LocalPoolController(spec, options.restart_policy, options.check_interval_s, interceptors,
                                       options.channel_tls, on_role_failed=self._role_failed,
                                       on_restart=self._replica_restarted,
                                       hooks=replace(hooks, on_restarted=PoolHooks().on_restarted))
        return PoolController(spec, options.namespace, options.check_interval_s, interceptors, options.channel_tls,
                              hooks)

    async def start(self) -> None:
        """Start every pool; raises RuntimeError when a replica this orchestrator owns fails to start."""
        for role in sorted(self.pools, key=lambda r: r != "target"):
            if role in self.controllers:
                if role != "target" and self._shares_the_targets_gpu(role):
                    await self.controllers["target"].wait_ready(self.options.start_timeout_s)
                self.controllers[role].start()
            else:
                self.pools[role].start()
        for role in sorted(self.controllers, key=lambda r: r != "target"):
            await self.controllers[role].wait_ready(self.options.start_timeout_s)
        if not self.options.manage:
            await self._join()
        await wait_for_attached(self.pools, self.options.attached, self.options.start_timeout_s)
        for role in self.pools:
            self._report(role)
        if "draft" in self.controllers:
            self._draft_model_is(self.controllers["draft"].spec.replica.service.model)
        self.online = self._draft_trainer()

    def _draft_trainer(self) -> DraftTrainer | None:
        """With `online_distill` set and a draft pool this orchestrator owns: the online loop over these pools
        (not started yet); `stop()` stops it first."""
        training = self.options.online_distill
        if training is None:
            return None
        if "draft" not in self.controllers:
            log.warning("online distillation is on but this orchestrator owns no draft pool: it stays off")
            return None
        return training.trainer(pools=self, metrics=self.metrics)

    def _shares_the_targets_gpu(self, role: str) -> bool:
        """Whether `role`'s local replicas run on the target's CUDA device. A service there allocates its KV
        budget at start-up, a fraction of the memory it finds free (specmesh.engine.graph_steps), so it starts once
        the target has taken its own: the target, whose tokens cost the most, always sizes first."""
        target = self.controllers.get("target")
        if self.options.backend != "local" or target is None:
            return False
        return same_gpu(target.spec.replica.service.device, self.controllers[role].spec.replica.service.device)

    async def _join(self) -> None:
        await self.pools["target"].wait_serving(1, self.options.start_timeout_s)
        try:
            await self.pools["draft"].wait_serving(1, JOIN_DRAFT_WAIT_S)
        except Exception:  # noqa: BLE001 - joining: there may be no draft pool; requests go target-only
            log.warning("no draft replica found; serving target-only until one appears")

    # ---- what the supervisor reports: metrics and health

    def attach_health(self, health, serving_names: tuple[str, ...]) -> None:
        """Report each role on `health` as "specmesh.pool.<role>"; a target down turns `serving_names` off."""
        self._health, self._serving_names = health, serving_names
        for role in self.pools:
            self._report(role)

    def _replica_restarted(self, role: str) -> None:
        self.metrics.replica_restarts.labels(role=role).inc()

    def _role_failed(self, role: str, failed: bool) -> None:
        (self.failed.add if failed else self.failed.discard)(role)
        self._report(role)

    def _serving_changed(self, role: str, serving: bool) -> None:
        log.log(logging.INFO if serving else logging.WARNING, "%s pool: %s", role,
                "a replica passes its health checks again" if serving else "no replica passes its health checks")
        self._report(role)

    def _report(self, role: str) -> None:
        failed = role in self.failed
        self.metrics.role_failed.labels(role=role).set(int(failed))
        if self._health is None:
            return
        down = failed or not self.pools[role].serving
        status = health_pb2.HealthCheckResponse.NOT_SERVING if down else health_pb2.HealthCheckResponse.SERVING
        names = [pool_health_name(role)]
        if role == "target":  # no target, nothing can be generated: probes must see it, and its return
            names += ["", *self._serving_names]
        for name in names:
            spawn_background(self._health.set(name, status))

    def metrics_ports(self) -> dict[str, int]:
        """The /metrics ports of the local replicas (Ray actors serve none)."""
        ports: dict[str, int] = {}
        for controller in self.controllers.values():
            ports.update(controller.metrics_ports())
        return ports

    def local_addresses(self) -> dict[str, str]:
        """The gRPC addresses of the local replicas (Ray's are listed by `specmesh replicas`)."""
        addresses: dict[str, str] = {}
        for controller in self.controllers.values():
            addresses.update(getattr(controller, "addresses", dict)())
        return addresses

    async def stop(self) -> None:
        if self.online is not None:
            await self.online.stop()  # no cycle may start a rollout while the pools stop
        if self.rollout is not None and self.rollout.task is not None:
            self.rollout.task.cancel()
            await asyncio.gather(self.rollout.task, return_exceptions=True)
        for role, pool in self.pools.items():
            await (self.controllers[role].stop() if role in self.controllers else pool.stop())

    def scale(self, role: str, replicas: int) -> admin_pb2.PoolState:
        controller = self.controllers.get(role)
        if role not in ("draft", "target"):
            raise InvalidArgument("pool", "must be 'draft' or 'target'")
        if role in self.options.attached:
            raise not_managed(role, "scale them")
        if controller is None:
            raise NotManagedHere(f"this orchestrator does not own a {role} pool; scale it where it was started")
        if controller.rolling:
            raise RolloutInProgress(f"{self.rollout.progress}; scale the {role} pool once it is done")
        low, high = controller.spec.bounds
        if low < high and not low <= replicas <= high:
            raise InvalidArgument("replicas", f"must be within the {role} pool's autoscaling range [{low}, {high}]")
        if role == "target" and replicas < 1:
            raise InvalidArgument("replicas", "the target pool needs at least one replica")
        controller.scale_to(replicas)
        return self.state(role)

    async def replace_model(self, role: str, model: str) -> admin_pb2.PoolState:
        """Roll the draft pool over to `model` (orchestrator.control.rollout); returns once it is done.

        The rollout goes on when the caller goes away: a pool is never left half-rolled by a lost client."""
        if role != "draft":
            raise InvalidArgument("pool", "only the 'draft' pool's model can be replaced" + (
                ": the target's defines the output" if role == "target" else ""))
        if not model.strip():
            raise InvalidArgument("model", "must name a model directory, .gguf file, embedded alias or hub id")
        controller = self.controllers.get(role)
        if role in self.options.attached:
            raise not_managed(role, "replace their model")
        if controller is None:
            raise NotManagedHere("this orchestrator does not own a draft pool; replace its model where it was started"
                                 " (or start one with a draft)")
        if self.rollout is not None and self.rollout.running:
            raise RolloutInProgress(f"{self.rollout.progress}; one rollout at a time")
        # The new model's vocabulary is checked against the target's, as any target replica reports it.
        target = PooledTargetClient(self.pools["target"], max_replica_failures=self.options.max_replica_failures,
                                    acquire_timeout_s=self.options.acquire_timeout_s)
        self.rollout = Rollout(controller, model.strip(), target.model_info, self.options.start_timeout_s,
                               self._draft_model_is)
        await asyncio.shield(self.rollout.start())
        return self.state(role)

    def _draft_model_is(self, model: str) -> None:
        self.metrics.draft_model_info.clear()  # one series: the model new draft replicas serve
        self.metrics.draft_model_info.labels(model=model).set(1)

    def state(self, role: str) -> admin_pb2.PoolState:
        controller = self.controllers.get(role)
        rollout = self.rollout if controller is not None and controller.rolling else None
        return pool_state(role, self.pools[role], controller, rollout)

    def list(self) -> admin_pb2.ListReplicasResponse:
        return admin_pb2.ListReplicasResponse(pools=[self.state(role) for role in sorted(self.pools)])

