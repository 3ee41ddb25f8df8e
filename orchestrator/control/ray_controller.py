"""Ray side of the pools: create replica actors, scale them, drain and replace them.

One `PoolController` per pool lives in the orchestrator process that owns the
actors (`specmesh serve`). Replicas are named actors `specmesh-<role>-<n>` in the
Ray namespace, so other orchestrators (`python -m orchestrator --ray-address`)
discover the same replicas with `ray_discovery`. Ray restarts a crashed replica
(`max_restarts`); one that is dead for good is replaced to keep the pool's size.
Removing a replica drains it: health NOT_SERVING (routers stop sending new
sessions), then it is killed once its sessions have finished or the grace period
has passed (sessions still there then move to another replica).
"""

from __future__ import annotations

import asyncio
import logging
import time

from orchestrator.serving.load import Load
from orchestrator.serving.pool import (Discover, PoolHooks, PoolSpec, ReplicaGone, ReplicaStartFailed, Resolve,
                                       new_pool)
from orchestrator.control.ray_replica import ReplicaActor
from specmesh.loading import openmp
from specmesh.roles import role
from specmesh.server.service import ReplicaConfig

log = logging.getLogger(__name__)
ACTOR_PREFIX = "specmesh-"
# Ray's worker processes renice themselves to 15 unless told otherwise (RAY_worker_niceness).
NORMAL_PRIORITY = {"RAY_worker_niceness": "0"}


def replica_runtime_env(role_name: str) -> dict:
    """A replica actor's environment, set before its worker starts: normal CPU priority (Ray renices
    its workers to 15, so on a busy node a replica, which serves requests, would get a sliver of the
    CPU behind every other process, and take minutes to start), and the role's OpenMP setting before
    it loads torch (specmesh.loading.openmp)."""
    return {"env_vars": {**NORMAL_PRIORITY, **openmp.spin_environment(role(role_name))}}


def actor_resolver(handle) -> Resolve:
    async def resolve() -> str:
        import ray
        try:
            return await handle.address.remote()
        except ray.exceptions.ActorDiedError as error:
            raise ReplicaGone(str(error)) from error
    return resolve


def ray_discovery(role: str, namespace: str) -> Discover:
    """The replicas of a pool as named actors in `namespace` (for orchestrators that join)."""
    import ray
    handles: dict[str, object] = {}

    async def discover() -> dict[str, Resolve]:
        prefix = f"{ACTOR_PREFIX}{role}-"
        names = [n for n in await asyncio.to_thread(ray.util.list_named_actors) if n.startswith(prefix)]
        found = {}
        for name in names:
            if name not in handles:
                handles[name] = ray.get_actor(name, namespace=namespace)
            found[name] = actor_resolver(handles[name])
        return found
    return discover


