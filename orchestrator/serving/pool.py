"""A pool of draft or target replicas as one orchestrator sees it: discovery, health, routing.

Replicas come from a `discover()` callable (Ray named actors, or fixed addresses in
tests), each with a `resolve()` that returns its current gRPC address: a restarted
replica serves on a new port, so an unreachable one is resolved again. Every
`check_interval_s` the pool asks each replica's grpc.health.v1 service whether it is
SERVING, then its GetModelInfo for its load (a replica that fails either is not
routed to). A new session goes to the serving replica with the least load
(orchestrator.serving.load: one with KV room and nobody waiting first) and stays
there until it ends or the replica is lost. A replica that fails its checks
UNREACHABLE_AFTER_FAILED_CHECKS times in a row is found unreachable: the calls in flight
on it (`Replica.unless_unreachable`) fail as UNAVAILABLE at once, so they fail over
instead of waiting out their deadlines on a stalled link or a hung replica.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Mapping, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from orchestrator.serving.clients import DraftClient, TargetClient, open_channel
from orchestrator.serving.load import Load, replica_load
from orchestrator.decoding.background import spawn_background
from specmesh.server.service import ReplicaConfig
from specmesh.v1 import common_pb2

log = logging.getLogger(__name__)
Resolve = Callable[[], Awaitable[str]]
Discover = Callable[[], Awaitable[dict[str, Resolve]]]
CHECK_TIMEOUT_S = 2.0
# Health checks failed in a row that make the calls in flight on a replica fail over. Not one: a busy
# replica may miss one check, and abandoning its calls would move all its sessions at once, each paying
# a re-prefill and using up one of its max_replica_failures. Two mean about 2 x CHECK_TIMEOUT_S without an
# answer: a stall or a hang, still far short of a target call's deadline (120 s by default).
UNREACHABLE_AFTER_FAILED_CHECKS = 2
CLIENTS = {"draft": DraftClient, "target": TargetClient}
RESOLVE_TIMEOUT_S = 60.0  # a restarting replica loads its model before it answers


class NoHealthyReplica(Exception):
    def __init__(self, role: str, waited_s: float, why: str = ""):
        super().__init__(f"no healthy {role} replica (waited {waited_s:.1f} s)" + (f": {why}" if why else ""))


class ReplicaGone(Exception):
    """resolve() raises this when a replica is dead for good (not being restarted)."""


class ReplicaStartFailed(Exception):
    """A controller's start_replica(): the replica did not start (a bad model, or not in time)."""


@dataclass
class Replica:
    name: str
    resolve: Resolve
    address: str | None = None
    channel: grpc.aio.Channel | None = None
    client: object = None  # DraftClient or TargetClient over `channel`
    serving: bool = False
    draining: bool = False  # set by the controller here; other orchestrators see NOT_SERVING
    gone: bool = False
    routed: int = 0  # sessions this orchestrator placed here and has not released
    placed: int = 0  # sessions this orchestrator ever placed here
    placed_at_report: int = 0  # `placed` when the replica's last load report (`info`) was asked for
    open_sessions: int = 0  # sessions open on the replica, from its last check
    refused_us: bool = False  # its last check was UNAUTHENTICATED: logged once, not every check
    failures: int = 0  # calls that found it lost; a check begun before one must not revive it
    failed_checks: int = 0  # health checks failed in a row
    # The calls in flight here, each watched by an asyncio.timeout without a deadline (unless_unreachable).
    calls: set[asyncio.Timeout] = field(default_factory=set, repr=False)
    info: common_pb2.ModelInfo | None = None  # what it serves, from its last check
    resolving: asyncio.Task | None = field(default=None, repr=False)

    @property
    def state(self) -> str:
        if self.draining:
            return "draining"
        if self.serving:
            return "serving"
        return "unhealthy" if self.address else "starting"

    @property
    def load(self) -> Load:
        return replica_load(self.info, self.placed - self.placed_at_report)

    async def unless_unreachable(self, call: Awaitable):
        """What `call` (a call on this replica) returns; UNAVAILABLE as soon as the pool finds the replica
        unreachable while it is in flight (abandon_calls), rather than when the call's deadline passes."""
        # An asyncio.timeout rather than a race against a task: on every round's path it costs a few
        # microseconds and no task. Expiring it cancels the call where it waits (the RPC, or its message on
        # a round stream, which drops the stream), and asyncio.timeout tells that cancellation apart from one
        # of the caller's own task (the client went away), which propagates as a cancellation.
        watch = asyncio.timeout(None)
        try:
            async with watch:
                self.calls.add(watch)
                try:
                    return await call
                finally:
                    self.calls.discard(watch)
        except TimeoutError:
            if not watch.expired():
                raise  # the call's own
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                details=f"replica {self.name} failed {UNREACHABLE_AFTER_FAILED_CHECKS} health checks in a row "
                        "during the call") from None

    def abandon_calls(self) -> None:
        """The replica is unreachable: every call in flight on it raises UNAVAILABLE now."""
        calls, self.calls = self.calls, set()
        now = asyncio.get_running_loop().time()
        for watch in calls:
            watch.reschedule(now)


