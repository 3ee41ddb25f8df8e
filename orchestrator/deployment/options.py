"""What a deployment's replica pools are: the backend, each role's pool, and how replicas are kept alive."""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.deployment.failover import MAX_REPLICA_FAILURES
from orchestrator.deployment.pool import PoolSpec
from specmesh.roles import START_TIMEOUT_S
from specmesh.security import TLSConfig

BACKENDS = ("local", "ray")


@dataclass(frozen=True)
class RestartPolicy:
    initial_backoff_s: float = 0.5  # before the first restart; doubles with each restart in the window
    max_backoff_s: float = 10.0
    max_restarts: int = 5  # restarts of one replica within window_s before it is given up
    window_s: float = 60.0

    def backoff(self, recent_restarts: int) -> float:
        return min(self.max_backoff_s, self.initial_backoff_s * 2 ** max(0, recent_restarts - 1))


TARGET_WAIT_S = 120.0


@dataclass(frozen=True)
class PoolsOptions:
    backend: str = "ray"  # "local": child processes under a supervisor; "ray": Ray actors
    namespace: str = "specmesh"  # Ray only
    target: PoolSpec | None = None  # None (both): join the pools in `namespace`
    draft: PoolSpec | None = None  # None while target is set: serve target-only
    check_interval_s: float = 1.0  # health checks and controller ticks
    max_replica_failures: int = MAX_REPLICA_FAILURES  # replicas one request may lose before it fails
    # Longest a request waits for a healthy target replica (within its own deadline): long enough for a
    # restarted replica to load its model, in both backends.
    acquire_timeout_s: float = TARGET_WAIT_S
    draft_acquire_timeout_s: float = 0.0  # no healthy draft: the round goes target-only at once
    restart_policy: RestartPolicy = RestartPolicy()  # local backend: restarts of a dead replica
    start_timeout_s: float = START_TIMEOUT_S
    channel_tls: TLSConfig | None = None  # the orchestrator's channels to replicas; None = plaintext

    @property
    def manage(self) -> bool:
        return self.target is not None
