"""What a round will cost, predicted from the services' own step costs and corrected by what rounds took.

Each service measures its forward step by rows at start-up and keeps the table
current (specmesh.step_costs; reported in ModelInfo, collected in
orchestrator.deployment.step_reports). A round of k draft tokens costs

    k draft steps over the sessions drafting at the same time  +  one target step over
    this round's k + 1 rows and the rows the other sessions verify beside it

as the tables price them (padded the way the services pad steps: on a CPU 4 rows
can cost what 1 does). The tables know nothing of the network, of queueing behind
other orchestrators' sessions, or of two services sharing cores; the ratio between
what rounds really took (wall clock, seen here) and what the tables said is kept
per service and multiplies the tables' figures.

Without a table (a service that does not report one) the wall-clock cost of each
row count seen so far stands in, as ServiceCosts measures it.
"""

from __future__ import annotations

from specmesh.step_costs import StepCosts

EWMA_WEIGHT = 0.5  # weight of the newest observation: costs move with load, follow them quickly
RATIO_WEIGHT = 0.2  # the table corrections: one odd round must not swing them
RATIO_BOUNDS = (0.02, 1000.0)  # a pipelined pre-draft makes the wait almost nothing; a busy service, long


class Ewma:
    def __init__(self, weight: float = EWMA_WEIGHT):
        self.weight = weight
        self.value: float | None = None

    def update(self, sample: float) -> None:
        self.value = sample if self.value is None else self.value + self.weight * (sample - self.value)


class ServiceCosts:
    """Wall-clock costs as rounds show them, by verified row count and per drafted token."""

    def __init__(self):
        self.verify_by_rows: dict[int, Ewma] = {}
        self.draft_per_token = Ewma()

    def observe(self, drafted: int, draft_s: float, verify_s: float, fresh: bool = False) -> None:
        """fresh: the draft was idle for a while; its old cost is stale, take the new one as it is."""
        self.verify_by_rows.setdefault(drafted + 1, Ewma()).update(verify_s)
        if drafted:
            if fresh:
                self.draft_per_token.value = None
            self.draft_per_token.update(draft_s / drafted)

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


def step_s(table: StepCosts, rows: int) -> float:
    """A step of `rows` rows, padded as the service pads it."""
    return table.cost(rows + table.padding(rows))


class RoundCosts:
    """Predicted draft and verification seconds of a round, shared by every request of an orchestrator."""

    def __init__(self, reports=None):
        self.reports = reports  # orchestrator.deployment.step_reports.StepReports, or None
        self.observed = ServiceCosts()
        self.verify_ratio = Ewma(RATIO_WEIGHT)
        self.draft_ratio = Ewma(RATIO_WEIGHT)

    def _table(self, role: str) -> StepCosts | None:
        return getattr(self.reports, role, None) if self.reports is not None else None

    def _tables(self) -> tuple[StepCosts, StepCosts] | None:
        """(target, draft) tables, or None: a round is priced from both services' tables or from neither."""
        target, draft = self._table("target"), self._table("draft")
        return (target, draft) if target is not None and draft is not None else None

    @property
    def known(self) -> bool:
        """Whether a round can be priced at all: both tables, or a timed draft round."""
        return self._tables() is not None or self.observed.known

    def verify_s(self, rows: int, other_rows: int = 0) -> float:
        tables = self._tables()
        if tables is None:
            return self.observed.verify_s(rows)
        return step_s(tables[0], rows + other_rows) * (self.verify_ratio.value or 1.0)

    def draft_s(self, k: int, drafting: int = 1) -> float:
        tables = self._tables()
        if tables is None:
            return self.observed.draft_s(k)
        return k * step_s(tables[1], max(1, drafting)) * (self.draft_ratio.value or 1.0)

    def round_s(self, k: int, other_rows: int = 0, other_drafting: int = 0) -> float:
        draft = self.draft_s(k, other_drafting + 1) if k else 0.0
        return draft + self.verify_s(k + 1, other_rows)

    def observe(self, drafted: int, draft_s: float, verify_s: float, other_rows: int = 0,
                other_drafting: int = 0, fresh: bool = False) -> None:
        """One round's wall-clock times, with the batch it was planned against."""
        self.observed.observe(drafted, draft_s, verify_s, fresh)
        target, draft = self._table("target"), self._table("draft")
        if target is not None:
            self.verify_ratio.update(_bounded(verify_s / step_s(target, drafted + 1 + other_rows)))
        if draft is not None and drafted:
            predicted = drafted * step_s(draft, other_drafting + 1)
            if fresh:
                self.draft_ratio.value = None
            self.draft_ratio.update(_bounded(draft_s / predicted))


def _bounded(ratio: float) -> float:
    low, high = RATIO_BOUNDS
    return min(high, max(low, ratio))