def _ignore(*args) -> None:
    pass


@dataclass(frozen=True)
class PoolHooks:
    """What a pool is built with besides its replicas: how it makes each replica's client, and whom it tells
    what its checks find (each hook gets the pool's role first)."""

    client_options: Mapping[str, object] = field(default_factory=dict)  # keyword arguments of every client
    # Every ModelInfo a health check got (step costs: orchestrator.serving.step_reports).
    on_info: Callable[[str, common_pb2.ModelInfo], None] = _ignore
    # Whether any replica serves, each time that changes: a stopped or hung replica fails its checks without
    # dying, and only this tells health about it.
    on_serving: Callable[[str, bool], None] = _ignore
    on_restarted: Callable[[str], None] = _ignore  # a replica came back at a new address


class ReplicaPool:
    def __init__(self, role: str, discover: Discover, make_client: Callable[[grpc.aio.Channel], object],
                 check_interval_s: float = 1.0, interceptors: Sequence = (), tls=None, hooks: PoolHooks = PoolHooks()):
        self.role = role
        self.discover = discover
        options = hooks.client_options
        self.make_client = functools.partial(make_client, **options) if options else make_client
        self.check_interval_s = check_interval_s
        self.interceptors = interceptors
        self.tls = tls  # specmesh.server.security.TLSConfig of the channels to replicas; None = plaintext
        self.replicas: dict[str, Replica] = {}
        self.withheld: set[str] = set()  # serving replicas that get no sessions yet (a rollout checks them first)
        self.failed = False  # set by a supervisor while no replica is up (each crash-looping or given up)
        self.on_restarted = hooks.on_restarted
        self.on_serving = hooks.on_serving
        self.serving = True  # as far as health is concerned: until a refresh finds otherwise
        self.on_info = hooks.on_info
        self._task: asyncio.Task | None = None

    # ---- routing

    def routable(self) -> list[Replica]:
        return [r for r in self.replicas.values()
                if r.serving and not r.draining and r.client is not None and r.name not in self.withheld]

    def try_acquire(self, exclude: Sequence[str] = (), session: bool = True) -> Replica | None:
        """The least-loaded routable replica; `session`: a new session goes there (it adds to the load)."""
        candidates = [r for r in self.routable() if r.name not in exclude]
        if not candidates:
            return None
        replica = min(candidates, key=lambda r: (r.load.routing_key(), r.name))
        replica.routed += 1
        replica.placed += session
        return replica

    async def acquire(self, timeout: float, session: bool = True) -> Replica:
        """The least-loaded serving replica; waits up to `timeout` for one to become healthy."""
        started = time.monotonic()
        while (replica := self.try_acquire(session=session)) is None:
            if self.failed:
                raise NoHealthyReplica(self.role, time.monotonic() - started, "the pool failed: every replica "
                                       "used up its restarts and is retried with backoff")
            if time.monotonic() - started >= timeout:
                raise NoHealthyReplica(self.role, time.monotonic() - started, self._refusals())
            await asyncio.sleep(min(0.05, timeout))
        return replica

    def refusing(self) -> list[Replica]:
        """Replicas whose last check was UNAUTHENTICATED: they hold another internal token than we send."""
        return [r for r in self.replicas.values() if r.refused_us]

    def _refusals(self) -> str:
        refusing = self.refusing()
        return ", ".join(f"{r.name} at {r.address} refuses this orchestrator's internal token" for r in refusing)

    def release(self, replica: Replica) -> None:
        replica.routed = max(0, replica.routed - 1)

    def mark_failed(self, replica: Replica) -> None:
        """A call found the replica unreachable: route nothing there until a check says SERVING."""
        replica.serving = False
        replica.failures += 1

    # ---- discovery and health

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        for replica in list(self.replicas.values()):
            await self._forget(replica)

    async def _run(self) -> None:
        while True:
            try:
                await self.refresh()
            except asyncio.CancelledError:
                if _cancelling():  # stop(): this task itself is being cancelled
                    raise
                # An RPC whose channel was closed under it (a replica that moved) surfaces as
                # CancelledError; it must not end discovery and health checks for good.
                log.warning("%s pool refresh: a health check was cancelled", self.role)
            except Exception:  # noqa: BLE001 - keep checking; one bad round must not stop routing
                log.exception("%s pool refresh failed", self.role)
            await asyncio.sleep(self.check_interval_s)

    async def refresh(self) -> None:
        """Sync with discovery, then check every replica's health concurrently."""
        found = await self.discover()
        for name in set(self.replicas) - set(found):
            await self._forget(self.replicas.pop(name))
        for name, resolve in found.items():
            if name not in self.replicas:
                self.replicas[name] = Replica(name, resolve)
        await asyncio.gather(*(self._check(r) for r in list(self.replicas.values())))
        self._note_serving()

    def _note_serving(self) -> None:
        # After every check, not once per refresh: a replica resolved between refreshes serves at once,
        # and health must not say NOT_SERVING while it is routed to.
        serving = any(r.serving for r in self.replicas.values())
        if serving != self.serving:
            self.serving = serving
            self.on_serving(self.role, serving)

    async def _check(self, replica: Replica) -> None:
        if replica.address is None:
            self._start_resolving(replica)
            return
        failures = replica.failures
        try:
            stub = health_pb2_grpc.HealthStub(replica.channel)
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=CHECK_TIMEOUT_S)
            serving = reply.status == health_pb2.HealthCheckResponse.SERVING
            if serving:
                # Sessions placed from now on may be missing from the report: they count on top of it.
                placed = replica.placed
                replica.info = await replica.client.model_info(timeout=CHECK_TIMEOUT_S)
                replica.open_sessions = replica.info.open_sessions
                replica.placed_at_report = max(replica.placed_at_report, placed)
                self.on_info(self.role, replica.info)
            replica.serving = serving and replica.failures == failures
            replica.failed_checks = 0  # it answered: not unreachable, however busy
            self._note_serving()
        except (grpc.aio.AioRpcError, asyncio.TimeoutError) as error:
            code = error.code() if isinstance(error, grpc.aio.AioRpcError) else "timed out"
            if code == grpc.StatusCode.UNAUTHENTICATED and not replica.refused_us:
                log.error("%s replica %s at %s refuses this orchestrator: it holds another internal token "
                          "(on Ray: the API key)", self.role, replica.name, replica.address)
            elif replica.serving:
                log.warning("%s replica %s at %s failed its health check: %s", self.role, replica.name,
                            replica.address, code)
            replica.refused_us = code == grpc.StatusCode.UNAUTHENTICATED
            replica.serving = False
            self._note_failed_check(replica)
            self._note_serving()
            self._start_resolving(replica)  # it may have restarted on another port

    def _note_failed_check(self, replica: Replica) -> None:
        replica.failed_checks += 1
        if replica.failed_checks >= UNREACHABLE_AFTER_FAILED_CHECKS and replica.calls:
            log.warning("%s replica %s at %s failed %d health checks in a row: its %d calls in flight fail over",
                        self.role, replica.name, replica.address, replica.failed_checks, len(replica.calls))
            replica.abandon_calls()

    def _start_resolving(self, replica: Replica) -> None:
        if replica.resolving is None or replica.resolving.done():
            replica.resolving = asyncio.ensure_future(self._resolve(replica))

    async def _resolve(self, replica: Replica) -> None:
        try:
            address = await asyncio.wait_for(replica.resolve(), RESOLVE_TIMEOUT_S)
        except ReplicaGone:
            replica.gone, replica.serving = True, False
            return
        except Exception as error:  # noqa: BLE001 - try again at the next check
            log.info("%s replica %s not reachable yet: %s", self.role, replica.name, error)
            return
        if address != replica.address:
            if replica.channel is not None:  # calls still on it fail over; close it once they are done
                _close_later(replica.channel, CHECK_TIMEOUT_S + 1.0)
            if replica.address is not None:  # a new incarnation: the supervisor or Ray restarted it
                self.on_restarted(self.role)
            replica.address = address
            replica.channel = open_channel(address, self.tls, self.interceptors)
            replica.client = self.make_client(replica.channel)
            log.info("%s replica %s at %s", self.role, replica.name, address)
        await self._check(replica)

    async def remove(self, name: str) -> None:
        """Forget a replica its controller has just stopped, without waiting for the next refresh."""
        self.withheld.discard(name)
        if name in self.replicas:
            await self._forget(self.replicas.pop(name))

    async def _forget(self, replica: Replica) -> None:
        replica.serving = False
        if replica.resolving is not None:
            replica.resolving.cancel()
        # Sessions still placed here keep the channel: their next call fails over.
        if replica.channel is not None and replica.routed == 0:
            await replica.channel.close(grace=None)

    async def wait_serving(self, count: int, timeout: float) -> None:
        """Refresh until at least `count` replicas serve (start-up and tests)."""
        deadline = time.monotonic() + timeout
        while len(self.routable()) < count:
            if time.monotonic() > deadline:
                raise NoHealthyReplica(self.role, timeout)
            if self._task is None:  # else the running refresher does it
                await self.refresh()
            await asyncio.sleep(0.1)


