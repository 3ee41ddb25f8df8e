"""Per-position acceptance, learned online: a request's own rounds over its prompt class's, over the deployment's.

Position p's acceptance a_p is the chance that the p-th draft token of a round is accepted,
given that the ones before it were; it falls with position (the draft drifts from the
target the further it runs), so one per-token rate would misprice long drafts. A round
that drafted k tokens with `accepted` accepted reached positions 1..min(accepted + 1, k).

Three levels, each a per-token rate (every round informs it) over the level above as its
prior: the deployment (prior DEFAULT_ACCEPTANCE), the prompt class, the request. The
deployment and each class also learn the shape along the positions; a request uses its
class's shape at its own per-token level, so its first round is chosen from its class's
history and a few rounds of its own outweigh it.

Evidence decays with every round, target-only rounds included: after a stretch at k = 0
the estimates drift back towards their priors, so a choice made on old evidence is tried
again. A target-only round decays the levels shared by the requests (deployment, class) by
its share of the batch it ran in: n requests' rounds run side by side, so the shared
evidence fades with the batch's rounds, not n times as fast (at 64 requests, a class would
forget a hundred rounds of rejections in two of the batch's rounds, and every request would
draft again at once). At most MAX_CLASSES classes are kept (least recently used out).
"""

from __future__ import annotations

from collections import OrderedDict

from specmesh.ewma import kept_over
from specmesh.roles import MAX_DRAFT_TOKENS

DEFAULT_ACCEPTANCE = 0.7  # before any history: a same-family pair; a few rounds replace it
PRIOR_TOKENS = 8.0  # draft tokens' worth of evidence the prior counts for: one bad first round must not erase it
POSITION_WEIGHT = 4.0  # rounds' worth of evidence a level's prior counts for at each position
MAX_CLASSES = 64  # prompt classes remembered (least recently used out): clients' labels cannot grow memory
# Evidence kept at each new round: the deployment's over hundreds of rounds, a class's over ~100, a request's ~20,
# so each level follows a change at its own pace and a request's own rounds soon outweigh its class.
DEPLOYMENT_DECAY, CLASS_DECAY, REQUEST_DECAY = 0.995, 0.99, 0.95
LEVEL_PRIOR_TOKENS = 2.0  # draft tokens' worth of evidence the level above counts for in a class's or request's rate
FLOOR, CEILING = 0.01, 0.995  # no position is ever certain either way


class PositionCounts:
    """Decayed evidence of one level: rounds that reached each position and accepted it, and the
    totals of accepted tokens and rejections (the per-token rate, if acceptance were the same at
    every position: the maximum-likelihood rate of a truncated geometric)."""

    def __init__(self, decay: float, positions: int = MAX_DRAFT_TOKENS):
        self.decay = decay
        self.reached = [0.0] * positions
        self.accepted = [0.0] * positions
        self.tokens = 0.0  # accepted draft tokens
        self.rejections = 0.0  # rounds that ended in a rejection

    def observe(self, drafted: int, accepted: int, share: float = 1.0) -> None:
        """A round's outcome; a target-only round (drafted 0) counts for `share` of a round in the decay."""
        decay = self.decay if drafted else kept_over(self.decay, share)
        if decay < 1.0:
            self.reached = [n * decay for n in self.reached]
            self.accepted = [a * decay for a in self.accepted]
            self.tokens *= decay
            self.rejections *= decay
        for position in range(min(accepted + 1, drafted, len(self.reached))):
            self.reached[position] += 1.0
        for position in range(min(accepted, len(self.accepted))):
            self.accepted[position] += 1.0
        self.tokens += accepted
        self.rejections += 1.0 if accepted < drafted else 0.0

    def per_token(self, prior: float, weight: float) -> float:
        """The level's per-token rate, `prior` counting for `weight` tokens' worth of evidence."""
        return _clamp((self.tokens + weight * prior) / (self.tokens + self.rejections + weight))

    def rates(self, shape: list[float]) -> list[float]:
        """Per-position rates: this level's evidence at each position over `shape` as the prior, which
        stands wherever the level has drafted little (so a deep position is never written off
        because it was rarely reached)."""
        return [_clamp((accepted + POSITION_WEIGHT * prior) / (reached + POSITION_WEIGHT))
                for reached, accepted, prior in zip(self.reached, self.accepted, shape)]


