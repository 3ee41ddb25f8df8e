"""How loaded a replica is: the one figure that both routing and autoscaling read.

A replica reports its load in GetModelInfo (polled with every health check):
open and waiting sessions, the token rows queued for its next steps, and the
fraction of its KV budget reserved. With continuous batching a replica serves
many sessions at once, so its load is work, not a session count. The score is in
sessions' worth of work, so that a target load per replica reads like the old
"sessions per replica": an idle replica with 3 open sessions scores 3.

Sessions this orchestrator routed to a replica since its last report are added,
so a burst of new sessions spreads over the pool before the next poll shows them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from specmesh.v1 import common_pb2

# Token rows queued on a replica worth one session: a verification of 7 drafted tokens and the bonus
# row. A long prompt's prefill chunks then weigh as the many decode steps they displace.
ROWS_PER_SESSION = 8.0
# A replica whose KV budget is this full admits no new session without queueing it.
KV_FULL = 0.98


@dataclass(frozen=True)
class Load:
    score: float  # sessions' worth of work, queued and running
    has_room: bool  # a new session would be admitted at once (KV left, nobody waiting)
    kv_cache_usage: float = 0.0  # in [0, 1]; orders replicas of equal score

    def routing_key(self) -> tuple[bool, float, float]:
        """Smaller routes first: a replica with room, then the least work, then the most KV left."""
        return not self.has_room, self.score, self.kv_cache_usage


def replica_load(info: common_pb2.ModelInfo | None, routed_since_report: int) -> Load:
    """The load of a replica that last reported `info` (None: never yet) and got `routed_since_report`
    new sessions from this orchestrator after that report was asked for."""
    if info is None:
        return Load(float(routed_since_report), True)
    usage = _fraction(info.kv_cache_usage)
    score = (info.open_sessions + info.waiting_sessions + info.queued_rows / ROWS_PER_SESSION
             + routed_since_report)
    return Load(score, usage < KV_FULL and info.waiting_sessions == 0, usage)


def _fraction(value: float) -> float:
    """A KV usage as reported, clamped to [0, 1]; a replica reporting nonsense (NaN) counts as full."""
    if not math.isfinite(value):
        return 1.0
    return min(1.0, max(0.0, value))
