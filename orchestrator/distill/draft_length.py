"""The k the server would draft with, by the serving policy's own reasoning (orchestrator.decoding.policy).

A lone request's round at k commits E(k) tokens (from the per-position acceptance, estimated the
way the server's AcceptanceMemory estimates it) in k draft steps plus one target step, so its
tokens per second are proportional to

    E(k) / (1 + k r),   r = draft step time / target step time,

and k is the argmax over 1..k_max. The target's verification of k + 1 rows is priced as one row:
decoding is bound by reading the weights, so extra rows cost little (a little, on a CPU: this
leans towards a longer k). r is timed once on the loaded models; training changes no step's cost.
"""

from __future__ import annotations

from orchestrator.decoding.acceptance import DEFAULT_ACCEPTANCE, PRIOR_TOKENS, PositionCounts, expected_tokens
from orchestrator.decoding.request import LoopConfig
from orchestrator.distill.acceptance import AcceptanceStats
from specmesh.loading.precision import one_row_step_s

SERVER_MAX_K = LoopConfig.num_speculative_tokens  # `specmesh serve`'s default most draft tokens a round


def position_rates(stats: AcceptanceStats, positions: int) -> list[float]:
    """Per-position acceptance of replayed rounds, as the server's deployment level learns it."""
    counts = PositionCounts(decay=1.0, positions=positions)
    for drafted, accepted in stats.outcomes:
        counts.observe(drafted, accepted)
    per_token = counts.per_token(DEFAULT_ACCEPTANCE, weight=PRIOR_TOKENS)
    return counts.rates([per_token] * positions)


def relative_speed(rates: list[float], k: int, cost_ratio: float) -> float:
    """Tokens per second of rounds at k over the target alone's (1 token a target step)."""
    return expected_tokens(rates, k) / (1.0 + k * cost_ratio)


def choose_k(rates: list[float], cost_ratio: float, k_max: int) -> int:
    """The k in 1..k_max that commits the most tokens per second (1 where none beats the target alone:
    the report is about the draft, and says so)."""
    return max(range(1, k_max + 1), key=lambda k: relative_speed(rates, k, cost_ratio))


def best_speed(stats: AcceptanceStats, cost_ratio: float, k_max: int) -> float:
    """Relative speed at the best k: the validation score early stopping maximises."""
    rates = position_rates(stats, k_max)
    return relative_speed(rates, choose_k(rates, cost_ratio, k_max), cost_ratio)


def step_cost_ratio(draft, target) -> float:
    """r: a one-row draft step's time over a one-row target step's, both as loaded."""
    return one_row_step_s(draft) / one_row_step_s(target)
