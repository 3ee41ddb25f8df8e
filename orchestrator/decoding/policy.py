"""The default draft length: per round, the k that maximises goodput, for the request and its batch.

Goodput is expected committed tokens per predicted second. For a request whose
round drafts k tokens beside the other requests of this orchestrator (each at
the k it chose last):

    goodput(k) = (E(k) + sum of the others' E) / (seconds of one round of the batch)

where the round's seconds are the drafting requests' draft steps plus a target step for
the requests that draft and one for those that do not (orchestrator.decoding.costs).

E comes from per-position acceptance (orchestrator.decoding.acceptance: the
request's own rounds over its prompt class's and the deployment's) and the
seconds from the services' measured step costs (orchestrator.decoding.costs).
Alone, that is the request's own tokens per second. In a batch the others' rows
make every verification dearer and the others' tokens dilute what this request's
draft adds, so k shrinks as load grows, and where extra rows cost more than their
accepted tokens bring, k = 0 (target-only) wins by itself; when load falls it
comes back.

Beyond one request the tables no longer price a round well, so whether rounds draft at
all is learned per load from the tokens per second rounds delivered with and without
drafting (orchestrator.decoding.regime); under target-only no round drafts or probes.

Hysteresis keeps k from flapping: it changes only for a predicted gain of
`margin` after `dwell_rounds` rounds at the current k, or at once for a gain of
`urgent_gain` (a guess that proved wrong). At k = 0 nothing is learned about the
draft, so now and then a cheap probe round drafts `probe_k` tokens, less often
while probes keep failing, and not at all while the load alone rules drafting out.

A round that drafts nothing (k = 0, whatever the reason) may still verify prompt lookup's
tokens (orchestrator.decoding.lookup): as many as maximise the same goodput, their rows
added to the target step and no draft step, with lookup's own acceptance (learned apart
from the draft's, per class and request). Where extra rows are nearly free (on a CPU,
4-8 rows cost what 1 does) they ride along; where they cost, lookup stays out.

The choice never changes the output: each round's tokens follow the target's
distribution whatever k is, as long as k is fixed before the round's draft is
sampled. Seeded sampling requests keep a fixed k, because a timing-driven k would
make the same seed give different (equally valid) outputs from run to run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from orchestrator.decoding.alignment import RoundAlignment
from orchestrator.decoding.acceptance import AcceptanceMemory, RequestAcceptance, expected_tokens
from orchestrator.decoding.costs import BatchLoad, RoundCosts
from orchestrator.decoding.loop import RoundTiming
from orchestrator.decoding.regime import LoadRegimes, RegimeChoice


# Prompt lookup's per-token acceptance before any history: on the bench's 16 prompts (32-token greedy
# outputs of the embedded 1.5B target) a match's first token was accepted 38 % of the time, the later
# ones 45-80 % (README, "Prompt lookup").
LOOKUP_PRIOR = 0.4
DEFAULT_ALIGN_WAIT_S = 0.5  # the most a round waits for the others' before any round was priced


@dataclass(frozen=True)
class PolicyConfig:
    margin: float = 0.05  # change k only for a predicted gain of at least 5% ...
    dwell_rounds: int = 2  # ... and only after this many rounds at the current k,
    urgent_gain: float = 0.3  # unless the gain is at least 30% (a guess that proved wrong)
    probe_every: int = 8  # at k = 0, one probe round after this many rounds ...
    max_probe_every: int = 64  # ... the interval doubling, up to this, while probes keep failing
    probe_k: int = 2  # a probe's draft tokens: enough to see acceptance, cheap when it fails
    # A probe runs only where a draft accepting this share of its tokens would pay under the current
    # load: where even a good draft loses to the batch's cost, a probe has nothing to find.
    probe_if_acceptance: float = 0.9
    # Prompt-lookup tokens are verified for a predicted gain of at least 2 %: no hysteresis (a lookup
    # costs nothing to start or stop), only a guard against the tables' error on a row or two.
    lookup_margin: float = 0.02


class AdaptiveDraftLength:
    """One request's choice of k, with hysteresis; k = 0 is a target-only round."""

    def __init__(self, shared: "AdaptiveSpeculation", acceptance: RequestAcceptance, lookup: RequestAcceptance):
        self.shared = shared
        self.costs = shared.costs
        self.acceptance = acceptance
        self.lookup = lookup  # prompt lookup's acceptance (orchestrator.decoding.lookup)
        # This round's prompt-lookup tokens (target-only rounds) and the tokens it expects of them,
        # which the others price it at.
        self.lookup_rows = 0
        self.lookup_expected = 1.0
        self.config = shared.config
        self.k: int | None = None
        # Its round does not draft whatever k says: its draft is lost, paused or not worth opening
        # (skip_drafting). Until its next choice the others price it at k = 0.
        self.held_back = False
        self.rounds_at_k = 0
        self.probe_every = self.config.probe_every
        self.rounds_since_probe = 0
        self.probing = False
        self._batch = BatchLoad()  # the others, as they stood when this round's k was chosen
        self._regime: RegimeChoice | None = None  # what this round was planned under ...
        self._previous_regime: RegimeChoice | None = None  # ... and the round before it
        self._chosen_at = 0.0
        self._last_round_s = 0.0  # wall clock of this request's last round, from its choice of k
        self._k_max = 0  # of its latest choice

    def goodput(self, k: int, batch: BatchLoad = BatchLoad()) -> float:
        """Expected committed tokens per second of this request and the others beside it, at draft length k."""
        seconds = self.costs.round_s(k, batch)
        return batch.tokens_with(self.acceptance.expected_tokens(k)) / max(seconds, 1e-9)

    def best(self, k_max: int, batch: BatchLoad = BatchLoad()) -> int:
        return max(range(0, k_max + 1), key=lambda k: self.goodput(k, batch))

    def drafting_gain(self, requests: int) -> float | None:
        """The tables' forecast (orchestrator.decoding.regime.Forecast): tokens per second of `requests`
        requests like this one drafting in phase at their best k, over the same requests target-only."""
        if not self.costs.known or self._k_max <= 0:
            return None
        batch = BatchLoad(undecided=max(0, requests - 1))  # the others priced at this request's k
        drafting = max(self.goodput(k, batch) for k in range(1, self._k_max + 1))
        return drafting / max(self.goodput(0, batch), 1e-9)

    def arrive(self) -> None:
        """The request is in flight: it counts towards the load from its prefill on, so that the
        first requests of a burst do not each open a draft as if alone."""
        self.shared.join(self)

    def wants_draft(self, k_max: int, catch_up: int, tokens_left: int) -> bool:
        """Whether the first round would draft, and pay for the draft's prefill of `catch_up` tokens
        (worth_opening): if not, the draft's session can wait until it does."""
        if k_max <= 0 or not self.shared.regimes.choice(self.shared.decoding(self)).drafting:
            return False
        if not self.costs.known:
            return True
        batch = self.shared.batch_load(self)
        k = self.best(k_max, batch)
        return k > 0 and self._pays_for_prefill(k, catch_up, tokens_left, batch)

    def worth_opening(self, k: int, catch_up: int, tokens_left: int) -> bool:
        """Whether opening the draft's session now pays for its prefill of `catch_up` tokens: rounds
        at k must save more than that over the `tokens_left` the request may still make. Late in a
        request (the load fell and drafting came back) a prefill of its whole sequence would cost
        more than its last few tokens can win back."""
        return self._pays_for_prefill(k, catch_up, tokens_left, self._batch)

    def _pays_for_prefill(self, k: int, catch_up: int, tokens_left: int, batch: BatchLoad) -> bool:
        """The prefill delays every request decoding beside this one, not only this one: with draft
        and target on the same cores it slows the target's steps, and a draft on its own hardware
        feeds it in the steps every drafting request waits on. So the savings must pay for it once
        per request decoding. Priced for this request alone, a drafting trial at concurrency 8 on
        the embedded pair opened eight drafts for 32-token requests: every round took 1-1.8 s
        instead of 0.3 while they prefilled, for 1-5 draft tokens each."""
        prefill_s = self.costs.draft_prefill_s(catch_up)
        if k <= 0 or prefill_s is None:
            return k > 0
        per_token = lambda k: self.costs.round_s(k, batch) / self.acceptance.expected_tokens(k)  # noqa: E731
        return tokens_left * (per_token(0) - per_token(k)) > prefill_s * self.shared.decoding(self)

    def choose(self, k_max: int) -> int:
        self.held_back = False
        self.lookup_rows, self.lookup_expected = 0, 1.0
        k = self._choose(k_max)
        if k == 0:  # nobody should wait for this request's next drafting round
            self.shared.alignment.leave(id(self))
        return k

    def lookup_length(self, available: int) -> int:
        """How many of the `available` prompt-lookup tokens this target-only round verifies: the count
        that maximises the batch's goodput, their rows riding the target step (no draft step), if it
        beats verifying none by `lookup_margin`; else 0. Chosen afresh every round."""
        if available <= 0 or not self.costs.known:
            return 0
        batch = self._batch

        def goodput(m: int) -> float:
            return batch.tokens_with(self.lookup.expected_tokens(m)) / max(self.costs.round_s(0, batch, m), 1e-9)

        best = max(range(1, available + 1), key=goodput)
        if goodput(best) <= goodput(0) * (1.0 + self.config.lookup_margin):
            return 0
        self.lookup_rows, self.lookup_expected = best, self.lookup.expected_tokens(best)
        return best

    def skip_drafting(self, draft_opening: bool = False) -> None:
        """This request's next round does not draft, whatever its k: the others drafting beside it
        go without it rather than wait a round for it. Held back by its draft (lost, paused, or not
        worth opening), it is priced as a request that does not draft; while its draft's session is
        opening (a round or so) it is priced at its k still: held back then, every request of a
        burst saw the others not drafting, priced its own draft as a target step of its own, and
        none drafted again."""
        self.held_back = not draft_opening
        self.shared.alignment.leave(id(self))

    def _choose(self, k_max: int) -> int:
        self._regime = None
        if k_max <= 0:
            return 0
        self._k_max = k_max
        self.shared.join(self)
        self._regime = self.shared.regimes.choice(self.shared.decoding(self))
        self._batch = self.shared.batch_load(self, self._regime.drafting)
        self._chosen_at = time.monotonic()
        if not self._regime.drafting:
            return 0
        if self.k is None:  # the first round: what costs and acceptance history predict, or the most
            self.k = self.best(k_max, self._batch) if self.costs.known else k_max
        elif self.k == 0 and (self.probing or (self.rounds_since_probe >= self.probe_every
                                               and self._a_good_draft_would_pay(k_max))):
            return self._probe(k_max)
        elif self.costs.known:  # else no draft round has been timed yet (the draft was away): keep k
            self._maybe_switch(self.best(k_max, self._batch), k_max)
        return min(self.k, k_max)

    async def align(self, k: int) -> int:
        """Wait for the requests that drafted beside this one to draft again, together (at most
        about one round); the k all of them draft (orchestrator.decoding.alignment)."""
        wait_s = self.costs.round_s(k, self._batch) if self.costs.known else DEFAULT_ALIGN_WAIT_S
        # Out of phase, the others come back up to a whole round of this request's apart: a wait of
        # a predicted (in-phase) round would time out before they came, every round, on each side.
        return await self.shared.alignment.align(id(self), k, max(wait_s, self._last_round_s))

    def _a_good_draft_would_pay(self, k_max: int) -> bool:
        good = [self.config.probe_if_acceptance] * k_max
        seconds = lambda k: self.costs.round_s(k, self._batch)  # noqa: E731
        return any(self._batch.tokens_with(expected_tokens(good, k)) / seconds(k)
                   > self._batch.tokens_with(1.0) / seconds(0) for k in range(1, k_max + 1))

    def _probe(self, k_max: int) -> int:
        """Nothing is learned at k = 0: look again now and then, cheaply."""
        if not self.probing:
            self.rounds_since_probe = 0
            self.probe_every = min(2 * self.probe_every, self.config.max_probe_every)
            self.probing = True  # until a round really drafts (the draft may still be opening)
        return min(self.config.probe_k, k_max)

    def _maybe_switch(self, candidate: int, k_max: int) -> None:
        current = min(self.k, k_max)
        gain = self.goodput(candidate, self._batch) / self.goodput(current, self._batch) - 1.0
        settled = self.rounds_at_k >= self.config.dwell_rounds
        if candidate != current and gain > (self.config.margin if settled else self.config.urgent_gain):
            if self.k == 0:
                self.probe_every = self.config.probe_every
            self.k, self.rounds_at_k, self.rounds_since_probe = candidate, 0, 0

    def observe(self, timing: RoundTiming, drafted: int, accepted: int, looked_up: int = 0) -> None:
        """A round's times and outcome: `drafted` draft-model tokens, or `looked_up` prompt-lookup
        tokens, of which `accepted` were accepted."""
        fresh = self.probing and drafted > 0  # the draft's old cost is stale after a stretch at k = 0
        self.costs.observe(drafted, timing.draft_s, timing.verify_s, self._batch, fresh, looked_up)
        if drafted:
            self.probing = False
        self.acceptance.observe(drafted, 0 if looked_up else accepted)
        if looked_up:
            self.lookup.observe(looked_up, accepted)
        self._last_round_s = time.monotonic() - self._chosen_at
        if self._regime is not None:
            self.shared.regimes.observe(self._regime, self._previous_regime, accepted + 1,
                                        self._last_round_s, self.shared.decoding(self), self.shared.drafting_gain)
        self._previous_regime, self._regime = self._regime, None
        self.rounds_at_k += 1
        if self.k == 0:
            self.rounds_since_probe += 1

    def close(self) -> None:
        self.shared.alignment.leave(id(self))
        self.shared.leave(self)


