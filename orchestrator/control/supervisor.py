"""Local replicas: each one a child process serving one model service, restarted when it dies.

The local counterpart of `ray_controller.PoolController`: one `LocalPoolController`
per role starts its replicas as children (`run_replica`, which starts the service the
one way every deployment does, `specmesh.server.service.run_model_service`), forked from a
warm template that has imported the serving path (`template.ReplicaTemplate`; spawned
where it cannot serve them), learns each one's port from a pipe, and hands the pool a
`resolve()` per replica that returns the address of its current incarnation. A child that dies is started
again after an exponential backoff and comes back on a new port; the pool's health
checks find it by resolving again, exactly as with a restarted Ray actor. A replica
that dies more than `max_restarts` times within `window_s` is crash-looping: it is
retried with a slower backoff (`RestartPolicy.crash_loop_backoff`) until one of its
incarnations runs for `window_s`. A role with no replica up (each crash-looping or
given up) is failed, and recovers once a replica starts again; both are reported to
`on_role_failed`. Only a replica whose very first start fails (a bad model or flag)
is given up for good. One child's death never touches the others.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import multiprocessing as mp
import os
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import Callable

from orchestrator.control.options import RestartPolicy
from orchestrator.serving.pool import PoolHooks, PoolSpec, Replica, ReplicaGone, ReplicaStartFailed, Resolve, new_pool
from orchestrator.control.replicas import create_model_server
from orchestrator.control.template import (TEMPLATE, ReplicaTemplate, forked, open_pidfd, readable, spawn,
                                              stop_template)
from specmesh.roles import START_TIMEOUT_S, role
from specmesh.server.service import ReplicaConfig, load_engine, run_model_service

log = logging.getLogger(__name__)
STOP_GRACE_S = 10.0
PR_SET_PDEATHSIG = 1  # prctl(2)


@dataclass(frozen=True)
class Started:
    """What a child reports on its pipe once: its ports, or why it could not start."""

    port: int | None
    metrics_port: int | None = None
    error: str | None = None


def run_replica(config: ReplicaConfig, report: Connection) -> None:
    """Child process: load the model, serve it, report the port; SIGTERM stops it gracefully."""
    _leave_the_terminal_to_the_parent()
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s {config.role} %(process)d %(levelname)s %(message)s")
    log.info("%s replica process %d: its modules imported", config.role, os.getpid())
    try:
        engine = load_engine(config.service, config.role)
        asyncio.run(run_model_service(config, engine, create_model_server, lambda port, metrics_port: report.send(
            Started(port, metrics_port))))
    except Exception as error:  # noqa: BLE001 - reported to the supervisor, then exit
        report.send(Started(None, error=f"{type(error).__name__}: {error}"))
        sys.exit(1)


def _leave_the_terminal_to_the_parent() -> None:
    """Ctrl-C reaches `specmesh serve` alone, which stops its children in order; a parent killed
    outright still takes them down (Linux: SIGTERM on the parent's death)."""
    os.setpgrp()
    try:  # the parent: the supervisor, or the template a replica was forked from (template._run_forked)
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: children outlive a killed parent
        pass


class LocalReplica:
    """One supervised child: its current process, and the address of its current incarnation."""

    def __init__(self, name: str, config: ReplicaConfig, policy: RestartPolicy,
                 on_change: Callable[[], None], on_restart: Callable[[], None],
                 template: ReplicaTemplate | None = TEMPLATE):
        self.name = name
        self.config = config
        self.policy = policy
        self.template = template  # None: every incarnation spawned
        self.on_change = on_change  # given up, crash-looping, or up again after crash-looping
        self.on_restart = on_restart  # each start after a death
        self.process: mp.Process | None = None
        self.pidfd: int | None = None  # of a forked incarnation: its exit, which its sentinel may not be
        self.metrics_port: int | None = None  # of the running incarnation
        self.address: asyncio.Future = asyncio.get_running_loop().create_future()
        self.first_start: asyncio.Future = asyncio.get_running_loop().create_future()  # None or the error
        self.restarts: deque[float] = deque()
        self.gone = False
        self.crash_loops = 0  # restarts since it began crash-looping; 0: not crash-looping
        self.backing_off = False  # crash-looping and not up: from the death until an incarnation serves
        self.retry_at: float | None = None  # monotonic time of the next crash-loop restart
        self.stopping = False
        self.task: asyncio.Task | None = None

    async def resolve(self) -> str:
        """host:port of the running incarnation; waits while it (re)starts; ReplicaGone once given up."""
        if self.gone:
            raise ReplicaGone(f"{self.config.role} replica {self.name} was given up")
        return await asyncio.shield(self.address)

    def start(self) -> None:
        self.task = asyncio.ensure_future(self._supervise())

    async def _supervise(self) -> None:
        while not self.stopping:
            first = not self.first_start.done()
            began = time.monotonic()
            started = await self._run_once()
            if self.stopping:
                return
            if first and started.port is None:  # a bad model or flag: restarting cannot help
                self._give_up(f"failed to start: {started.error}")
                return
            await asyncio.sleep(self._restart_delay(time.monotonic() - began))
            self.retry_at = None  # due: a crash-looping replica is now starting, still failed until it serves
            if not self.stopping:
                self.on_restart()

    def _restart_delay(self, ran_s: float) -> float:
        """How long to wait before the next incarnation; past the restart cap the replica crash-loops."""
        if ran_s >= self.policy.window_s:  # it ran a whole window: whatever crashed it, it is not a loop
            self.crash_loops = 0
        recent = self._count_restart()
        code = self.process.exitcode
        if recent <= self.policy.max_restarts and not self.crash_loops:
            delay = self.policy.backoff(recent)
            log.warning("%s replica %s exited (code %s); restarting in %.1f s (restart %d within %.0f s)",
                        self.config.role, self.name, code, delay, recent, self.policy.window_s)
            return delay
        self.crash_loops += 1
        delay = self.policy.crash_loop_backoff(self.crash_loops)
        self.backing_off, self.retry_at = True, time.monotonic() + delay
        log.error("%s replica %s exited (code %s), %d times within %.0f s: crash-looping; retry %d in %.1f s",
                  self.config.role, self.name, code, recent, self.policy.window_s, self.crash_loops, delay)
        self.on_change()
        return delay

    async def _run_once(self) -> Started:
        """Start the child, publish its address once it reports, return when it has exited."""
        receive, send = mp.Pipe(duplex=False)
        name, replica_role = f"specmesh-{self.name}", role(self.config.role)
        try:
            if self.template is None:
                self.process = spawn(run_replica, (self.config, send), name, replica_role)
            else:
                self.process = await self.template.start(run_replica, (self.config, send), name, replica_role,
                                                         self.config.service.device)
        finally:
            send.close()  # the child holds the only write end: EOF on `receive` means it died
        self.pidfd = open_pidfd(self.process)
        try:
            started = await self._wait_started(receive)
            if not self.first_start.done():
                self.first_start.set_result(started.error if started.port is None else None)
            if started.port is not None:
                self.metrics_port = started.metrics_port
                self.address.set_result(f"{_dial_host(self.config.service.host)}:{started.port}")
                log.info("%s replica %s serving on %s (pid %d, %s)", self.config.role, self.name,
                         self.address.result(), self.process.pid,
                         "forked from the template" if forked(self.process) else "spawned")
                if self.backing_off:
                    self.backing_off = False
                    self.on_change()
            if self.template is None:
                await readable(self.process.sentinel)
            else:
                await self.template.wait_exit(self.process, self.pidfd, STOP_GRACE_S)
            self.process.join()
        finally:
            receive.close()
            if self.pidfd is not None:
                os.close(self.pidfd)
                self.pidfd = None
        if self.address.done():  # the next incarnation gets a fresh address
            self.address = asyncio.get_running_loop().create_future()
        return started

    async def _wait_started(self, receive: Connection) -> Started:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            await asyncio.wait_for(readable(receive.fileno(), self.process.sentinel), START_TIMEOUT_S)
            if receive.poll():
                try:
                    return receive.recv()
                except EOFError:
                    break
            if self.process.exitcode is not None:
                break
        return Started(None, error=f"exited with code {self.process.exitcode} before it was serving")

    def _count_restart(self) -> int:
        now = time.monotonic()
        self.restarts.append(now)
        while self.restarts and now - self.restarts[0] > self.policy.window_s:
            self.restarts.popleft()
        return len(self.restarts)

    def _give_up(self, reason: str) -> None:
        log.error("%s replica %s %s; giving it up", self.config.role, self.name, reason)
        self.gone = True
        if not self.address.done():
            self.address.set_exception(ReplicaGone(reason))
            self.address.exception()  # retrieved: waiting resolvers get it, nobody else must
        self.on_change()

    @property
    def state(self) -> str | None:
        """What `specmesh replicas` shows when the supervisor knows better than the pool's checks."""
        if self.gone:
            return "failed"
        if self.backing_off:
            return "backoff" if self.retry_at is not None else "starting"
        return None

    async def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        self.stopping = True
        if self.task is not None:  # first: what waits here on the process below is this method alone
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        process = self.process
        if process is not None and process.exitcode is None:
            process.terminate()  # SIGTERM: the service stops gracefully
            if not await _exits(process, grace_s):
                log.warning("%s replica %s still running %g s after SIGTERM: killed", self.config.role, self.name,
                            grace_s)
                process.kill()
                if not await _exits(process, STOP_GRACE_S) and forked(process):
                    stop_template()  # it reports no exit, not even of a killed replica: it hangs
            await asyncio.to_thread(process.join)
            log.info("%s replica %s stopped: exit code %s", self.config.role, self.name, process.exitcode)


class LocalPoolController:
    """Keeps `desired` local replicas of one role running; the interface of the Ray PoolController."""

    def __init__(self, spec: PoolSpec, policy: RestartPolicy = RestartPolicy(), check_interval_s: float = 1.0,
                 interceptors=(), tls=None,
                 on_role_failed: Callable[[str, bool], None] = lambda role, failed: None,
                 on_restart: Callable[[str], None] = lambda role: None, hooks: PoolHooks = PoolHooks()):
        self.spec = spec
        self.policy = policy
        self.replicas: dict[str, LocalReplica] = {}
        self.draining: dict[str, asyncio.Task] = {}  # replicas a rollout is draining (scale_to stops at once)
        self.desired = spec.replicas
        self.failed = False
        self.rolling = False  # a rollout is replacing the replicas (serving.Pools refuses to scale meanwhile)
        self.pool = new_pool(spec.role, self._discover, check_interval_s, interceptors, tls, hooks)
        self._on_role_failed = on_role_failed  # (role, failed) each time that changes
        self._on_restart = on_restart
        self._index = 0

    async def _discover(self) -> dict[str, Resolve]:
        return {name: replica.resolve for name, replica in self.replicas.items()}

    def start(self) -> None:
        self.scale_to(self.desired)
        self.pool.start()

    async def wait_ready(self, timeout_s: float) -> None:
        """Every replica's first start; raises RuntimeError naming the role when one fails."""
        for replica in list(self.replicas.values()):
            error = await asyncio.wait_for(asyncio.shield(replica.first_start), timeout_s)
            if error is not None:
                raise RuntimeError(f"{self.spec.role} failed to start: {error}")
        await self.pool.wait_serving(1, timeout_s)

    def addresses(self) -> dict[str, str]:
        """Where each running replica serves gRPC: by role with one replica, else by replica name."""
        running = {name: r.address.result() for name, r in self.replicas.items()
                   if r.address.done() and not r.address.exception()}
        if len(self.replicas) == 1:
            return {self.spec.role: address for address in running.values()}
        return running

    def metrics_ports(self) -> dict[str, int]:
        """Where each running replica serves /metrics: by role with one replica, else by replica name."""
        running = {name: r.metrics_port for name, r in self.replicas.items() if r.metrics_port is not None}
        if len(self.replicas) == 1:
            return {self.spec.role: port for port in running.values()}
        return running

    def live(self) -> list[str]:
        return [name for name, r in self.replicas.items() if not r.gone and name not in self.draining]

    def scale_to(self, replicas: int) -> None:
        self.desired = replicas
        live = self.live()
        for _ in range(replicas - len(live)):
            self._add_replica()
        for name in sorted(live, key=lambda n: -int(n.rsplit("-", 1)[1]))[:max(0, len(live) - replicas)]:
            replica = self.replicas.pop(name)
            asyncio.ensure_future(replica.stop())  # its sessions fail over to the others
            log.info("removed %s replica %s", self.spec.role, name)

    def _add_replica(self, config: ReplicaConfig | None = None) -> str:
        """Start a replica of `config` (default: the spec's); it keeps that config across restarts."""
        name = f"{self.spec.role}-{self._index}"
        config = config or self.spec.replica
        if self._index > 0 and config.service.metrics_port:  # the configured port goes to the first replica only
            config = replace(config, service=replace(config.service, metrics_port=0))
        self._index += 1
        replica = LocalReplica(name, config, self.policy, self._replica_changed,
                               lambda: self._on_restart(self.spec.role))
        self.replicas[name] = replica
        replica.start()
        log.info("started %s replica %s (%s)", self.spec.role, name, config.service.model)
        return name

    # ---- what a rollout (orchestrator.control.rollout) does with the replicas

    async def start_replica(self, config: ReplicaConfig, timeout_s: float) -> str:
        """One more replica serving `config`, once it has started; ReplicaStartFailed (and none left) if not.

        It gets no sessions until the caller takes it out of `pool.withheld`."""
        name = self._add_replica(config)
        self.pool.withheld.add(name)  # before the pool's next refresh can find it
        try:
            error = await asyncio.wait_for(asyncio.shield(self.replicas[name].first_start), timeout_s)
        except asyncio.TimeoutError:
            error = f"not serving within {timeout_s:.0f} s"
        if error is not None:
            await self.remove_replica(name, grace_s=0.0)
            raise ReplicaStartFailed(error)
        return name

    async def remove_replica(self, name: str, grace_s: float | None = None) -> None:
        """Drain one replica: no new sessions; those routed here may finish (up to the drain grace); stop it.

        Sessions still open when it stops move to another replica, or their requests go on target-only.
        """
        self.draining[name] = asyncio.current_task()
        try:
            pooled = self.pool.replicas.get(name)
            if pooled is not None:
                pooled.draining = True
                await _sessions_done(pooled, self.spec.drain_grace_s if grace_s is None else grace_s,
                                     self.pool.check_interval_s)
            replica = self.replicas.pop(name)
        finally:
            self.draining.pop(name, None)
        await replica.stop()
        await self.pool.remove(name)
        log.info("removed %s replica %s", self.spec.role, name)

    def replica_state(self, name: str) -> tuple[str | None, float]:
        """What the supervisor knows of a replica that the pool's checks cannot: its state, or None,
        and the seconds until its next crash-loop restart (0: none due)."""
        replica = self.replicas.get(name)
        if replica is None:
            return None, 0.0
        retry_in_s = max(0.0, replica.retry_at - time.monotonic()) if replica.retry_at is not None else 0.0
        return replica.state, retry_in_s

    def _replica_changed(self) -> None:
        """The role is failed while no replica is up: each one crash-looping or given up."""
        failed = bool(self.replicas) and all(r.gone or r.backing_off for r in self.replicas.values())
        if failed == self.failed:
            return
        self.failed = self.pool.failed = failed
        if failed:
            retries = [r.retry_at for r in self.replicas.values() if r.retry_at is not None]
            log.error("%s role FAILED: every replica exceeded %d restarts within %.0f s or was given up%s",
                      self.spec.role, self.policy.max_restarts, self.policy.window_s,
                      f"; next retry in {min(retries) - time.monotonic():.1f} s" if retries else "")
        else:
            log.warning("%s role recovered: a replica is serving again", self.spec.role)
        self._on_role_failed(self.spec.role, failed)

    async def stop(self) -> None:
        await self.pool.stop()  # first, so that no health check reports the replicas going down
        await asyncio.gather(*(replica.stop() for replica in self.replicas.values()))
        self.replicas.clear()


async def _sessions_done(replica: Replica, grace_s: float, poll_s: float) -> None:
    """Until no session routed here is open, or `grace_s` has passed."""
    deadline = time.monotonic() + grace_s
    while replica.routed > 0 and time.monotonic() < deadline:
        await asyncio.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))


async def _exits(process: mp.Process, timeout_s: float) -> bool:
    """Whether `process`'s exit is known within `timeout_s`."""
    try:
        await asyncio.wait_for(readable(process.sentinel), timeout_s)
        return True
    except asyncio.TimeoutError:
        return False


def _dial_host(bind_host: str) -> str:
    """The address to reach a service bound to `bind_host` on this machine (a wildcard is not one)."""
    return "127.0.0.1" if bind_host in ("", "0.0.0.0", "::", "[::]") else bind_host
