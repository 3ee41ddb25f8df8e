"""The default draft length: each round, the k that maximises the batch's expected committed tokens per second.

For the n requests decoding on this orchestrator, each drafting k tokens a round:

    k* = argmax over k in 0..k_max of  sum_i E_i(k) / round_s(k)

E_i(k) is request i's expected committed tokens of a round at k, from its per-position
acceptance (orchestrator.decoding.acceptance); round_s(k) is k draft steps over the n
sessions and one target step over their n (k + 1) rows, priced by the services' own
step-cost models (orchestrator.decoding.costs): one after the other, or, pipelined, the
draft's beside the previous verification at the pre-draft hit rate. Alone this is the
request's tokens per second; under load every extra row is paid beside the other sessions,
so k shrinks as the load grows and is 0 (target-only) wherever no k pays. Every request
runs the same rule over the same state, so the requests of a batch draft the same k and
their draft and verification steps meet in the services' batches.

k moves only for a predicted gain over the current k of at least MARGIN. A drafting round then
asks the draft for up to the request's k_max tokens and lets it stop on its own doubt: after
token i it drafts on only while its run probability r_i (the product of its probabilities of
tokens 1..i, corrected by how well such estimates have matched acceptance) is at least

    stop_below = goodput(k) * (round_s(k_max) - round_s(1)) / (k_max - 1) / n

the next token's expected tokens against what one more token per request costs the batch of n
(averaged over the span, as step costs jump at row counts) at the rate the round earns.
Confident runs go past k; doubtful ones end before it. Where stop_below reaches 1 no token
past the first pays, and the round drafts k as before. Then the round's
proposer: the draft model at k, or tokens proposed at no model cost (orchestrator.decoding.
proposals: prompt lookup, the suffix index of earlier requests), as many as maximise the
same tokens per second with that proposer's own acceptance, their rows in the target step
in place of the request's k + 1; a free proposal must beat the draft's round by MARGIN.
The suffix index's acceptance is learned by how long the matched history was, since an
exact repeat of tens of tokens and a three-token coincidence are different evidence.
A draft session is opened only when the tokens its rounds save over the rest of the request
pay for its prefill. Under greedy the verification may also carry the draft's second choice at
some positions as rows of their own (alternatives), each where its chance of committing one more
token is worth its row at the same rate.

Each round is one plan (orchestrator.decoding.plan) for each request: Speculation.plan_batch
plans any number of the batch's sessions over one state of it in O(n): the sums over the
requests in flight are kept as they change (orchestrator.decoding.batch_rule), the rates at
each k worked out once per call, and sessions in the same situation share one plan. A
request's own plan is a batch of one; it learns from the outcome (DraftLength.learn).

The choice never changes the output: k is fixed before the round's draft is sampled, and
every round's tokens follow the target's distribution whatever k is. Seeded sampling
requests keep a fixed k, so that the same seed gives the same output whatever the load.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from typing import Awaitable, Sequence

from orchestrator.decoding.acceptance import (AcceptanceMemory, ConfidenceMemory, DraftConfidence, RequestAcceptance,
                                              expected_by_length)
from orchestrator.decoding.batch_rule import LENGTHS, BatchRule, BatchSums
from orchestrator.decoding.costs import RoundCosts
from orchestrator.decoding.plan import (DRAFT_AWAY, DRAFT_CLOSED, DRAFT_OPEN, DRAFT_OPENING, RoundAsk, RoundOutcome,
                                        RoundPlan)
from orchestrator.decoding.proposals import LOOKUP, FreeProposal
from specmesh.gathering import Gathered

GREEDY, SAMPLED = "greedy", "sampled"  # the regimes learned apart
MARGIN = 0.03  # predictions carry a few percent of noise: a smaller predicted gain is a tie, keep k
LOOKUP_PRIOR = 0.4  # prompt lookup's per-token acceptance before any history: about what code prompts show
SUFFIX_PRIOR = 0.5  # the suffix index's, before any: a few rounds of each match length replace it
SUFFIX_MATCH_BUCKETS = (32, 16, 8, 4)  # matched history lengths learned apart (shorter: one bucket)


def suffix_bucket(match_length: int) -> str:
    return f"match>={next((b for b in SUFFIX_MATCH_BUCKETS if match_length >= b), 0)}"


class DraftLength:
    """One request's part in the rule: its acceptance, its context, its current k. It plans its rounds as a
    batch of one (Speculation.plan_batch) and learns from each."""

    def __init__(self, shared: "Speculation", acceptance: RequestAcceptance, lookup: RequestAcceptance,
                 confidence: DraftConfidence):
        self.shared = shared
        self.costs = shared.costs
        self.acceptance = acceptance
        self.lookup = lookup  # prompt lookup's acceptance
        self.confidence = confidence  # its prompt class's, under its regime's (greedy or sampled)
        self.suffix: dict[str, RequestAcceptance] = {}  # the suffix index's, by matched length
        self.k = 0
        self.k_max: int | None = None  # of its latest plan; None before its first
        self.context = 0  # committed tokens: the cached context its rows attend over
        self.probing = False  # a probe opened its draft: its first round with the draft open drafts

    def arrive(self) -> None:
        """In flight from its prefill on: the first requests of a burst see each other."""
        self.shared.join(self)

    def close(self) -> None:
        self.shared.leave(self)

    def plan(self, ask: RoundAsk) -> RoundPlan:
        return self.shared.plan_batch([self], [ask])[0]

    def plan_with_batch(self, ask: RoundAsk) -> Awaitable[RoundPlan]:
        """This round's plan, made by one plan_batch call with the other sessions that ask in the same turns of
        the event loop (those one verification released: Speculation.gathered)."""
        return self.shared.gathered(self, ask)

    def learn(self, plan: RoundPlan, outcome: RoundOutcome) -> None:
        """A round's waits and outcome: `drafted` draft-model tokens (with the draft's `probabilities` of
        them) and `alternatives` rows beside them, or the plan's free proposal verified (as many as it
        holds), `accepted` of them accepted."""
        free, drafted, accepted = plan.free, outcome.drafted, outcome.accepted
        offered = len(free.tokens) if free is not None else 0
        if drafted and outcome.probabilities:
            self.confidence.observe(list(outcome.probabilities[:drafted]), accepted)
        self.costs.observe_round(outcome.timing, drafted, plan.batch, offered + outcome.alternatives)
        self.acceptance.observe(drafted, 0 if offered else accepted, plan.batch.requests)
        if offered:
            self._acceptance_of(free).observe(offered, accepted)
        self.shared.refresh(self)  # its share is worked out anew where the batch's rule is next read

    def share(self) -> list[float]:
        """Its expected committed tokens at every draft length, capped by its k_max (uncapped before its first
        plan: one still prefilling will run the same rule)."""
        return expected_by_length(self.acceptance.rates(), LENGTHS - 1 if self.k_max is None else self.k_max, LENGTHS)

    def plan_round(self, rule: BatchRule, ask: RoundAsk) -> RoundPlan:
        """This round's plan over the batch's state `rule` (its k_max and context already in it). Sessions in
        the same situation (their k, k_max, draft session and confidence; nothing on offer, no draft to open)
        get the same plan: it is worked out once per batch state."""
        offers = ask.offers()
        k = self._rule_k(rule)
        probe = self._probe_k(rule, ask, k)
        if probe or offers or ask.draft == DRAFT_CLOSED:
            return self._plan_round(rule, ask, offers, k or probe, probing=bool(probe))
        situation = (self.k, self.k_max, ask.draft, self.confidence)
        planned = rule.plans.get(situation)
        if planned is None:
            planned = rule.plans[situation] = (self._plan_round(rule, ask, offers, k), self.k)
        plan, self.k = planned
        return plan

    def _plan_round(self, rule: BatchRule, ask: RoundAsk, offers: list[FreeProposal], k: int,
                    probing: bool = False) -> RoundPlan:
        """The plan of a round the rule (or a probe: `probing`) gives k draft tokens, as the session's draft
        and the free proposals on offer allow."""
        open_draft = False
        if ask.draft == DRAFT_AWAY:
            k = 0
        elif k and ask.draft == DRAFT_CLOSED:  # its first round that wants draft tokens
            open_draft = probing or self._worth_opening(rule, k, ask.context, ask.tokens_left)
            k = 0  # never wait for the draft's prefill
        elif ask.draft == DRAFT_OPENING:
            k = 0
        free = self._free_proposal(rule, k, offers)
        k = 0 if free is not None else k
        factor = self.confidence.factor
        asked, stop_below = self._draft_request(rule, k, factor)
        row_rate = rule.goodput(max(self.k, 1)) if rule.known else None
        return RoundPlan(k, asked, stop_below, free, open_draft, rule.batch, row_rate, factor)

    def _rule_k(self, rule: BatchRule) -> int:
        """The rule's k for this round, 0 for a target-only round; it moves only for a gain of MARGIN."""
        if self.k_max == 0:
            return 0
        if not rule.known:  # nothing timed yet: draft, so that a round gets measured
            self.k = self.k_max
        else:
            best = rule.best_k()
            if rule.goodput(best) > (1.0 + MARGIN) * rule.goodput(self.k):
                self.k = best
        return min(self.k, self.k_max)

    def _probe_k(self, rule: BatchRule, ask: RoundAsk, rule_k: int) -> int:
        """A drafting round's k where this session probes (RoundCosts.claim_probe: the rule's k, `rule_k`, is 0
        and a probe is due), else 0: the length the latest drafting round had, so that the probe measures what
        drafting was. A session whose draft is closed opens it with the probe and drafts once it is open."""
        if not rule.known or not self.k_max or ask.draft in (DRAFT_AWAY, DRAFT_OPENING):
            return 0
        k = min(self.k_max, self.costs.last_drafted or self.k_max)
        if self.probing:  # its probe opened its draft
            self.probing = ask.draft != DRAFT_OPEN
            return 0 if self.probing else k
        if rule_k or not self.costs.claim_probe(rule.round_s(k)):
            return 0
        self.probing = ask.draft == DRAFT_CLOSED
        return k

    def _draft_request(self, rule: BatchRule, k: int, factor: float) -> tuple[int, float]:
        """(tokens to ask the draft for, the run probability it stops below) for a round of k draft tokens
        (module docstring); (k, 0.0), exactly k, before any round was timed or where no token past the first
        ever pays."""
        if k <= 0 or not rule.known or self.k_max <= 1:
            return k, 0.0
        stop = rule.goodput(k) * rule.per_token_s(self.k_max) / rule.batch.requests / factor
        if stop >= 1.0:
            return k, 0.0
        return self.k_max, max(0.0, stop)

    def _worth_opening(self, rule: BatchRule, k: int, catch_up: int, tokens_left: int) -> bool:
        """Whether rounds at k save, over the `tokens_left` tokens the request may still make, more than
        the draft's prefill of `catch_up` tokens costs. The prefill delays every request decoding beside
        this one (it takes the draft's steps, and on shared cores the target's), so it is paid once per
        request decoding."""
        prefill_s = self.costs.draft_prefill_s(catch_up)
        if k <= 0 or prefill_s is None:
            return k > 0
        requests = rule.batch.requests
        saved_s = requests / rule.goodput(0) - requests / rule.goodput(k)  # per token
        return tokens_left * saved_s > prefill_s * requests

    def _free_proposal(self, rule: BatchRule, k: int, offers: list[FreeProposal]) -> FreeProposal | None:
        """This round's free proposal, cut to the count of its tokens to verify, or None for the draft model
        at k (k = 0: verify nothing): whichever gives the batch the most tokens per second."""
        if not offers or not rule.known:
            return None
        own = self.acceptance.expected_tokens(min(k, self.k_max))
        drafted = rule.tokens(k) / max(rule.round_s(k), 1e-9)
        best, best_count, best_goodput = None, 0, (1.0 + MARGIN) * drafted
        for offer in offers:
            available = len(offer.tokens)
            # [E(m) for m in 0..available]: the offer's expected tokens at every length, in one pass
            expected = expected_by_length(self._acceptance_of(offer).rates(), available, available + 1)
            count = self._free_length(rule, expected, own, k)
            goodput = self._free_goodput(rule, expected[count], own, count, k)
            if count and goodput > best_goodput:
                best, best_count, best_goodput = offer, count, goodput
        return best.first(best_count) if best is not None else None

    def _acceptance_of(self, offer: FreeProposal) -> RequestAcceptance:
        if offer.source == LOOKUP:
            return self.lookup
        bucket = suffix_bucket(offer.match_length)
        if bucket not in self.suffix:
            self.suffix[bucket] = RequestAcceptance(self.shared.suffix, bucket)
        return self.suffix[bucket]

    def _free_goodput(self, rule: BatchRule, expected: float, own: float, m: int, k: int) -> float:
        """The batch's tokens per second when this request (its `own` expected tokens at k) verifies m free
        tokens (`expected` tokens committed) in place of drafting k. Alone, the round then runs no draft step;
        beside requests drafting k, they still run theirs."""
        if k == 0 or rule.batch.requests == 1:
            round_s = rule.round_s(0, m)
        else:
            round_s = rule.round_s(k, m - k)
        return (rule.tokens(k) - own + expected) / max(round_s, 1e-9)

    def _free_length(self, rule: BatchRule, expected: list[float], own: float, k: int) -> int:
        """The count of free tokens (`expected`: the tokens committed at each count, 0 up to all on offer)
        that maximises the batch's tokens per second, or 0 where none beats verifying none by MARGIN."""
        available = len(expected) - 1
        if available <= 0:
            return 0

        def goodput(m: int) -> float:
            return self._free_goodput(rule, expected[m], own, m, k)
        best = max(range(1, available + 1), key=goodput)
        return best if goodput(best) > (1.0 + MARGIN) * goodput(0) else 0


