"""The default draft length: each round, the k that maximises the batch's expected committed tokens per second.

For the n requests decoding on this orchestrator, each drafting k tokens a round:

    k* = argmax over k in 0..k_max of  sum_i E_i(k) / round_s(k)

E_i(k) is request i's expected committed tokens of a round at k, from its per-position
acceptance (orchestrator.decoding.acceptance); round_s(k) is k draft steps over the n
sessions plus one target step over their n (k + 1) rows, priced by the services' own
step-cost models (orchestrator.decoding.costs). Alone this is the request's tokens per
second; under load every extra row is paid beside the other sessions, so k shrinks as the
load grows and is 0 (target-only) wherever no k pays. Every request runs the same rule
over the same state, so the requests of a batch draft the same k and their draft and
verification steps meet in the services' batches.

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

The choice never changes the output: k is fixed before the round's draft is sampled, and
every round's tokens follow the target's distribution whatever k is. Seeded sampling
requests keep a fixed k, so that the same seed gives the same output whatever the load.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from orchestrator.decoding.acceptance import AcceptanceMemory, ConfidenceMemory, DraftConfidence, RequestAcceptance
from orchestrator.decoding.costs import BatchLoad, RoundCosts
from orchestrator.decoding.request import RoundTiming
from orchestrator.decoding.proposals import LOOKUP, FreeProposal

GREEDY, SAMPLED = "greedy", "sampled"  # the regimes learned apart
MARGIN = 0.03  # predictions carry a few percent of noise: a smaller predicted gain is a tie, keep k
LOOKUP_PRIOR = 0.4  # prompt lookup's per-token acceptance before any history: about what code prompts show
SUFFIX_PRIOR = 0.5  # the suffix index's, before any: a few rounds of each match length replace it
SUFFIX_MATCH_BUCKETS = (32, 16, 8, 4)  # matched history lengths learned apart (shorter: one bucket)


def suffix_bucket(match_length: int) -> str:
    return f"match>={next((b for b in SUFFIX_MATCH_BUCKETS if match_length >= b), 0)}"


class DraftLength:
    """One request's part in the rule: its acceptance, its context, its current k."""

    def __init__(self, shared: "Speculation", acceptance: RequestAcceptance, lookup: RequestAcceptance,
                 confidence: DraftConfidence):
        self.shared = shared
        self.costs = shared.costs
        self.acceptance = acceptance
        self.lookup = lookup  # prompt lookup's acceptance
        self.confidence = confidence  # its prompt class's, under its regime's (greedy or sampled)
        self.suffix: dict[str, RequestAcceptance] = {}  # the suffix index's, by matched length
        self.k = 0
        self.k_max: int | None = None  # of its latest choice; None before its first
        self.context = 0  # committed tokens: the cached context its rows attend over
        self._batch = BatchLoad()  # the batch this round's k was chosen for

    @property
    def batch(self) -> BatchLoad:
        """The batch this round's k was chosen for."""
        return self._batch

    def arrive(self) -> None:
        """In flight from its prefill on: the first requests of a burst see each other."""
        self.shared.active[id(self)] = self

    def close(self) -> None:
        self.shared.active.pop(id(self), None)

    def choose(self, k_max: int, context: int = 0) -> int:
        """This round's draft length, 0 for a target-only round."""
        self.arrive()
        self.k_max, self.context = max(0, k_max), context
        self._batch = self.shared.batch()
        if self.k_max == 0:
            return 0
        if not self.costs.known:  # nothing timed yet: draft, so that a round gets measured
            self.k = self.k_max
        else:
            best = self.shared.best_k(self._batch)
            if self.shared.goodput(best, self._batch) > (1.0 + MARGIN) * self.shared.goodput(self.k, self._batch):
                self.k = best
        return min(self.k, self.k_max)

    def draft_plan(self, k: int) -> tuple[int, float]:
        """(tokens to ask the draft for, the run probability it stops below) for a round of k draft
        tokens (module docstring); (k, 0.0), exactly k, before any round was timed or where no token
        past the first ever pays."""
        if k <= 0 or not self.costs.known or self.k_max is None or self.k_max <= 1:
            return k, 0.0
        batch = self._batch
        # A token's cost averaged over the span the draft may run: step-cost tables jump at row counts.
        per_token_s = (self.costs.round_s(self.k_max, batch) - self.costs.round_s(1, batch)) / (self.k_max - 1)
        stop = self.shared.goodput(k, batch) * per_token_s / batch.requests / self.confidence.factor
        if stop >= 1.0:
            return k, 0.0
        return self.k_max, max(0.0, stop)

    def alternatives(self, probabilities: list[float], alternative_probabilities: list[float]) -> list[int]:
        """Draft positions whose alternative (the draft's second choice) is worth a row of its own in the
        verification (target_service.alternatives), most promising first.

        The alternative at position j commits one more token when the drafts before j are accepted, the
        one at j is not, and the target's token is the alternative: about the confidence-corrected run
        probability before j times the alternative's probability. It is offered while that chance is at
        least what its row costs the batch at the rate the round earns, each row priced by the target's
        table (a row past a step-size boundary costs what the boundary costs)."""
        if not alternative_probabilities or not self.costs.known:
            return []
        chances, run = [], 1.0
        for index, (probability, alternative) in enumerate(zip(probabilities, alternative_probabilities)):
            chances.append((min(1.0, run * self.confidence.factor) * alternative, index))
            run *= probability
        batch, drafted = self._batch, len(probabilities)
        goodput = self.shared.goodput(max(self.k, 1), batch)
        chosen: list[int] = []
        for chance, index in sorted(chances, reverse=True):
            rows = len(chosen)
            row_s = self.costs.round_s(drafted, batch, rows + 1) - self.costs.round_s(drafted, batch, rows)
            if chance < goodput * row_s:
                break
            chosen.append(index)
        return chosen

    def wants_draft(self, k_max: int, catch_up: int, tokens_left: int, context: int = 0) -> bool:
        """Whether the first round would draft and pay for the draft's prefill of `catch_up` tokens."""
        k = self.choose(k_max, context)
        return k > 0 and self.worth_opening(k, catch_up, tokens_left)

    def worth_opening(self, k: int, catch_up: int, tokens_left: int) -> bool:
        """Whether rounds at k save, over the `tokens_left` tokens the request may still make, more than
        the draft's prefill of `catch_up` tokens costs. The prefill delays every request decoding beside
        this one (it takes the draft's steps, and on shared cores the target's), so it is paid once per
        request decoding."""
        prefill_s = self.costs.draft_prefill_s(catch_up)
        if k <= 0 or prefill_s is None:
            return k > 0
        batch = self._batch

        def per_token(k: int) -> float:
            return batch.requests / self.shared.goodput(k, batch)

        return tokens_left * (per_token(0) - per_token(k)) > prefill_s * batch.requests

    def choose_proposal(self, k: int, offers: list[FreeProposal]) -> tuple[FreeProposal | None, int]:
        """This round's free proposal and how many of its tokens to verify, or (None, 0) for the draft
        model at k (k = 0: verify nothing): whichever gives the batch the most tokens per second."""
        if not offers or not self.costs.known:
            return None, 0
        batch = self._batch
        drafted = self.shared.tokens(k, batch) / max(self.costs.round_s(k, batch), 1e-9)
        best, best_count, best_goodput = None, 0, (1.0 + MARGIN) * drafted
        for offer in offers:
            acceptance = self._acceptance_of(offer)
            count = self._free_length(acceptance, len(offer.tokens), k)
            goodput = self._free_goodput(acceptance, count, k)
            if count and goodput > best_goodput:
                best, best_count, best_goodput = offer, count, goodput
        return best, best_count

    def _acceptance_of(self, offer: FreeProposal) -> RequestAcceptance:
        if offer.source == LOOKUP:
            return self.lookup
        bucket = suffix_bucket(offer.match_length)
        if bucket not in self.suffix:
            self.suffix[bucket] = RequestAcceptance(self.shared.suffix, bucket)
        return self.suffix[bucket]

    def _free_goodput(self, acceptance: RequestAcceptance, m: int, k: int) -> float:
        """The batch's tokens per second when this request verifies m free tokens in place of drafting k.
        Alone, the round then runs no draft step; beside requests drafting k, they still run theirs."""
        batch = self._batch
        others = self.shared.tokens(k, batch) - self.acceptance.expected_tokens(min(k, self.k_max or 0))
        if k == 0 or batch.requests == 1:
            round_s = self.costs.round_s(0, batch, m)
        else:
            round_s = self.costs.round_s(k, batch, m - k)
        return (others + acceptance.expected_tokens(m)) / max(round_s, 1e-9)

    def _free_length(self, acceptance: RequestAcceptance, available: int, k: int) -> int:
        """The count of `available` free tokens that maximises the batch's tokens per second, or 0 where
        none beats verifying none by MARGIN."""
        if available <= 0 or not self.costs.known:
            return 0
        best = max(range(1, available + 1), key=lambda m: self._free_goodput(acceptance, m, k))
        return best if self._free_goodput(acceptance, best, k) > (1.0 + MARGIN) * self._free_goodput(
            acceptance, 0, k) else 0

    def observe(self, timing: RoundTiming, drafted: int, accepted: int, free: FreeProposal | None = None,
                probabilities: list[float] | None = None, alternatives: int = 0) -> None:
        """A round's waits and outcome: `drafted` draft-model tokens (with the draft's `probabilities`
        of them) and `alternatives` rows beside them, or the `free` proposal's tokens verified (as many
        as it holds), `accepted` of them accepted."""
        offered = len(free.tokens) if free is not None else 0
        if drafted and probabilities:
            self.confidence.observe(probabilities[:drafted], accepted)
        self.costs.observe(drafted, timing.draft_s, timing.verify_s, self._batch, offered + alternatives,
                           timing.draft_forward_s, timing.verify_forward_s, timing.target_steps)
        self.acceptance.observe(drafted, 0 if offered else accepted)
        if offered:
            self._acceptance_of(free).observe(offered, accepted)


