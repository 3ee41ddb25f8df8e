"""What a deployment's replica pools are: the backend, each role's pool, and how replicas are kept alive."""

from __future__ import annotations

from dataclasses import dataclass, field

from orchestrator.serving.failover import MAX_REPLICA_FAILURES
from orchestrator.control.draft_training import DraftTraining
from orchestrator.serving.pool import PoolSpec
from specmesh.roles import START_TIMEOUT_S
from specmesh.server.security import TLSConfig

BACKENDS = ("local", "ray")


@dataclass(frozen=True)
class RestartPolicy:
    initial_backoff_s: float = 0.5  # before the first restart; doubles with each restart in the window
    max_backoff_s: float = 10.0
    max_restarts: int = 5  # restarts of one replica within window_s before it is crash-looping
    window_s: float = 60.0
    # A crash-looping replica is not given up: it is retried ever more slowly, as Kubernetes'
    # CrashLoopBackOff does, so a role comes back by itself once its cause is gone. The cap is
    # short enough that a role is back within minutes of the last crash.
    crash_loop_backoff_s: float = 10.0
    max_crash_loop_backoff_s: float = 120.0

    def backoff(self, recent_restarts: int) -> float:
        return doubling(self.initial_backoff_s, self.max_backoff_s, recent_restarts)

    def crash_loop_backoff(self, retries: int) -> float:
        """Before the `retries`-th restart since the replica began crash-looping."""
        return doubling(self.crash_loop_backoff_s, self.max_crash_loop_backoff_s, retries)


def doubling(base_s: float, cap_s: float, attempt: int) -> float:
    """`base_s` before the first attempt, doubling with each one after, never above `cap_s`."""
    return min(cap_s, base_s * 2 ** max(0, attempt - 1))


TARGET_WAIT_S = 120.0


@dataclass(frozen=True)
class PoolsOptions:
    backend: str = "ray"  # "local": child processes under a supervisor; "ray": Ray actors
    namespace: str = "specmesh"  # Ray only
    target: PoolSpec | None = None  # None (and no target attached): join the pools in `namespace`
    draft: PoolSpec | None = None  # None (and no draft attached) while the target is set: serve target-only
    # Roles served by services started elsewhere, by their host:port (orchestrator.control.attached): this
    # orchestrator starts no replica of them, and its pool of each is exactly those addresses.
    attached: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # Sent to the attached services on every call (their --internal-token-file); None = send none. Kept out
    # of reprs and logs.
    attached_token: str | None = field(default=None, repr=False)
    check_interval_s: float = 1.0  # health checks and controller ticks
    max_replica_failures: int = MAX_REPLICA_FAILURES  # replicas one request may lose before it fails
    # Longest a request waits for a healthy target replica (within its own deadline): long enough for a
    # restarted replica to load its model, in both backends.
    acquire_timeout_s: float = TARGET_WAIT_S
    draft_acquire_timeout_s: float = 0.0  # no healthy draft: the round goes target-only at once
    restart_policy: RestartPolicy = RestartPolicy()  # local backend: restarts of a dead replica
    start_timeout_s: float = START_TIMEOUT_S
    channel_tls: TLSConfig | None = None  # the orchestrator's channels to replicas; None = plaintext
    # orchestrator.distill.online.OnlineDistillOptions, handed in by the command line; None: the draft changes
    # only by rollouts asked for
    online_distill: DraftTraining | None = None

    def __post_init__(self):
        for role, addresses in self.attached.items():
            if role not in ("draft", "target") or not addresses:
                raise ValueError(f"attached: 'draft' or 'target' and its addresses, not {role!r}: {addresses!r}")
            if getattr(self, role) is not None:
                raise ValueError(f"the {role} role is attached: it has no pool of replicas to start")
        if self.attached and not self.manage:
            raise ValueError("an attached draft needs a target, started here or attached: a joining orchestrator "
                             "finds both roles in Ray")

    @property
    def manage(self) -> bool:
        """Whether this orchestrator defines its pools (starts or attaches the target) rather than joining
        the Ray pools in `namespace`."""
        return self.target is not None or "target" in self.attached
