"""A round's plan, and the policy interface that gives it: one call plans a round, one learns from it.

Each round a session brings its situation (RoundAsk: the most draft tokens its round may verify, its
context, the tokens it may still make, its draft session's state, the free proposals on offer) and gets
a RoundPlan: the draft-model tokens it verifies (and how many to ask the draft for, with the run
probability it stops below), or the free proposal it verifies in their place, whether to open its draft
session now, the batch the round is priced for, and what a row of the draft's second choices must earn.
After the verification the policy learns from the plan and the outcome (RoundOutcome). Nothing is left
between the two calls but the plan itself.

The three are values: made once and never changed, one plan serving every session in the same situation.
(They are not frozen dataclasses only because those take three times as long to make, every round.)

The adaptive rule is orchestrator.decoding.policy (its plan_batch plans many sessions at once in O(n));
a fixed k is FixedLength, a plan like any other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Awaitable, Callable, Protocol

from orchestrator.decoding.costs import BatchLoad, RoundCosts
from orchestrator.decoding.proposals import FreeProposal
from orchestrator.decoding.request import RoundTiming

# A session's draft session, as its round finds it.
DRAFT_OPEN = "open"  # open: a round may draft
DRAFT_CLOSED = "closed"  # not opened yet: a round that drafts must first pay for its prefill
DRAFT_OPENING = "opening"  # its prefill runs: a round that drafts waits for it
DRAFT_AWAY = "away"  # none, dropped, unreachable for now, or speculation switched off


def no_offers() -> list[FreeProposal]:
    return []


@dataclass(slots=True)
class RoundAsk:
    """What a session brings to its round's plan."""

    k_max: int  # the most draft tokens its round may verify
    context: int = 0  # committed tokens: the cached context its rows attend over
    tokens_left: int = 0  # tokens it may still make (read where its draft session is yet to be opened)
    draft: str = DRAFT_OPEN
    offers: Callable[[], list[FreeProposal]] = no_offers  # looked for only by a policy that weighs them


@dataclass(slots=True)
class RoundPlan:
    k: int = 0  # draft-model tokens the round verifies (0: none; a free proposal, or target-only)
    ask: int = 0  # tokens to ask the draft for: k, or up to k_max where it stops on its own doubt
    stop_below: float = 0.0  # the run probability the draft stops below (0: never)
    free: FreeProposal | None = None  # verified in place of the draft's tokens, cut to the length that pays
    open_draft: bool = False  # open the session's draft now: the rounds it enables pay for its prefill
    batch: BatchLoad = BatchLoad()  # the batch the round is priced for
    row_rate: float | None = None  # tokens per second a row of a draft's second choice must earn; None: none
    confidence: float = 1.0  # how far the draft's probabilities hold as acceptance (DraftConfidence.factor)
    # (draft tokens, alternative rows) -> the round's seconds: priced once for every session this plan serves
    priced: dict = field(default_factory=dict)

    def alternatives(self, costs: RoundCosts, probabilities: list[float],
                     alternative_probabilities: list[float]) -> list[int]:
        """Draft positions whose alternative (the draft's second choice) is worth a row of its own in the
        verification (target_service.alternatives), most promising first.

        The alternative at position j commits one more token when the drafts before j are accepted, the
        one at j is not, and the target's token is the alternative: about the confidence-corrected run
        probability before j times the alternative's probability. It is offered while that chance is at
        least what its row costs the batch at the rate the round earns, each row priced by the target's
        table (a row past a step-size boundary costs what the boundary costs)."""
        if self.row_rate is None or not alternative_probabilities:
            return []
        chances, run = [], 1.0
        for index, (probability, alternative) in enumerate(zip(probabilities, alternative_probabilities)):
            chances.append((min(1.0, run * self.confidence) * alternative, index))
            run *= probability
        drafted = len(probabilities)
        chosen: list[int] = []
        round_s = self._round_s(costs, drafted, 0)
        for chance, index in sorted(chances, reverse=True):
            wider_s = self._round_s(costs, drafted, len(chosen) + 1)  # the round with one row more
            if chance < self.row_rate * (wider_s - round_s):
                break
            chosen.append(index)
            round_s = wider_s
        return chosen

    def _round_s(self, costs: RoundCosts, drafted: int, rows: int) -> float:
        seconds = self.priced.get((drafted, rows))
        if seconds is None:
            seconds = self.priced[drafted, rows] = costs.round_s(drafted, self.batch, rows)
        return seconds


@dataclass(slots=True)
class RoundOutcome:
    """What a round did: its waits, the draft-model tokens verified (with the draft's confidence at each)
    or the plan's free proposal, how many were accepted, and the alternatives' rows beside them."""

    timing: RoundTiming
    drafted: int = 0
    accepted: int = 0
    probabilities: tuple[float, ...] | list[float] = ()
    alternatives: int = 0


class DraftLengthPolicy(Protocol):
    """Plans each round (orchestrator.decoding.policy, or FixedLength) and learns from it."""

    costs: RoundCosts  # what rounds cost: decoding ahead and pre-drafts are sized by it too

    def arrive(self) -> None: ...  # in flight from its prefill on: part of the load the others plan under

    def plan(self, ask: RoundAsk) -> RoundPlan: ...

    def plan_with_batch(self, ask: RoundAsk) -> Awaitable[RoundPlan]: ...  # one call plans the sessions asking together

    def learn(self, plan: RoundPlan, outcome: RoundOutcome) -> None: ...

    def close(self) -> None: ...


class FixedLength:
    """A fixed k: every round drafts the request's k where its draft can serve it (waiting for the draft's
    prefill: a seeded request's output must not depend on the timing), nothing else. Its round costs are
    measured all the same, for decoding ahead and pre-drafts; it plans alone, over its own context."""

    def __init__(self, costs: RoundCosts):
        self.costs = costs

    def arrive(self) -> None:
        pass

    def close(self) -> None:
        pass

    def plan(self, ask: RoundAsk) -> RoundPlan:
        k = 0 if ask.draft == DRAFT_AWAY else max(0, ask.k_max)
        return RoundPlan(k=k, ask=k, open_draft=k > 0 and ask.draft == DRAFT_CLOSED,
                         batch=BatchLoad(1, ask.context))

    async def plan_with_batch(self, ask: RoundAsk) -> RoundPlan:
        return self.plan(ask)  # a fixed k plans alone

    def learn(self, plan: RoundPlan, outcome: RoundOutcome) -> None:
        rows = (len(plan.free.tokens) if plan.free is not None else 0) + outcome.alternatives
        self.costs.observe_round(outcome.timing, outcome.drafted, plan.batch, rows)
