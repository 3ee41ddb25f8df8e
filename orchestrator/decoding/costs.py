"""What a round of the batch costs: the services' step-cost models, scaled by what rounds really took.

Every round of the requests decoding together is k draft steps over their sessions, then
one target step over their k + 1 rows each (and any prompt-lookup rows):

    round_s(k) = k * draft_step(n sessions, n rows) + target_step(n sessions, n (k + 1) rows)

Each step is priced by the service that runs it (specmesh.engine.step_costs: its start-up table
by rows, corrected by a model fitted to the steps it runs, with their sessions and cached
context; reported in ModelInfo and collected in orchestrator.serving.step_reports). What
the services cannot see shows in the wall clock, in two parts, where the round knows the
forward time its calls reported:

- the call around the forward (the link's round trip, serialization, the services' own
  handling), a latency a round pays once per call whatever its k: a drafting round pays
  the draft's, every round the target's. A draft across a network is then worth a longer
  draft or none at all, as the link's round trip is amortised over the tokens or avoided;
- the forward itself against the service's model: each role's ratio of the two scales it
  (waiting for other orchestrators' work on the service, a model that drifted).

Without forward times (a round's waits only) the ratio takes the whole wait, latency included.

    draft_side(k) = [k > 0] (draft_latency + k * draft_step * draft_ratio)
    target_side(k) = target_latency + target_step(k + 1) * target_ratio
    round_s(k) = hit * max(draft_side, target_side) + (1 - hit) * (draft_side + target_side)

`hit` is the share of pipelined rounds (orchestrator.decoding.pipelined) whose pre-drafted branch was the
one the verification chose: such a round's draft ran beside the previous verification, so it costs the
longer of the two sides; a miss drafts afresh after it, both. Sequential rounds never hit (hit = 0: the
sum). The draft's side is learned from the rounds whose draft was on the critical path (a hit's wait for
its branch says nothing of what drafting costs).

The target's side is learned apart for rounds that draft and rounds that do not (target-only, or a
free proposal verified): each is priced from its own kind of round, the other's standing in until one
was seen. Under load the two differ by more than their rows. Target-only sessions decode in phase, a
step carrying nearly all of them; rounds that draft break that phase (a session's draft steps and its
verification come at its own pace), so their steps carry fewer sessions, their calls wait for other
sessions' steps, and on one machine the draft's steps take the target's cores. Learned together, the
many target-only rounds of a loaded batch would price drafting as if it kept their phase, and a batch
that drafts would price target-only rounds at drafting's cost (docs/design/draft-length.md).

Without a report (a service that does not send one) the wall-clock cost of each round shape
seen so far stands in.

The same measures size what a round may do beside its tokens: how many tokens a target-only
Verify decodes ahead (orchestrator.decoding.decode_ahead: the target's latency against its step)
and how many rejection branches a pipelined pre-draft fits in the draft's idle time
(orchestrator.decoding.pipelined: the draft's step against the target's). The draft's step there is
its forward time per token as the draft reports it: a pre-drafted branch ran while the previous
round was verified, so the round's wait for it says nothing of what a draft step costs.

At k = 0 nothing shows what drafting costs now: a draft that was slow (busy with another
tenant, or behind a link that stalled) would stay priced slow for good. So in target-only
rounds the draft's correction fades back towards what its service reports, its latency towards
the target's, and without reports the drafting rounds' wall clock fades towards the target-only
one, at the pace of the batch's rounds (each of n sessions' side by side counts 1/n); drafting is
tried again once it looks worth it. What does not fade fast enough is acceptance estimated low on a
few unlucky first rounds: it decays back round by round, and a target-only round that decodes ahead
holds many tokens. So once the target-only rounds since the last drafting one took
1/RETRY_SHARE times what a drafting round costs, one session's next round drafts whatever the estimates
say (`claim_probe`): a probe, a bounded share of the time, that measures acceptance and latency anew.
That time is the batch's wall clock, not the sum of its sessions' rounds: n sessions' target-only rounds
run side by side, so each counts 1/n of its wall time (counted as a sum, 64 sessions would probe 64 times
as often). And a probe is one session's: claiming it starts the count again, so the other sessions of the
same batch do not all draft at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.decoding.decode_ahead import tokens_ahead, tokens_per_call
from orchestrator.decoding.request import RoundTiming
from orchestrator.decoding.timing import HIT
from specmesh.ewma import Ewma, kept_over
from specmesh.roles import MAX_DECODE_AHEAD
from specmesh.engine.step_costs import StepCosts
from specmesh.engine.step_model import StepShape

RATIO_WEIGHT = 0.2  # of a round in a step's correction or forward time: one odd round must not swing it
RATIO_BOUNDS = (0.02, 1000.0)  # a pipelined pre-draft makes the wait almost nothing; a busy service, long
WALL_WEIGHT = 0.5  # without a report, round costs follow the newest rounds quickly
LATENCY_WEIGHT = 0.5  # a call's latency follows the newest rounds quickly: a link's round trip changes in steps
HIT_WEIGHT = 0.1  # of a pipelined round in the pre-draft hit rate: one bit a round, so about the last ten
# Trying an unpaying draft again may cost this share of the time the target-only rounds take: within the
# noise of any host, so that a long link never costs measurably more than not drafting at all.
RETRY_SHARE = 0.02
FADE_WEIGHT = 0.05  # what target-only rounds no longer show fades, a twentieth a batch's round: drafting tried again


@dataclass(frozen=True)
class BatchLoad:
    """The requests decoding together: how many, and their committed tokens (cached context) in all."""

    requests: int = 1
    context: int = 0

    def target_step(self, k: int, lookup: int = 0) -> StepShape:
        """Every request's k + 1 rows, and `lookup` rows of one request (over an average context)."""
        rows = self.requests * (k + 1) + lookup
        return StepShape(self.requests, rows, attended=self.context * (k + 1) + lookup * self.context // self.requests)

    def draft_step(self) -> StepShape:
        return StepShape(self.requests, self.requests, attended=self.context)


class RoundCosts:
    """Predicted draft and target seconds of a round, shared by every request of an orchestrator."""

    def __init__(self, reports=None, decode_ahead: int = MAX_DECODE_AHEAD):
        self.reports = reports  # orchestrator.serving.step_reports.StepReports, or None
        self.decode_ahead = decode_ahead  # LoopConfig.decode_ahead: the most a target-only Verify decodes ahead
        self.draft_ratio = Ewma(RATIO_WEIGHT)
        self.target_ratio = Ewma(RATIO_WEIGHT)  # of rounds that do not draft
        self.drafting_target_ratio = Ewma(RATIO_WEIGHT)  # of rounds that draft (module docstring)
        self.draft_latency = Ewma(LATENCY_WEIGHT)  # seconds a drafting round waits beyond the draft's forwards
        self.target_latency = Ewma(LATENCY_WEIGHT)  # seconds a Verify takes beyond the target's forward
        self.drafting_target_latency = Ewma(LATENCY_WEIGHT)  # the same, of a Verify with draft tokens
        self.draft_forward = Ewma(RATIO_WEIGHT)  # seconds of one draft step, as the draft reports its forwards
        self.target_forward = Ewma(RATIO_WEIGHT)  # seconds of one target step, as the target reports its forwards
        # seconds each further step of a Verify that decodes ahead adds beyond its forward (the service's own work
        # around a step): a one-step call's latency holds one step's such work, a call of n steps n times it
        self.target_step_overhead = Ewma(RATIO_WEIGHT)
        self.undrafted_s = 0.0  # the batch's wall time in target-only rounds since the last drafting round or probe
        self.last_drafted = 0  # draft tokens of the latest drafting round of any request: a probe's length
        self.hit_rate = Ewma(HIT_WEIGHT)  # pipelined rounds whose pre-drafted branch was used; empty: sequential
        self.wall_by_k: dict[int, Ewma] = {}  # without reports: a round's seconds by its draft length

    def _tables(self) -> tuple[StepCosts, StepCosts] | None:
        """(target, draft), or None: a round is priced from both services' reports or from neither."""
        target = getattr(self.reports, "target", None)
        draft = getattr(self.reports, "draft", None)
        return (target, draft) if target is not None and draft is not None else None

    @property
    def known(self) -> bool:
        """Whether rounds can be priced: both reports, or a round timed."""
        return self._tables() is not None or bool(self.wall_by_k)

    def draft_s(self, k: int, batch: BatchLoad) -> float:
        tables = self._tables()
        if tables is None or k == 0:
            return 0.0
        return self.draft_latency.get(0.0) + k * tables[1].step_s(batch.draft_step()) * self.draft_ratio.get(1.0)

    def target_s(self, k: int, batch: BatchLoad, lookup: int = 0) -> float:
        tables = self._tables()
        if tables is None:
            return 0.0
        return self._latency_of(k).get(0.0) + self.target_step_s(k, batch, lookup)

    def target_step_s(self, k: int, batch: BatchLoad, lookup: int = 0) -> float | None:
        """Seconds of the target's step verifying k draft tokens (and `lookup` rows): its report scaled by
        what its steps took; without reports, the forward time of a step as measured; None before either."""
        tables = self._tables()
        if tables is None:
            return self.target_forward.value
        return tables[0].step_s(batch.target_step(k, lookup)) * self._ratio_of(k).get(1.0)

    def _ratio_of(self, k: int) -> Ewma:
        """The target's ratio a round of k draft tokens is priced with: its own kind's, else the other's."""
        return _own_else_other(self.drafting_target_ratio, self.target_ratio, bool(k))

    def _latency_of(self, k: int) -> Ewma:
        return _own_else_other(self.drafting_target_latency, self.target_latency, bool(k))

    def round_s(self, k: int, batch: BatchLoad, lookup: int = 0) -> float:
        """Seconds of one round of the batch at draft length k (or at k = 0 verifying `lookup` more rows),
        its draft beside the previous verification at the pre-draft hit rate (module docstring)."""
        if self._tables() is None:
            return self._wall_s(k + lookup)
        draft_s, target_s = self.draft_s(k, batch), self.target_s(k, batch, lookup)
        hit = self.hit_rate.get(0.0)
        return hit * max(draft_s, target_s) + (1.0 - hit) * (draft_s + target_s)

    def target_only_s(self, batch: BatchLoad) -> float:
        """Seconds a token of target-only decoding takes: its share of a Verify that decodes ahead
        (orchestrator.decoding.decode_ahead): the first token a one-step round, each further one a step and
        the service's own work around it."""
        round_s, latency = self.round_s(0, batch), self._latency_of(0).get(0.0)
        step_s = self._ahead_step_s(round_s, latency)
        per_call = tokens_per_call(latency, step_s, self.decode_ahead)
        return (round_s + (per_call - 1) * step_s) / per_call

    def tokens_ahead(self, batch: BatchLoad, limit: int) -> int:
        """decode_ahead for the next target-only Verify, as target_only_s prices it: at most `limit`, and 0
        until a call's latency was measured (a Verify's wall time beside the forward time it reported)."""
        latency = self._latency_of(0).value
        if latency is None or not self.known:
            return 0
        step_s = self._ahead_step_s(self.round_s(0, batch), latency)
        return tokens_ahead(latency, step_s, self.decode_ahead, limit)

    def _ahead_step_s(self, round_s: float, latency: float) -> float:
        """Seconds each token after the first of a Verify that decodes ahead adds: a step and its overhead."""
        return max(round_s - latency, 0.0) + self.target_step_overhead.get(0.0)

    def observe_draft_forward(self, forward_s: float, steps: int) -> None:
        """A proposal of `steps` draft tokens that the draft reports took `forward_s` of forwards."""
        if steps > 0:
            self.draft_forward.update(forward_s / steps)

    def draft_prefill_s(self, tokens: int) -> float | None:
        """Seconds for the draft to feed `tokens` tokens at once (a prefill or a catch-up); None unknown."""
        tables = self._tables()
        return None if tables is None else tables[1].step_s(StepShape(1, tokens)) * self.draft_ratio.get(1.0)

    def observe_round(self, timing: RoundTiming, drafted: int, batch: BatchLoad, lookup: int = 0) -> None:
        """A round's waits (RoundTiming), `drafted` draft-model tokens and `lookup` rows beside them verified
        in `batch`."""
        self.observe(drafted, timing.draft_s, timing.verify_s, batch, lookup, timing.draft_forward_s,
                     timing.verify_forward_s, timing.target_steps, timing.predraft)

    def observe(self, drafted: int, draft_s: float, verify_s: float, batch: BatchLoad, lookup: int = 0,
                draft_forward_s: float | None = None, verify_forward_s: float | None = None,
                target_steps: int = 1, predraft: str | None = None) -> None:
        """One round's wall-clock waits for its draft tokens and its verification, and the batch it ran in;
        with the forward time the calls reported, each wait is split into the forward and the call around it.
        A Verify that decoded ahead (`target_steps` steps for one call) counts as a round of one step.
        `predraft`: HIT or MISS (orchestrator.decoding.timing) for a pipelined round that had a pre-draft."""
        round_s = verify_s
        if predraft is not None:
            self.hit_rate.update(1.0 if predraft == HIT else 0.0)
        drafted_after = drafted and predraft != HIT  # the draft's side on the critical path: it shows its cost
        if target_steps > 1:
            verify_s, verify_forward_s = self._one_step(verify_s, verify_forward_s, target_steps)
        self.wall_by_k.setdefault(drafted + lookup, Ewma(WALL_WEIGHT)).update(draft_s + verify_s)
        if drafted:
            self.undrafted_s, self.last_drafted = 0.0, drafted
        else:
            # the round's whole wall time (before the split below takes its forward part): its share of the batch's
            self._fade(round_s, 1.0 / max(1, batch.requests))
        if verify_forward_s is not None:
            verify_s = self._split(self.drafting_target_latency if drafted else self.target_latency, verify_s,
                                   verify_forward_s)
            self.target_forward.update(verify_s)
        if drafted_after and draft_forward_s is not None:
            draft_s = self._split(self.draft_latency, draft_s, draft_forward_s)
        tables = self._tables()
        if tables is None:
            return
        ratio = self.drafting_target_ratio if drafted else self.target_ratio
        ratio.update(_bounded(verify_s / tables[0].step_s(batch.target_step(drafted, lookup))))
        if drafted_after:
            self.draft_ratio.update(_bounded(draft_s / (drafted * tables[1].step_s(batch.draft_step()))))

    def claim_probe(self, round_s: float) -> bool:
        """Whether a drafting round is to be tried whatever the estimates say, by the session asking: the
        target-only rounds since the last drafting one (or probe) took 1/RETRY_SHARE times `round_s`, what the
        batch's drafting round costs (module docstring). A claim starts the count again: one session probes."""
        if not (self.known and self.undrafted_s * RETRY_SHARE >= round_s):
            return False
        self.undrafted_s = 0.0
        return True

    def _one_step(self, verify_s: float, forward_s: float | None, steps: int) -> tuple[float, float | None]:
        """(wait, forward) of a Verify of `steps` steps as a Verify of one step would have taken them: the
        call's latency as one-step calls showed it, and one step's forward. What the wait holds beyond those
        is the service's own work around each further step (target_step_overhead). Were it taken as the
        call's latency, a drafting round (one step a call) would be priced with every step's overhead of a
        long target-only call, and more tokens ahead a call would show a longer latency, which asks for more
        tokens ahead. (Without a forward time, the wait's share; before a one-step call, latency once.)"""
        if forward_s is None:
            return verify_s / steps, None
        forward_s = min(max(0.0, forward_s), verify_s)
        beyond, latency, step_forward_s = verify_s - forward_s, self._latency_of(0).value, forward_s / steps
        if latency is None:
            return beyond + step_forward_s, step_forward_s
        self.target_step_overhead.update(max(0.0, beyond - latency) / (steps - 1))
        return min(beyond, latency) + step_forward_s, step_forward_s

    @staticmethod
    def _split(latency: Ewma, wait_s: float, forward_s: float) -> float:
        """Learn the call's latency from a wait; return the forward's part of it."""
        forward_s = min(max(0.0, forward_s), wait_s)
        latency.update(wait_s - forward_s)
        return forward_s

    def _fade(self, round_s: float, share: float) -> None:
        """A target-only round of `round_s`, one of the batch's sessions' (`share`: 1/n of n side by side): it
        counts for that share of the batch's time and of a fading step."""
        fade = 1.0 - kept_over(1.0 - FADE_WEIGHT, share)
        if self.draft_ratio.value is not None:
            self.draft_ratio.value += fade * (1.0 - self.draft_ratio.value)
        # A drafting round tried again pays the draft's latency once more: it is forgotten (and so measured
        # anew) only once the target-only rounds since the last drafting one took 1/RETRY_SHARE times what it
        # costs beyond the target's, so that such tries stay a small share of the time, however long the link.
        self.undrafted_s += round_s * share
        excess = self.draft_latency.get(0.0) - self._latency_of(0).get(0.0)
        if excess > 0 and self.undrafted_s * RETRY_SHARE >= excess:
            self.draft_latency.reset()
        target_only = self.wall_by_k.get(0)
        for k, wall in self.wall_by_k.items():
            if k and target_only is not None and target_only.value is not None and wall.value is not None:
                wall.value += fade * (target_only.value - wall.value)

    def _wall_s(self, rows_beyond_one: int) -> float:
        """A round's wall clock as seen: measured, or no cheaper per row than the nearest larger one
        measured, or no dearer than the cheapest (an optimistic guess gets a shape measured)."""
        seen = {k: e.value for k, e in self.wall_by_k.items()}
        if rows_beyond_one in seen or not seen:
            return seen.get(rows_beyond_one, 1.0)
        nearest = min((k for k in seen if k > rows_beyond_one), default=None)
        if nearest is not None:
            return seen[nearest] * (rows_beyond_one + 1) / (nearest + 1)
        return min(seen.values())


def _own_else_other(drafting: Ewma, target_only: Ewma, draft: bool) -> Ewma:
    own, other = (drafting, target_only) if draft else (target_only, drafting)
    return own if own.value is not None or other.value is None else other


def _bounded(ratio: float) -> float:
    return min(RATIO_BOUNDS[1], max(RATIO_BOUNDS[0], ratio))
