"""Where a round's time goes, seen from the orchestrator: draft busy, target busy, wire, idle.

Each call contributes its wall time and the forward time its service reports;
the difference is "wire": transport, (de)serialisation and queueing behind other
sessions' work. Draft work that ran while the target verified (pipelined
pre-drafts) overlaps the target's busy time; "idle" is the rest of the round's
wall time, when neither model computed for this request and no call was in
flight on its critical path (orchestrator overhead, mostly). The parts are
estimates from the orchestrator's clocks and the services' forward times, and

    wall = draft_busy + target_busy - overlap + wire + idle
"""

from __future__ import annotations

from dataclasses import dataclass

PARTS = ("draft_busy", "target_busy", "wire", "idle", "overlap")
HIT, MISS = "hit", "miss"  # a pipelined round's pre-draft: its branch was the one verified, or not


@dataclass(frozen=True)
class RoundBreakdown:
    wall_s: float
    draft_busy_s: float  # draft forward time spent for this round (overlapped part included)
    target_busy_s: float
    wire_s: float  # calls on the round's critical path: wall time minus forward time
    idle_s: float  # neither model busy for this request, no call in flight
    overlap_s: float  # draft and target busy at the same time: what pipelining saves
    predraft: str | None = None  # HIT or MISS in pipelined rounds that had a pre-draft, else None

    def parts(self) -> dict[str, float]:
        return {part: getattr(self, f"{part}_s") for part in PARTS}


class RoundClock:
    """Collects one round's calls; `finish` turns them into a RoundBreakdown."""

    def __init__(self):
        self.draft_busy_s = 0.0
        self.target_busy_s = 0.0
        self.draft_wall_s = 0.0  # the round's waits for its draft tokens (Propose, or a pre-draft)
        self.target_wall_s = 0.0  # its Verify calls
        self.wire_s = 0.0
        self.overlapped_draft_s = 0.0
        self.predraft: str | None = None

    def draft_call(self, wall_s: float, forward_s: float) -> None:
        """A draft call (or a wait for a pre-draft) on the critical path."""
        busy = min(forward_s, wall_s)
        self.draft_busy_s += busy
        self.draft_wall_s += wall_s
        self.wire_s += wall_s - busy

    def target_call(self, wall_s: float, forward_s: float) -> None:
        busy = min(forward_s, wall_s)
        self.target_busy_s += busy
        self.target_wall_s += wall_s
        self.wire_s += wall_s - busy

    def draft_behind(self, forward_s: float) -> None:
        """Draft work done while the target verified (off the critical path)."""
        self.overlapped_draft_s += forward_s

    def finish(self, wall_s: float) -> RoundBreakdown:
        overlap = min(self.overlapped_draft_s, self.target_busy_s)
        draft_busy = self.draft_busy_s + self.overlapped_draft_s
        union = draft_busy + self.target_busy_s - overlap
        idle = max(0.0, wall_s - union - self.wire_s)
        return RoundBreakdown(wall_s, draft_busy, self.target_busy_s, self.wire_s, idle, overlap, self.predraft)
