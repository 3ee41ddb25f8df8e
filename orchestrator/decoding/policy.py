"""Cost-aware adaptive draft length: pick the k that maximises expected tokens per second.

Per round with k draft tokens and per-token acceptance alpha, the expected number of
committed tokens is E(k) = (1 - alpha^(k+1)) / (1 - alpha) (accepted prefix plus the
recovered or bonus token). The round costs D(k) + V(k+1): the time the round waited for
its k draft tokens (a Propose, or what was left of a pipelined pre-draft: near nothing
on a hit) and a Verify of k+1 rows, both wall-clock times as this orchestrator sees
them, so network, queueing behind other requests (concurrency), a slow draft and
pipelining are all priced in. The rate of k = 0 (a target-only round) is 1 / V(1).

Verification cost is not linear in rows (on our CPUs 1-3 rows cost about one pass, on
others 4 rows are cheaper than 3), so V is measured per row count. A row count not yet
measured is priced optimistically (a smaller count pro rata from the nearest measured larger
one, a larger count at the cheapest measured one), which makes the policy try it once and
learn its real cost. Draft cost is per drafted token.

The choice never changes the output: each round's tokens follow the target's
distribution whatever k is, as long as k is fixed before the round's draft is sampled.
Seeded sampling requests keep a fixed k, because a timing-driven k would make the
same seed give different (equally valid) outputs from run to run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from orchestrator.decoding.loop import RoundTiming

EWMA_WEIGHT = 0.5  # weight of the newest observation: costs move with load, follow them quickly


class Ewma:
    def __init__(self, weight: float = EWMA_WEIGHT):
        self.weight = weight
        self.value: float | None = None

    def update(self, sample: float) -> None:
        self.value = sample if self.value is None else self.value + self.weight * (sample - self.value)


class ServiceCosts:
    """Wall-clock costs of the draft and target services, shared by every request of an orchestrator."""

    def __init__(self):
        self.verify_by_rows: dict[int, Ewma] = {}
        self.draft_per_token = Ewma()

    def observe(self, drafted: int, timing: RoundTiming, fresh: bool = False) -> None:
        """fresh: the draft was idle for a while; its old cost is stale, take the new one as it is."""
        self.verify_by_rows.setdefault(drafted + 1, Ewma()).update(timing.verify_s)
        if drafted:
            if fresh:
                self.draft_per_token.value = None
            self.draft_per_token.update(timing.draft_s / drafted)

    @property
    def known(self) -> bool:
        return bool(self.verify_by_rows) and self.draft_per_token.value is not None

    def verify_s(self, rows: int) -> float:
        """V(rows), measured, or an optimistic guess that gets it measured if it looks best."""
        measured = {r: e.value for r, e in self.verify_by_rows.items()}
        if rows in measured:
            return measured[rows]
        larger = [r for r in measured if r > rows]
        if larger:  # no cheaper per row than the nearest larger shape
            nearest = min(larger)
            return measured[nearest] * rows / nearest
        return min(measured.values())  # no dearer than the cheapest measured shape

    def draft_s(self, k: int) -> float:
        return k * self.draft_per_token.value


class AcceptanceEstimate:
    """Per-token acceptance as Bernoulli counts (accepted tokens vs rejections) over a fixed prior.

    The evidence decays so the estimate follows change; with forget_when_idle it also decays
    in target-only rounds, so that after a stretch at k = 0 one probe round speaks for itself.
    """

    def __init__(self, decay: float, prior_alpha: float = 0.5, prior_weight: float = 4.0,
                 forget_when_idle: bool = False):
        self.decay = decay
        self.prior_accepted, self.prior_weight = prior_alpha * prior_weight, prior_weight
        self.forget_when_idle = forget_when_idle
        self.accepted = self.rejected = 0.0

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted or self.forget_when_idle:
            self.accepted *= self.decay
            self.rejected *= self.decay
        if drafted:
            self.accepted += accepted
            self.rejected += 1 if accepted < drafted else 0

    @property
    def alpha(self) -> float:
        return (self.accepted + self.prior_accepted) / (self.accepted + self.rejected + self.prior_weight)


def expected_tokens(alpha: float, k: int) -> float:
    """E(k): tokens one round commits with k draft tokens at per-token acceptance alpha."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