def _clamp(rate: float) -> float:
    return min(CEILING, max(FLOOR, rate))


def _scaled(rates: list[float], factor: float) -> list[float]:
    return [_clamp(rate * factor) for rate in rates]


def expected_tokens(rates: list[float], k: int) -> float:
    """E(k): tokens a round commits with k draft tokens: the accepted prefix's expected length,
    plus the recovered or bonus token."""
    expected, reach = 1.0, 1.0
    for rate in rates[:k]:
        reach *= rate
        expected += reach
    return expected


def expected_by_length(rates: list[float], cap: int, lengths: int) -> list[float]:
    """[E(min(k, cap)) for k in range(lengths)]: expected_tokens at every draft length in one pass, the
    same sums in the same order (so each equals expected_tokens' to the last bit)."""
    by_length, expected, reach = [1.0], 1.0, 1.0
    for rate in rates[:min(cap, lengths - 1)]:
        reach *= rate
        expected += reach
        by_length.append(expected)
    by_length.extend([expected] * (lengths - len(by_length)))
    return by_length


class AcceptanceMemory:
    """The orchestrator-wide levels: the deployment's, and its prompt classes' (bounded). One memory per
    kind of draft: the draft model's, and prompt lookup's (orchestrator.decoding.lookup)."""

    def __init__(self, max_classes: int = MAX_CLASSES, prior: float = DEFAULT_ACCEPTANCE):
        self.prior = prior  # the per-token rate before any history
        self.deployment = PositionCounts(decay=DEPLOYMENT_DECAY)
        self.classes: OrderedDict[str, PositionCounts] = OrderedDict()
        self.max_classes = max_classes
        self.version = 0  # counts what it learned: the rates worked out below stand until it moves
        self._class_rates: dict[str, tuple[int, float, tuple[float, list[float]]]] = {}

    def for_class(self, prompt_class: str) -> PositionCounts:
        return recently_used(self.classes, prompt_class, lambda: PositionCounts(decay=CLASS_DECAY), self.max_classes)

    def observe(self, prompt_class: str, drafted: int, accepted: int, share: float = 1.0) -> None:
        """A round's outcome, at the deployment's level and its class's; a target-only round's decay by its
        `share` of the batch (module docstring)."""
        self.deployment.observe(drafted, accepted, share)
        self.for_class(prompt_class).observe(drafted, accepted, share)
        self.version += 1

    def class_rates(self, prompt_class: str) -> tuple[float, list[float]]:
        """A class's per-token rate and per-position rates, over the deployment's: worked out once for every
        request of the class that reads them before the memory learns again (the prior may be set directly)."""
        cached = self._class_rates.get(prompt_class)
        if cached is not None and cached[0] == self.version and cached[1] == self.prior:
            return cached[2]
        rates = self._class_rates_now(prompt_class)
        self._class_rates[prompt_class] = (self.version, self.prior, rates)
        if len(self._class_rates) > self.max_classes:
            self._class_rates.pop(next(iter(self._class_rates)))
        return rates

    def _class_rates_now(self, prompt_class: str) -> tuple[float, list[float]]:
        deployment_rate = self.deployment.per_token(self.prior, weight=PRIOR_TOKENS)
        deployment_shape = self.deployment.rates([deployment_rate] * len(self.deployment.reached))
        counts = self.for_class(prompt_class)
        class_rate = counts.per_token(deployment_rate, weight=LEVEL_PRIOR_TOKENS)
        # The deployment's shape along the positions, at the class's own level.
        return class_rate, counts.rates(_scaled(deployment_shape, class_rate / deployment_rate))