class PoolController:
    def __init__(self, spec: PoolSpec, namespace: str, check_interval_s: float = 1.0, interceptors=(), tls=None,
                 hooks: PoolHooks = PoolHooks()):
        self.spec = spec
        self.namespace = namespace
        self.actors: dict[str, object] = {}  # live and draining replicas, by actor name
        self.draining: dict[str, asyncio.Task] = {}
        self.desired = spec.replicas
        self.rolling = False  # a rollout is replacing the replicas: no autoscaling meanwhile
        self.pool = new_pool(spec.role, self._discover, check_interval_s, interceptors, tls, hooks)
        self._index = 0
        self._last_scaled = 0.0
        self._task: asyncio.Task | None = None

    async def _discover(self) -> dict[str, Resolve]:
        return {name: actor_resolver(handle) for name, handle in self.actors.items()}

    def start(self) -> None:
        self.scale_to(self.desired)
        self.pool.start()
        self._task = asyncio.ensure_future(self._run())

    async def wait_ready(self, timeout_s: float) -> None:
        await self.pool.wait_serving(1, timeout_s)

    def metrics_ports(self) -> dict[str, int]:
        return {}  # replica actors serve no /metrics of their own

    async def stop(self) -> None:
        import ray
        if self._task is not None:
            self._task.cancel()
        for task in self.draining.values():
            task.cancel()
        for handle in self.actors.values():
            ray.kill(handle, no_restart=True)
        self.actors.clear()
        await self.pool.stop()

    def live(self) -> list[str]:
        return [name for name in self.actors if name not in self.draining]

    def scale_to(self, replicas: int) -> None:
        """Start or drain replicas until `replicas` are live (draining ones not counted)."""
        self.desired = replicas
        self._last_scaled = time.monotonic()
        live = self.live()
        for _ in range(replicas - len(live)):
            self._add_replica()
        for name in self._drain_order(live)[:max(0, len(live) - replicas)]:
            self.draining[name] = asyncio.ensure_future(self._drain(name))

    def _drain_order(self, names: list[str]) -> list[str]:
        """Cheapest to remove first: not yet serving, then least loaded, then newest."""
        def cost(name: str):
            replica = self.pool.replicas.get(name)
            if replica is None or not replica.serving:
                return (0, 0.0, -self._number(name))
            return (1, replica.load.score, -self._number(name))
        return sorted(names, key=cost)

    @staticmethod
    def _number(name: str) -> int:
        return int(name.rsplit("-", 1)[1])

    def _add_replica(self, config: ReplicaConfig | None = None) -> str:
        """Start a replica actor of `config` (default: the spec's); Ray restarts it with that config."""
        import ray
        spec = self.spec
        remote = ray.remote(ReplicaActor)
        while True:
            name = f"{ACTOR_PREFIX}{spec.role}-{self._index}"
            self._index += 1
            try:
                handle = remote.options(name=name, namespace=self.namespace, num_cpus=spec.num_cpus,
                                        num_gpus=spec.num_gpus, resources=spec.resources or None,
                                        max_restarts=spec.max_restarts, max_task_retries=2,
                                        runtime_env=replica_runtime_env(spec.role)).remote(config or spec.replica)
                break
            except ValueError:  # the name is taken (another run in this namespace): try the next
                continue
        handle.address.remote()  # start loading the model now, not at the first health check
        self.actors[name] = handle
        log.info("started %s replica %s", spec.role, name)
        return name

    # ---- what a rollout (orchestrator.control.rollout) does with the replicas

    async def start_replica(self, config: ReplicaConfig, timeout_s: float) -> str:
        """One more replica actor serving `config`, once it has started; ReplicaStartFailed (and none left) if not.

        It gets no sessions until the caller takes it out of `pool.withheld`."""
        import ray
        name = self._add_replica(config)
        self.pool.withheld.add(name)  # before the pool's next refresh can find it
        try:
            await asyncio.wait_for(self.actors[name].address.remote(), timeout_s)
        except Exception as error:  # noqa: BLE001 - the model failed to load (a RayTaskError), or too slow
            ray.kill(self.actors.pop(name), no_restart=True)
            await self.pool.remove(name)
            lines = str(error).strip().splitlines()  # a RayTaskError carries the actor's traceback: its last line
            raise ReplicaStartFailed(lines[-1] if lines else type(error).__name__) from error
        return name

    async def remove_replica(self, name: str) -> None:
        """Drain one replica (as scaling down does) and wait until it is gone."""
        task = self.draining[name] = asyncio.ensure_future(self._drain(name))
        await task
        await self.pool.remove(name)

    async def _drain(self, name: str) -> None:
        import ray
        handle = self.actors[name]
        replica = self.pool.replicas.get(name)
        if replica is not None:
            replica.draining = True
        deadline = time.monotonic() + self.spec.drain_grace_s
        try:
            await asyncio.wait_for(handle.drain.remote(), self.spec.drain_grace_s)
            while time.monotonic() < deadline and await handle.open_sessions.remote() > 0:
                await asyncio.sleep(0.2)
        except Exception as error:  # noqa: BLE001 - a dead replica has nothing left to drain
            log.info("draining %s replica %s: %s", self.spec.role, name, error)
        ray.kill(handle, no_restart=True)
        self.actors.pop(name, None)
        self.draining.pop(name, None)
        log.info("removed %s replica %s", self.spec.role, name)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.pool.check_interval_s)
            try:
                self._replace_gone()
                self._autoscale()
            except Exception:  # noqa: BLE001
                log.exception("%s pool controller", self.spec.role)

    def _replace_gone(self) -> None:
        """Replicas that used up their restarts are dropped and replaced."""
        for name, replica in list(self.pool.replicas.items()):
            if replica.gone and name in self.actors and name not in self.draining:
                log.warning("%s replica %s is gone for good; replacing it", self.spec.role, name)
                self.actors.pop(name)
                self._add_replica()

    def _autoscale(self) -> None:
        low, high = self.spec.bounds
        if low >= high or self.rolling or time.monotonic() - self._last_scaled < self.spec.scale_cooldown_s:
            return
        loads = [r.load for r in self.pool.routable()]
        wanted = autoscale(self.desired, low, high, loads, self.spec.load_per_replica)
        if wanted != self.desired:
            log.info("%s pool: load %.1f on %d serving replicas (%d full); scaling to %d", self.spec.role,
                     sum(load.score for load in loads), len(loads), sum(not load.has_room for load in loads), wanted)
            self.scale_to(wanted)


def autoscale(desired: int, low: int, high: int, loads: list[Load], load_per_replica: float) -> int:
    """One step towards `load_per_replica` mean load; `loads` are the serving replicas' loads.

    Up when the mean is above the target, or when no replica has room for a new session
    (all KV-full or queueing); down only when every replica has room and one replica
    fewer would stay under half the target, so the pool does not flap around the threshold.
    """
    if not loads:
        return desired  # nothing serving yet (starting or restarting): no figure to act on
    total = sum(load.score for load in loads)
    crowded = not any(load.has_room for load in loads)
    if (total / len(loads) > load_per_replica or crowded) and desired < high:
        return desired + 1
    roomy = all(load.has_room for load in loads)
    if desired > low and roomy and total <= (desired - 1) * load_per_replica / 2:
        return desired - 1
    return desired