@dataclass(frozen=True)
class PolicyConfig:
    margin: float = 0.1  # change k only for a predicted gain of at least 10% ...
    dwell_rounds: int = 3  # ... and only after this many rounds at the current k,
    urgent_gain: float = 0.5  # unless the gain is at least 50% (a guess that proved wrong)
    probe_every: int = 8  # at k = 0, one speculative round after this many rounds ...
    max_probe_every: int = 64  # ... the interval doubling, up to this, while probes keep failing


class AdaptiveDraftLength:
    """One request's choice of k, with hysteresis; k = 0 is a target-only round."""

    def __init__(self, costs: ServiceCosts, acceptance: AcceptanceEstimate, server_acceptance: AcceptanceEstimate,
                 config: PolicyConfig = PolicyConfig()):
        self.costs = costs
        self.acceptance = acceptance
        self.server_acceptance = server_acceptance  # the prompt class's, fed by every request
        self.config = config
        self.k: int | None = None
        self.rounds_at_k = 0
        self.probe_every = config.probe_every
        self.rounds_since_probe = 0
        self.probing = False

    def rate(self, k: int) -> float:
        """Expected committed tokens per second at draft length k."""
        if k == 0:
            return 1.0 / max(self.costs.verify_s(1), 1e-9)
        seconds = self.costs.draft_s(k) + self.costs.verify_s(k + 1)
        return expected_tokens(self.acceptance.alpha, k) / max(seconds, 1e-9)

    def best(self, k_max: int, lowest: int = 0) -> int:
        return max(range(lowest, k_max + 1), key=self.rate)

    def choose(self, k_max: int) -> int:
        if k_max <= 0:
            return 0
        if self.k is None:  # the first round: what costs and the prompt class predict, or the most
            self.k = self.best(k_max) if self.costs.known else k_max
        elif self.k == 0 and self.rounds_since_probe >= self.probe_every:
            self.rounds_since_probe = 0  # nothing is learned at k = 0: look again now and then
            self.probe_every = min(2 * self.probe_every, self.config.max_probe_every)
            self.probing = True
            return k_max  # the most evidence of acceptance one round can give
        elif self.costs.known:  # else no draft round has been timed yet (the draft was away): keep k
            self._maybe_switch(self.best(k_max), k_max)
        return min(self.k, k_max)

    def _maybe_switch(self, candidate: int, k_max: int) -> None:
        current = min(self.k, k_max)
        gain = self.rate(candidate) / self.rate(current) - 1.0
        settled = self.rounds_at_k >= self.config.dwell_rounds
        if candidate != current and gain > (self.config.margin if settled else self.config.urgent_gain):
            if self.k == 0:
                self.probe_every = self.config.probe_every
            self.k, self.rounds_at_k, self.rounds_since_probe = candidate, 0, 0

    def observe(self, timing: RoundTiming, drafted: int, accepted: int) -> None:
        self.costs.observe(drafted, timing, fresh=self.probing)
        self.probing = False
        self.acceptance.observe(drafted, accepted)
        self.server_acceptance.observe(drafted, accepted)
        self.rounds_at_k += 1
        if self.k == 0:
            self.rounds_since_probe += 1


@dataclass
class AdaptiveSpeculation:
    """The server-wide state the per-request policies share: service costs and acceptance per prompt class."""

    config: PolicyConfig = PolicyConfig()
    costs: ServiceCosts = field(default_factory=ServiceCosts)
    by_prompt_class: dict[str, AcceptanceEstimate] = field(default_factory=dict)

    def for_request(self, prompt_class: str) -> AdaptiveDraftLength:
        server = self.by_prompt_class.setdefault(prompt_class, AcceptanceEstimate(decay=0.99))
        # The request starts from its prompt class's acceptance, worth one token of its own evidence.
        own = AcceptanceEstimate(decay=0.9, prior_alpha=server.alpha, prior_weight=1.0, forget_when_idle=True)
        return AdaptiveDraftLength(self.costs, own, server, self.config)