class RequestAcceptance:
    """One request's acceptance: its class's per-position shape, at the request's own per-token level.

    A request has too few rounds to learn each position, but every round tells its
    per-token level; the class (or the deployment) supplies the shape.
    """

    def __init__(self, memory: AcceptanceMemory, prompt_class: str):
        self.memory = memory
        self.prompt_class = prompt_class
        self.own = PositionCounts(decay=REQUEST_DECAY)
        self._rates: list[float] | None = None

    def observe(self, drafted: int, accepted: int, batch_requests: int = 1) -> None:
        """A round's outcome, in a batch of `batch_requests`; at k = 0 (drafted 0) every level only decays, the
        shared ones by the round's share of the batch (module docstring)."""
        self.own.observe(drafted, accepted)
        self.memory.observe(self.prompt_class, drafted, accepted, 1.0 / max(1, batch_requests))
        self._rates = None

    def rates(self) -> list[float]:
        if self._rates is None:
            class_rate, class_shape = self.memory.class_rates(self.prompt_class)
            own_rate = self.own.per_token(class_rate, weight=LEVEL_PRIOR_TOKENS)
            self._rates = _scaled(class_shape, own_rate / class_rate)
        return self._rates

    def expected_tokens(self, k: int) -> float:
        return expected_tokens(self.rates(), k)


class DraftConfidence:
    """How far the draft's own probabilities can be trusted as acceptance probabilities.

    A round's proposal carries the draft's confidence at each token (its largest probability
    there); the running product up to token i is the draft's estimate that tokens 1..i are all
    accepted, and their sum its expected count of accepted tokens. `factor` is the accepted
    count over that estimate, decayed like the deployment's acceptance: below 1 for an
    overconfident draft, so the draft's stop (orchestrator.decoding.policy) comes sooner, above
    1 for an underconfident one. The policy keeps one per regime: under sampling acceptance is
    the overlap of the two distributions, not agreement on an argmax, and maps otherwise. Under
    it, one per prompt class (ConfidenceMemory), whose prior is its regime's factor: one draft
    can be overconfident on one kind of text and underconfident on another.
    """

    DECAY = DEPLOYMENT_DECAY  # decayed like the deployment's acceptance, which it corrects
    PRIOR_TOKENS = 4.0  # a calibrated draft until a few rounds say otherwise
    CLASS_PRIOR_TOKENS = 16.0  # a class follows its regime until a few requests of its own say otherwise
    BOUNDS = (0.1, 10.0)  # a draft ten times over- or underconfident is broken, not miscalibrated

    def __init__(self, parent: "DraftConfidence | None" = None):
        self.parent = parent  # the level whose factor is this one's prior (a class's: its regime's)
        self.prior_tokens = self.PRIOR_TOKENS if parent is None else self.CLASS_PRIOR_TOKENS
        self.expected = self.accepted = 0.0

    def observe(self, probabilities: list[float], accepted: int) -> None:
        if not probabilities:
            return
        expected, run = 0.0, 1.0
        for probability in probabilities:
            run *= probability
            expected += run
        self.expected = self.expected * self.DECAY + expected
        self.accepted = self.accepted * self.DECAY + min(accepted, len(probabilities))
        if self.parent is not None:
            self.parent.observe(probabilities, accepted)

    @property
    def factor(self) -> float:
        prior = 1.0 if self.parent is None else self.parent.factor
        low, high = self.BOUNDS
        ratio = (self.accepted + self.prior_tokens * prior) / (self.expected + self.prior_tokens)
        return min(high, max(low, ratio))


class ConfidenceMemory:
    """One regime's draft confidence and its prompt classes' under it (bounded, least recently used out)."""

    def __init__(self, max_classes: int = MAX_CLASSES):
        self.regime = DraftConfidence()
        self.classes: OrderedDict[str, DraftConfidence] = OrderedDict()
        self.max_classes = max_classes

    def for_class(self, prompt_class: str) -> DraftConfidence:
        return recently_used(self.classes, prompt_class, lambda: DraftConfidence(self.regime), self.max_classes)


def recently_used(entries: OrderedDict, key: str, make, limit: int):
    """entries[key], made if missing, as the most recently used; the least recently used beyond `limit` out."""
    entry = entries.get(key)
    if entry is None:
        entry = entries[key] = make()
        while len(entries) > limit:
            entries.popitem(last=False)
    entries.move_to_end(key)
    return entry
