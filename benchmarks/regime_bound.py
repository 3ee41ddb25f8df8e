"""The speedup bound a served run is held against (docs: regime-bound.md), as pure functions.

One request at a time, over target-only decoding with the orchestrator beside the target (1 / t(1)
tokens per second). Times in seconds: `t(rows)` is the target's step for a verification of `rows`
rows, `d` the draft's one-row step, `rtt_draft_s` / `rtt_target_s` the round trips of the
orchestrator's links to each (0 where they share a host). Both bounds maximise over k in 0..k_max and
return (speedup, the k that reaches it; the smallest on ties). k = 0 is target-only through this
placement: a round of t(1) + rtt_target_s, 1x where the target's link adds nothing (the orchestrator
beside the target), less where every token crosses the target's link.
"""

from __future__ import annotations

from typing import Callable

StepTime = Callable[[int], float]  # rows -> seconds


def E(alpha: float, k: int) -> float:  # noqa: N802 (the doc's name)
    """Expected committed tokens of a round that drafts k, each accepted with probability alpha."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def sequential_round_s(k: int, t: StepTime, d: float, rtt_draft_s: float, rtt_target_s: float) -> float:
    """Draft k tokens, then verify them: the two sides one after the other (k = 0: no draft call)."""
    return (k * d + rtt_draft_s if k else 0.0) + t(k + 1) + rtt_target_s


def pipelined_round_s(k: int, t: StepTime, d: float, rtt_draft_s: float, rtt_target_s: float, hit: float) -> float:
    """A hit (the prepared branch is the one verification chose) costs the longer side; a miss, both."""
    if k == 0:
        return sequential_round_s(0, t, d, rtt_draft_s, rtt_target_s)
    round_hit = max(t(k + 1) + rtt_target_s, k * d + rtt_draft_s)
    return hit * round_hit + (1.0 - hit) * sequential_round_s(k, t, d, rtt_draft_s, rtt_target_s)


def best_k(alpha: float, t: StepTime, k_max: int, round_s: Callable[[int], float]) -> tuple[float, int]:
    """max over k in 0..k_max of E(k) * t(1) / round_s(k), and its k."""
    speedups = [(E(alpha, k) * t(1) / round_s(k), k) for k in range(0, k_max + 1)]
    return max(speedups, key=lambda pair: (pair[0], -pair[1]))


def sequential_bound(alpha: float, t: StepTime, d: float, rtt_draft_s: float, rtt_target_s: float,
                     k_max: int = 16) -> tuple[float, int]:
    """S_seq: drafting then verifying, with zero overhead."""
    return best_k(alpha, t, k_max, lambda k: sequential_round_s(k, t, d, rtt_draft_s, rtt_target_s))


def pipelined_bound(alpha: float, t: StepTime, d: float, rtt_draft_s: float, rtt_target_s: float, hit: float,
                    k_max: int = 16) -> tuple[float, int]:
    """S_pipe(hit): the draft drafts round r+1 while the target verifies round r; `hit` is the share of
    rounds whose prepared branch was used, as measured in the same run (1.0: the ceiling)."""
    if not 0.0 <= hit <= 1.0:
        raise ValueError(f"hit must lie in [0, 1], got {hit}")
    return best_k(alpha, t, k_max, lambda k: pipelined_round_s(k, t, d, rtt_draft_s, rtt_target_s, hit))