@dataclass
class Speculation:
    """The orchestrator-wide state the rule reads: costs, acceptance memories, the requests in flight."""

    costs: RoundCosts = field(default_factory=RoundCosts)
    acceptance: AcceptanceMemory = field(default_factory=AcceptanceMemory)
    lookup: AcceptanceMemory = field(default_factory=lambda: AcceptanceMemory(prior=LOOKUP_PRIOR))
    suffix: AcceptanceMemory = field(default_factory=lambda: AcceptanceMemory(prior=SUFFIX_PRIOR))
    # by regime (the draft's confidence maps to acceptance one way under greedy, another when sampling),
    # and under it by prompt class
    confidence: dict[str, ConfidenceMemory] = field(
        default_factory=lambda: {GREEDY: ConfidenceMemory(), SAMPLED: ConfidenceMemory()})
    active: dict[int, DraftLength] = field(default_factory=dict)

    def for_request(self, prompt_class: str, sampled: bool = False) -> DraftLength:
        """A request's part: its prompt class's acceptance history, kept apart for sampled requests
        (acceptance is the overlap of two distributions there, not agreement on an argmax)."""
        regime = SAMPLED if sampled else GREEDY
        history = f"{prompt_class} ({regime})" if sampled else prompt_class
        return DraftLength(self, RequestAcceptance(self.acceptance, history), RequestAcceptance(self.lookup, history),
                           self.confidence[regime].for_class(prompt_class))

    def batch(self) -> BatchLoad:
        requests = list(self.active.values())
        return BatchLoad(requests=max(1, len(requests)), context=sum(p.context for p in requests))

    def tokens(self, k: int, batch: BatchLoad) -> float:
        """Expected committed tokens of a round of the batch, each request drafting k (capped by its
        own k_max once it has chosen: one still prefilling will run the same rule)."""
        return sum(p.acceptance.expected_tokens(k if p.k_max is None else min(k, p.k_max))
                   for p in self.active.values()) or 1.0

    def goodput(self, k: int, batch: BatchLoad) -> float:
        """The batch's tokens per second drafting k; at k = 0 as target-only rounds run, decoding ahead. (A
        free proposal is weighed against a target-only round of one token (choose_proposal): decoding ahead
        would also put off the proposals that teach the policy their acceptance.)"""
        round_s = self.costs.target_only_s(batch) if k == 0 else self.costs.round_s(k, batch)
        return self.tokens(k, batch) / max(round_s, 1e-9)

    def best_k(self, batch: BatchLoad) -> int:
        k_max = max((p.k_max or 0 for p in self.active.values()), default=0)
        return max(range(0, k_max + 1), key=lambda k: self.goodput(k, batch))
