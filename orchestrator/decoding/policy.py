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

k moves only for a predicted gain over the current k of at least MARGIN. A round at k = 0
may verify prompt-lookup tokens (orchestrator.decoding.lookup): as many as maximise the
same tokens per second, their rows added to the target step, with lookup's own acceptance.
A draft session is opened only when the tokens its rounds save over the rest of the request
pay for its prefill.

The choice never changes the output: k is fixed before the round's draft is sampled, and
every round's tokens follow the target's distribution whatever k is. Seeded sampling
requests keep a fixed k, so that the same seed gives the same output whatever the load.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from orchestrator.decoding.acceptance import AcceptanceMemory, RequestAcceptance
from orchestrator.decoding.costs import BatchLoad, RoundCosts
from orchestrator.decoding.loop import RoundTiming

MARGIN = 0.03  # predictions carry a few percent of noise: a smaller predicted gain is a tie, keep k
LOOKUP_PRIOR = 0.4  # prompt lookup's per-token acceptance before any history: about what code prompts show


class DraftLength:
    """One request's part in the rule: its acceptance, its context, its current k."""

    def __init__(self, shared: "Speculation", acceptance: RequestAcceptance, lookup: RequestAcceptance):
        self.shared = shared
        self.costs = shared.costs
        self.acceptance = acceptance
        self.lookup = lookup  # prompt lookup's acceptance
        self.k = 0
        self.k_max: int | None = None  # of its latest choice; None before its first
        self.context = 0  # committed tokens: the cached context its rows attend over
        self._batch = BatchLoad()  # the batch this round's k was chosen for

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
            return self.costs.round_s(k, batch) / max(self.shared.tokens(k, batch) / batch.requests, 1e-9)

        return tokens_left * (per_token(0) - per_token(k)) > prefill_s * batch.requests

    def lookup_length(self, available: int) -> int:
        """How many of `available` prompt-lookup tokens this target-only round verifies: the count that
        maximises the batch's tokens per second, or 0 where none beats verifying none by MARGIN."""
        if available <= 0 or not self.costs.known:
            return 0
        batch = self._batch
        others = self.shared.tokens(0, batch) - 1.0

        def goodput(m: int) -> float:
            return (others + self.lookup.expected_tokens(m)) / max(self.costs.round_s(0, batch, m), 1e-9)

        best = max(range(1, available + 1), key=goodput)
        return best if goodput(best) > (1.0 + MARGIN) * goodput(0) else 0

    def observe(self, timing: RoundTiming, drafted: int, accepted: int, looked_up: int = 0) -> None:
        """A round's waits and outcome: `drafted` draft-model tokens, or `looked_up` prompt-lookup
        tokens, `accepted` of them accepted."""
        self.costs.observe(drafted, timing.draft_s, timing.verify_s, self._batch, looked_up)
        self.acceptance.observe(drafted, 0 if looked_up else accepted)
        if looked_up:
            self.lookup.observe(looked_up, accepted)


@dataclass
class Speculation:
    """The orchestrator-wide state the rule reads: costs, acceptance memories, the requests in flight."""

    costs: RoundCosts = field(default_factory=RoundCosts)
    acceptance: AcceptanceMemory = field(default_factory=AcceptanceMemory)
    lookup: AcceptanceMemory = field(default_factory=lambda: AcceptanceMemory(prior=LOOKUP_PRIOR))
    active: dict[int, DraftLength] = field(default_factory=dict)

    def for_request(self, prompt_class: str) -> DraftLength:
        return DraftLength(self, RequestAcceptance(self.acceptance, prompt_class),
                           RequestAcceptance(self.lookup, prompt_class))

    def batch(self) -> BatchLoad:
        requests = list(self.active.values())
        return BatchLoad(requests=max(1, len(requests)), context=sum(p.context for p in requests))

    def tokens(self, k: int, batch: BatchLoad) -> float:
        """Expected committed tokens of a round of the batch, each request drafting k (capped by its
        own k_max once it has chosen: one still prefilling will run the same rule)."""
        return sum(p.acceptance.expected_tokens(k if p.k_max is None else min(k, p.k_max))
                   for p in self.active.values()) or 1.0

    def goodput(self, k: int, batch: BatchLoad) -> float:
        return self.tokens(k, batch) / max(self.costs.round_s(k, batch), 1e-9)

    def best_k(self, batch: BatchLoad) -> int:
        k_max = max((p.k_max or 0 for p in self.active.values()), default=0)
        return max(range(0, k_max + 1), key=lambda k: self.goodput(k, batch))
