"""Live acceptance before and after a rollout on the same prompts (online_distill_shift.py --paired).

Acceptance before and after a rollout over different requests moves with how hard those requests
are for any draft, by several per cent between windows of a few dozen prompts. The paired figure
removes that: the prompts served while the rolled-out cycle trained (by the old draft, too late to
be in the cycle's evidence) are sent again after the rollout, and the two servings of each prompt
compare. Both are live requests through the serving path.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Served:
    """One finished request: its prompt (index into the order), when it ran, what the draft did."""

    index: int
    started_s: float  # seconds since the run started
    finished_s: float
    drafted: int
    accepted: int
    replay_of: int | None = None  # a second serving after a rollout: the first one's position in the list


def to_replay(served: list[Served], cycle_started_s: float, old_draft_until_s: float) -> list[int]:
    """Positions in `served` of the requests that ran from start to finish while the cycle ran and the
    old draft still served, in order."""
    return [position for position, s in enumerate(served) if s.replay_of is None
            and s.started_s >= cycle_started_s and s.finished_s <= old_draft_until_s]


def paired(served: list[Served]) -> dict | None:
    """Acceptance of the replayed prompts' first servings against their replays (pairs both finished)."""
    pairs = [(served[s.replay_of], s) for s in served if s.replay_of is not None]
    drafted_before = sum(first.drafted for first, _ in pairs)
    drafted_after = sum(again.drafted for _, again in pairs)
    if not pairs or not drafted_before or not drafted_after:
        return None
    before = sum(first.accepted for first, _ in pairs) / drafted_before
    after = sum(again.accepted for _, again in pairs) / drafted_after
    return {"prompts": len(pairs), "acceptance_before": before, "acceptance_after": after,
            "relative_change": after / before - 1 if before else None}


def paired_line(result: dict | None) -> str:
    if result is None:
        return "paired acceptance: - (no prompt served during a rolled-out cycle was re-sent after it)"
    change = "" if result["relative_change"] is None else f" ({result['relative_change']:+.1%})"
    return (f"paired acceptance on {result['prompts']} prompts served during the cycle and again after its "
            f"rollout: {result['acceptance_before']:.3f} -> {result['acceptance_after']:.3f}{change}")
