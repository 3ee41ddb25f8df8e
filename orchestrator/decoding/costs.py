"""What a round will cost, predicted from the services' own step costs and corrected by what rounds took.

Each service measures its forward step by rows at start-up and keeps the table
current (specmesh.step_costs; reported in ModelInfo, collected in
orchestrator.deployment.step_reports). A round of the batch, this request drafting
k tokens, costs

    the draft steps of the requests that draft (over all of them at once)
    +  one target step over the rows of the requests that do not draft
    +  one target step over the rows of the requests that draft

as the tables price them. Two target steps, not one: a request that drafts reaches the
target a draft's worth of time after those that do not, and the target waits for late
calls only a fraction of a step (specmesh.batching), so a batch that mixes the two runs
a step for each. Alone, or with every request drafting, that is one step again. (Priced
as one shared step, a request beside seven target-only ones saw its draft cost little,
drafted, and split every step in two: speculation on lost 16 % to off at concurrency 8.)

Steps are padded the way the services pad them (on a CPU 4 rows can cost what 1
does). The tables know nothing of the network, of queueing behind
other orchestrators' sessions, or of two services sharing cores; the ratio between
what rounds really took (wall clock, seen here) and what the tables said is kept
per service and multiplies the tables' figures.

Without a table (a service that does not report one) the wall-clock cost of each
row count seen so far stands in, as ServiceCosts measures it.
"""

from __future__ import annotations

from dataclasses import dataclass

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


def step_s(table: StepCosts, rows: int, extra_rows: int = 0, premium: bool = False) -> float:
    """A step of `rows` rows, one a session, padded as the service pads it; `extra_rows` more rows of the
    same sessions (a draft's tokens, or prompt lookup's) make it the dearer of two prices: the current
    table's at the total size, and the sessions' own step now grown as the start-up table grows from
    their rows to the total.

    The current table keeps current only the sizes that run; the others keep their start-up cost, one
    session's on a fresh cache, and a step of many sessions costs more than one session's rows of the
    same count. On the 2-core EPYC (step log, 2026-11-26 11:00) four sessions of one row took 286 ms
    and with 10-11 rows 359-384, where the table still had 12 rows at their start-up 272: a round of
    four requests drafting two tokens each looked cheaper than one drafting none. Grown from 286 by
    the start-up table (201 ms at 4 rows, 272 at 12) it is 386. Sixteen sessions of one row: 486 ms,
    the start-up 24 rows: 429, so lookup's rows past a decode step looked free; in proportion, 16
    sessions with 19-28 rows were priced within 10 % of their 556-808 ms. The current entry stays the
    floor: where the start-up table dips (3-6 rows below 1-2 there) its growth alone underprices
    rows that have run (one session of 5 rows: 283 ms, grown from one row: 246).

    `premium`: the growth is scaled by what extra rows beside that many sessions have cost the
    service over the table's growth (StepCosts.extra_row_premium, learned from its steps). Asked
    for prompt lookup's rows, which ride steps of one-row sessions; a drafting round's rows are
    judged by what drafting delivers instead (orchestrator.decoding.regime)."""
    padded = rows + table.padding(rows)
    base = table.cost(padded)
    if not extra_rows:
        return base
    total = rows + extra_rows
    padded_total = total + table.padding(total)
    growth = table.planned_cost(padded_total) / table.planned_cost(padded) - 1.0
    if premium and growth > 0:  # where the table dips, its growth says nothing a premium could scale
        growth *= table.extra_row_premium(rows)
    grown = base * (1.0 + growth)
    return max(grown, table.cost(padded_total))


def target_steps_s(table: StepCosts, steady_rows: int, drafting_rows: int, lookup_rows: int = 0,
                   drafting: int = 0) -> float:
    """A round's target steps by `table`: one over the rows of requests that do not draft (`lookup_rows`
    of them prompt lookup's), one over the rows of the `drafting` requests that draft (module docstring)."""
    steady = step_s(table, steady_rows - lookup_rows, lookup_rows, premium=True) if steady_rows else 0.0
    if not drafting_rows:
        return steady
    sessions = max(1, min(drafting, drafting_rows))
    return steady + step_s(table, sessions, drafting_rows - sessions)