@dataclass
class AdaptiveSpeculation:
    """The server-wide state the per-request policies share: costs, acceptance memory, the batch in flight."""

    config: PolicyConfig = PolicyConfig()
    costs: RoundCosts = field(default_factory=RoundCosts)
    acceptance: AcceptanceMemory = field(default_factory=AcceptanceMemory)
    lookup: AcceptanceMemory = field(default_factory=lambda: AcceptanceMemory(prior=LOOKUP_PRIOR))
    regimes: LoadRegimes = field(default_factory=LoadRegimes)
    alignment: RoundAlignment = field(default_factory=RoundAlignment)
    active: dict[int, AdaptiveDraftLength] = field(default_factory=dict)

    def for_request(self, prompt_class: str) -> AdaptiveDraftLength:
        return AdaptiveDraftLength(self, RequestAcceptance(self.acceptance, prompt_class),
                                   RequestAcceptance(self.lookup, prompt_class))

    def join(self, policy: AdaptiveDraftLength) -> None:
        self.active[id(policy)] = policy

    def leave(self, policy: AdaptiveDraftLength) -> None:
        self.active.pop(id(policy), None)

    def decoding(self, me: AdaptiveDraftLength) -> int:
        """Requests decoding with `me` among them (the load its round runs under)."""
        return len(self.active) + (0 if id(me) in self.active else 1)

    def drafting_gain(self, requests: int) -> float | None:
        """The tables' forecast for the requests decoding now (orchestrator.decoding.regime.Forecast): the
        mean of their own forecasts. One request's forecast follows its own acceptance: on the embedded
        pair the same load was forecast at 0.96-1.50x within one run, by whichever request's round
        closed the window, and whether drafting was tried there went with it."""
        gains = [g for g in (p.drafting_gain(requests) for p in self.active.values()) if g is not None]
        return sum(gains) / len(gains) if gains else None

    def batch_load(self, me: AdaptiveDraftLength, drafting: bool = True) -> BatchLoad:
        """The other requests decoding now: under the drafting regime each at the k it chose last,
        under target-only none drafting. The regime is the load's, so the others go where this
        round goes: priced at the k = 0 they ran under target-only, a drafting round beside them
        would pay for a target step of its own, and when drafting was tried again no request
        drafted (at concurrency 2 the trials measured target-only rounds and lost). Under drafting,
        those that chose no k yet are undecided (BatchLoad.undecided), and those held back from
        drafting by their own draft (skip_drafting) run target-only rounds: a draft beside them
        pays for a target step of its own."""
        others = [p for key, p in self.active.items() if key != id(me)]
        ks = [(p.k if drafting and not p.held_back else 0, p) for p in others
              if p.k is not None or p.held_back or not drafting]
        drafting_ks = [k for k, _ in ks if k > 0]
        return BatchLoad(rows=sum(k + 1 + (0 if k else p.lookup_rows) for k, p in ks),
                         lookup_rows=sum(0 if k else p.lookup_rows for k, p in ks),
                         tokens=sum(p.acceptance.expected_tokens(k) if k else p.lookup_expected for k, p in ks),
                         drafting=len(drafting_ks), drafting_rows=sum(k + 1 for k in drafting_ks),
                         undecided=len(others) - len(ks))