@dataclass
class Speculation:
    """The orchestrator-wide state the rule reads: costs, acceptance memories, the requests in flight and
    their sums (orchestrator.decoding.batch_rule)."""

    costs: RoundCosts = field(default_factory=RoundCosts)
    acceptance: AcceptanceMemory = field(default_factory=AcceptanceMemory)
    lookup: AcceptanceMemory = field(default_factory=lambda: AcceptanceMemory(prior=LOOKUP_PRIOR))
    suffix: AcceptanceMemory = field(default_factory=lambda: AcceptanceMemory(prior=SUFFIX_PRIOR))
    # by regime (the draft's confidence maps to acceptance one way under greedy, another when sampling),
    # and under it by prompt class
    confidence: dict[str, ConfidenceMemory] = field(
        default_factory=lambda: {GREEDY: ConfidenceMemory(), SAMPLED: ConfidenceMemory()})
    sums: BatchSums = field(default_factory=BatchSums)
    _refreshed: dict = field(default_factory=dict)  # parts that learned since the rule was last read (ordered)

    def __post_init__(self) -> None:
        self._asking: Gathered[tuple[DraftLength, RoundAsk]] = Gathered(self._plan_asking)

    def for_request(self, prompt_class: str, sampled: bool = False) -> DraftLength:
        """A request's part: its prompt class's acceptance history, kept apart for sampled requests
        (acceptance is the overlap of two distributions there, not agreement on an argmax)."""
        regime = SAMPLED if sampled else GREEDY
        history = f"{prompt_class} ({regime})" if sampled else prompt_class
        return DraftLength(self, RequestAcceptance(self.acceptance, history), RequestAcceptance(self.lookup, history),
                           self.confidence[regime].for_class(prompt_class))

    def plan_batch(self, parts: Sequence[DraftLength], asks: Sequence[RoundAsk]) -> list[RoundPlan]:
        """The rounds' plans of the sessions `parts`, each with its RoundAsk, over one state of the batch:
        their k_max and context go into the batch's sums, then the rule's rates are worked out once and
        read by each: O(n) in the sessions (O(k) each where their k_max changed)."""
        for part, ask in zip(parts, asks):
            self._take(part, ask)
        rule = self.rule()
        return [part.plan_round(rule, ask) for part, ask in zip(parts, asks)]

    def gathered(self, part: DraftLength, ask: RoundAsk) -> asyncio.Future:
        """`part`'s plan, from the plan_batch call that plans every session asking before the loop goes quiet."""
        return self._asking.ask((part, ask))

    def _plan_asking(self, asking: list[tuple[DraftLength, RoundAsk]], futures: list[asyncio.Future]) -> None:
        try:
            plans = self.plan_batch([part for part, _ in asking], [ask for _, ask in asking])
        except Exception as error:  # noqa: BLE001 - every asker gets it, as its own plan() call would raise it
            for future in futures:
                future.set_exception(error)
            return
        for future, plan in zip(futures, plans):
            future.set_result(plan)

    def rule(self) -> BatchRule:
        """The rule over the batch as it stands."""
        self._place_refreshed()
        return BatchRule(self.costs, self.sums)

    def join(self, part: DraftLength) -> None:
        if part not in self.sums:
            self.sums.place(part, part.share(), part.context, part.k_max or 0)

    def leave(self, part: DraftLength) -> None:
        self._refreshed.pop(part, None)
        self.sums.discard(part)

    def refresh(self, part: DraftLength) -> None:
        """Its acceptance changed: so did its share of the batch's tokens. Placed anew when the rule is next
        read, after every session a verification released has learned (its class's rates are then worked out
        once for all of them, not once after each)."""
        self._refreshed[part] = None

    def _place_refreshed(self) -> None:
        refreshed, self._refreshed = self._refreshed, {}
        for part in refreshed:
            if part in self.sums:
                self.sums.place(part, part.share(), part.context, part.k_max or 0)

    def _take(self, part: DraftLength, ask: RoundAsk) -> None:
        """A session's k_max and context for this round, into the batch's sums (it joins if it had not)."""
        k_max = max(0, ask.k_max)
        if k_max == part.k_max and self.sums.move(part, ask.context):
            part.context = ask.context
            return
        part.k_max, part.context = k_max, ask.context  # its share capped anew
        self.sums.place(part, part.share(), part.context, k_max)