@dataclass(frozen=True)
class PoolSpec:
    replica: ReplicaConfig  # what each replica serves
    replicas: int = 1  # initial size
    min_replicas: int | None = None  # autoscaling bounds; None = replicas (no autoscaling)
    max_replicas: int | None = None
    num_cpus: float = 1.0  # Ray resources per replica (the Ray backend only)
    num_gpus: float = 0.0  # > 1: the target is sharded over that many GPUs of one node
    resources: dict[str, float] = field(default_factory=dict)  # custom Ray resources (a worker group's)
    max_restarts: int = 3  # Ray restarts of one replica before it is replaced (the local backend: RestartPolicy)
    load_per_replica: float = 4.0  # autoscaling target: mean load per serving replica (orchestrator.serving.load)
    scale_cooldown_s: float = 30.0
    drain_grace_s: float = 60.0  # longest a removed replica waits for its sessions

    @property
    def role(self) -> str:
        return self.replica.role

    @property
    def bounds(self) -> tuple[int, int]:
        low = self.replicas if self.min_replicas is None else self.min_replicas
        high = self.replicas if self.max_replicas is None else self.max_replicas
        return low, high


def new_pool(role: str, discover: Discover, check_interval_s: float, interceptors=(), tls=None,
             hooks: PoolHooks = PoolHooks()) -> ReplicaPool:
    return ReplicaPool(role, discover, CLIENTS[role], check_interval_s, interceptors, tls, hooks)


def fixed_replicas(addresses: dict[str, str]) -> Discover:
    """Discovery over replicas at known addresses (no Ray): tests and static deployments."""
    def constant(address: str) -> Resolve:
        async def resolve() -> str:
            return address
        return resolve

    async def discover() -> dict[str, Resolve]:
        return {name: constant(address) for name, address in addresses.items()}
    return discover


def _cancelling() -> bool:
    """True when the current task has been asked to cancel (not when a call inside it was)."""
    task = asyncio.current_task()
    return bool(task is not None and getattr(task, "cancelling", lambda: 1)())


def _close_later(channel: grpc.aio.Channel, delay_s: float) -> None:
    """Close a replaced channel after in-flight health checks on it have timed out."""
    async def close() -> None:
        await asyncio.sleep(delay_s)
        await channel.close()
    spawn_background(close())