@dataclass(frozen=True)
class BatchLoad:
    """What the other requests in flight add to a round: rows verified, tokens committed, and the
    requests that draft (how many, and their rows)."""

    rows: int = 0
    tokens: float = 0.0
    drafting: int = 0
    drafting_rows: int = 0
    # Requests that have chosen no k yet (just arrived, or back from the target-only regime): they
    # run the same policy under the same regime and draft in phase with this one, so each is priced
    # as this request's round at the same k. Left out, a trial of drafting at 16 requests priced
    # every request's first round as if alone, all 16 opened drafts (catch-up prefills of their
    # whole sequences beside the target, 2.2 s gaps) and speculation on ran at 0.86x off.
    undecided: int = 0
    lookup_rows: int = 0  # of `rows`, the prompt-lookup rows of the others' target-only rounds

    def with_round(self, k: int, lookup: int = 0) -> tuple[int, int, int]:
        """(rows of requests that do not draft, rows of requests that draft, requests that draft),
        this request's round at draft length k and the undecided requests' included. A target-only
        round verifying `lookup` prompt-lookup tokens (orchestrator.decoding.lookup) adds them as rows
        to the target step it rides (no draft step), as does each undecided one, whose tokens are
        priced as this round's (tokens_with)."""
        rounds = 1 + self.undecided
        if k:
            return self.rows - self.drafting_rows, self.drafting_rows + rounds * (k + 1), self.drafting + rounds
        return self.rows - self.drafting_rows + rounds * (1 + lookup), self.drafting_rows, self.drafting

    def lookup_rows_with(self, k: int, lookup: int = 0) -> int:
        """Of with_round's rows of requests that do not draft, those of prompt lookup."""
        return self.lookup_rows + (0 if k else (1 + self.undecided) * lookup)

    def tokens_with(self, expected: float) -> float:
        """Tokens of a round of the batch where this request (and each undecided one) commits `expected`."""
        return self.tokens + (1 + self.undecided) * expected


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

    def draft_s(self, k: int, drafting: int = 1) -> float:
        tables = self._tables()
        if tables is None:
            return self.observed.draft_s(k)
        return k * step_s(tables[1], max(1, drafting)) * (self.draft_ratio.value or 1.0)

    def draft_prefill_s(self, tokens: int) -> float | None:
        """Seconds for the draft to feed `tokens` tokens at once (a prefill or a long catch-up), or
        None without its table."""
        tables = self._tables()
        return None if tables is None else step_s(tables[1], tokens) * (self.draft_ratio.value or 1.0)

    def round_s(self, k: int, batch: BatchLoad = BatchLoad(), lookup: int = 0) -> float:
        """Seconds of one round of the batch, this request drafting k tokens (module docstring), or at
        k = 0 verifying `lookup` prompt-lookup tokens."""
        steady_rows, drafting_rows, drafting = batch.with_round(k, lookup)
        draft_steps = max(k, (drafting_rows - drafting) / drafting if drafting else 0.0)
        draft = self.draft_s(1, drafting) * draft_steps if drafting else 0.0
        return draft + self._verify_steps_s(steady_rows, drafting_rows, batch.lookup_rows_with(k, lookup), drafting)

    def _verify_steps_s(self, steady_rows: int, drafting_rows: int, lookup_rows: int, drafting: int) -> float:
        tables = self._tables()
        if tables is None:
            return sum(self.observed.verify_s(rows) for rows in (steady_rows, drafting_rows) if rows)
        return target_steps_s(tables[0], steady_rows, drafting_rows, lookup_rows, drafting) * (
            self.verify_ratio.value or 1.0)

    def observe(self, drafted: int, draft_s: float, verify_s: float, batch: BatchLoad = BatchLoad(),
                fresh: bool = False, lookup: int = 0) -> None:
        """One round's wall-clock times, with the batch it was planned against."""
        if not lookup:  # the wall-clock fallback keys verifications by the draft's rows
            self.observed.observe(drafted, draft_s, verify_s, fresh)
        target, draft = self._table("target"), self._table("draft")
        if target is not None:
            steady_rows, drafting_rows, drafting = batch.with_round(drafted, lookup)
            predicted = target_steps_s(target, steady_rows, drafting_rows, batch.lookup_rows_with(drafted, lookup),
                                       drafting)
            self.verify_ratio.update(_bounded(verify_s / predicted))
        if draft is not None and drafted:
            predicted = drafted * step_s(draft, batch.drafting + 1)
            if fresh:
                self.draft_ratio.value = None
            self.draft_ratio.update(_bounded(draft_s / predicted))


def _bounded(ratio: float) -> float:
    low, high = RATIO_BOUNDS
    return min(high, max(low, ratio))
