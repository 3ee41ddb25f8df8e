"""What a round of the batch costs: the services' step-cost models, scaled by what rounds really took.

Every round of the requests decoding together is k draft steps over their sessions, then
one target step over their k + 1 rows each (and any prompt-lookup rows):

    round_s(k) = k * draft_step(n sessions, n rows) + target_step(n sessions, n (k + 1) rows)

Each step is priced by the service that runs it (specmesh.step_costs: its start-up table
by rows, corrected by a model fitted to the steps it runs, with their sessions and cached
context; reported in ModelInfo and collected in orchestrator.deployment.step_reports). What
the services cannot see, the wire and waiting for other orchestrators' work, shows in the
wall clock: each role's ratio of what rounds took to what its model predicted scales it.

Without a report (a service that does not send one) the wall-clock cost of each round shape
seen so far stands in.

At k = 0 nothing shows what drafting costs now: a draft that was slow (busy with another
tenant, say) would stay priced slow for good. So in target-only rounds the draft's correction
fades back towards what its service reports, and without reports the drafting rounds' wall
clock fades towards the target-only one; drafting is tried again once it looks worth it.
"""

from __future__ import annotations

from dataclasses import dataclass

from specmesh.ewma import Ewma
from specmesh.step_costs import StepCosts
from specmesh.step_model import StepShape

RATIO_WEIGHT = 0.2  # of a round in the wall-clock correction: one odd round must not swing it
RATIO_BOUNDS = (0.02, 1000.0)  # a pipelined pre-draft makes the wait almost nothing; a busy service, long
WALL_WEIGHT = 0.5  # without a report, round costs follow the newest rounds quickly
FADE_WEIGHT = 0.05  # what target-only rounds no longer show fades, a twentieth a round (so drafting is tried again)


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

    def __init__(self, reports=None):
        self.reports = reports  # orchestrator.deployment.step_reports.StepReports, or None
        self.draft_ratio = Ewma(RATIO_WEIGHT)
        self.target_ratio = Ewma(RATIO_WEIGHT)
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
        return k * tables[1].step_s(batch.draft_step()) * self.draft_ratio.get(1.0)

    def target_s(self, k: int, batch: BatchLoad, lookup: int = 0) -> float:
        tables = self._tables()
        if tables is None:
            return 0.0
        return tables[0].step_s(batch.target_step(k, lookup)) * self.target_ratio.get(1.0)

    def round_s(self, k: int, batch: BatchLoad, lookup: int = 0) -> float:
        """Seconds of one round of the batch at draft length k (or at k = 0 verifying `lookup` more rows)."""
        if self._tables() is None:
            return self._wall_s(k + lookup)
        return self.draft_s(k, batch) + self.target_s(k, batch, lookup)

    def draft_prefill_s(self, tokens: int) -> float | None:
        """Seconds for the draft to feed `tokens` tokens at once (a prefill or a catch-up); None unknown."""
        tables = self._tables()
        return None if tables is None else tables[1].step_s(StepShape(1, tokens)) * self.draft_ratio.get(1.0)

    def observe(self, drafted: int, draft_s: float, verify_s: float, batch: BatchLoad, lookup: int = 0) -> None:
        """One round's wall-clock waits for its draft tokens and its verification, and the batch it ran in."""
        self.wall_by_k.setdefault(drafted + lookup, Ewma(WALL_WEIGHT)).update(draft_s + verify_s)
        if not drafted:
            self._fade()
        tables = self._tables()
        if tables is None:
            return
        self.target_ratio.update(_bounded(verify_s / tables[0].step_s(batch.target_step(drafted, lookup))))
        if drafted:
            self.draft_ratio.update(_bounded(draft_s / (drafted * tables[1].step_s(batch.draft_step()))))

    def _fade(self) -> None:
        if self.draft_ratio.value is not None:
            self.draft_ratio.value += FADE_WEIGHT * (1.0 - self.draft_ratio.value)
        target_only = self.wall_by_k.get(0)
        for k, wall in self.wall_by_k.items():
            if k and target_only is not None and target_only.value is not None and wall.value is not None:
                wall.value += FADE_WEIGHT * (target_only.value - wall.value)

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


def _bounded(ratio: float) -> float:
    return min(RATIO_BOUNDS[1], max(RATIO_BOUNDS[0], ratio))
