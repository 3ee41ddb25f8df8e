"""Step costs injected into the speculation policy (orchestrator.decoding.policy) as the services'
reports carry them: tables over SIZES, a CPU's and a GPU's target step."""

from __future__ import annotations

from types import SimpleNamespace

from orchestrator.decoding.costs import RoundCosts
from orchestrator.decoding.plan import RoundAsk, RoundPlan
from orchestrator.decoding.policy import DraftLength, Speculation
from specmesh.engine.step_costs import StepCosts
from specmesh.engine.step_model import StepModel

SIZES = tuple(range(1, 9)) + (12, 16, 24, 32, 48, 64)


def table(cost_of_rows, model: StepModel | None = None) -> StepCosts:
    return StepCosts({rows: cost_of_rows(rows) for rows in SIZES}, model)


def cpu_target(rows: int) -> float:
    """A CPU's fp32 step: 1-3 rows one weight pass, 4-8 rows about 1.6, then compute-bound."""
    return 0.25 if rows <= 3 else 0.40 if rows <= 8 else 0.40 * rows / 8


def gpu_target(rows: int) -> float:
    """A GPU's memory-bound step: flat up to large batches."""
    return 0.012 + 0.00005 * rows


def speculation(target_costs, draft_costs, target_model: StepModel | None = None) -> Speculation:
    reports = SimpleNamespace(target=table(target_costs, target_model), draft=table(draft_costs))
    return Speculation(costs=RoundCosts(reports))


def plan(policy: DraftLength, k_max: int, context: int = 0, **ask) -> RoundPlan:
    """The policy's plan for a round of at most k_max draft tokens over `context` (RoundAsk's other fields)."""
    return policy.plan(RoundAsk(k_max, context, **ask))
