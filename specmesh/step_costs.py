"""What a forward of T rows costs on this machine, measured at start-up, for the step planner.

Two decisions hang on it. Row padding: on a CPU, MKL's fp32 GEMM can cost a full weight
pass per row for 2, 3 or 5-7 rows but one for 4 or 8 (README, "Figures"), so a step of
T rows is padded up to the cheapest T' >= T. Prefill chunking: while streams decode, a
step may add prefill rows only as long as it costs at most `slowdown` times the decode
rows alone, so a long prompt never holds their next tokens back by more than that
(ChunkSteering corrects the table's view of that online).

Both decisions keep the start-up table (`measured`): one slow step must not flip
padding, and ChunkSteering corrects chunks by what steps really take. What the
table says a step costs *now* (`seconds`, `cost`) follows decode-only steps online
(`observe`), and services report it (ModelInfo.step_costs) to the orchestrator's
draft-length policy.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Iterable

from specmesh.v1 import common_pb2

# Every size where padding decisions live, then a few to extrapolate chunk costs from.
# About 20 s at start-up for a 1.5B fp32 model on 2 CPU cores; milliseconds on a GPU.
MEASURED_ROWS = tuple(range(1, 9)) + (12, 16, 24, 32, 48, 64)
PAD_GAIN = 0.9  # pad only to a size at least 10 % cheaper: measurements are noisy
OBSERVED_WEIGHT = 0.2  # of each new step in its size's entry: about the last five steps count
MAX_REPORTED_SIZES = 256  # of a reported table (from_proto): a bad report stays cheap to read
MIN_PREFILL_CHUNK = 8  # rows a prefill moves in a step at the least, whatever the budget
EFFICIENT_CHUNK = 1.15  # a chunk that must pass the budget anyway may cost this much more than the smallest
OUTLIER_FACTOR = 4.0  # one step counts as at most this many times its entry (a GC pause is not the new cost)
PREMIUM_DECAY = 0.97  # of a premium's sums at each step of its load: about the last 30 such steps count
PREMIUM_BOUNDS = (0.5, 4.0)  # a learned premium stays within these
MIN_PREMIUM_STEPS = 3  # steps with extra rows a load sees before its premium is reported


class StepCosts:
    def __init__(self, seconds: dict[int, float], current: dict[int, float] | None = None):
        """`seconds`: the start-up table; `current`: the costs now, where they have moved (a report's)."""
        if not seconds:
            raise ValueError("no measurements")
        self.measured = dict(sorted(seconds.items()))  # the start-up table: planning decisions use it
        # Current costs, replaced whole (never changed in place) by observe() on the model worker,
        # so a reader on another thread always holds one consistent table.
        self.seconds = dict(sorted(current.items())) if current else dict(self.measured)
        self.padded_rows = {rows: self._cheapest_at_least(rows) for rows in self.measured}
        self._allowances: dict[tuple[int, float], int] = {}
        self.premiums = RowPremiums()

    @classmethod
    def measure(cls, forward_rows: Callable[[int], None], sizes=MEASURED_ROWS, repeats: int = 2) -> "StepCosts":
        """forward_rows(T) runs one forward of T new rows on a fresh cache; the fastest of `repeats`
        (noise only ever adds time). The repeats are passes over every size, not back-to-back runs
        of one: a disturbance of a few seconds (another process starting beside this one) then
        inflates one pass, never every sample of the sizes it hits. Measured at start-up with the
        draft still loading beside it, back-to-back repeats put the 1.5B target's one-row step at
        449 ms where decoding ran at 307 ms a token."""
        seconds: dict[int, float] = {}
        for _ in range(repeats):
            for rows in sizes:
                start = time.perf_counter()
                forward_rows(rows)
                elapsed = time.perf_counter() - start
                seconds[rows] = min(elapsed, seconds.get(rows, elapsed))
        return cls(seconds)

    @classmethod
    def from_proto(cls, entries: Iterable[common_pb2.StepCost],
                   planned: Iterable[common_pb2.StepCost] = (),
                   premiums: Iterable[common_pb2.RowPremium] = ()) -> "StepCosts | None":
        """The table a service reported (ModelInfo.step_costs, its start-up measurements in
        ModelInfo.planned_step_costs, its extra-row premiums in ModelInfo.extra_row_premiums);
        None when it reported none. Without start-up entries (a service that does not send
        them) the current ones stand in for them.

        Garbage never raises: entries with zero rows or seconds that are not positive and
        finite are dropped (a later duplicate size wins), and past MAX_REPORTED_SIZES sizes the
        largest; premiums outside PREMIUM_BOUNDS are brought within them."""
        current = _valid_entries(entries)
        if not current:
            return None
        costs = cls(_valid_entries(planned) or current, current)
        costs.premiums.reported(premiums)
        return costs

    def to_proto(self) -> list[common_pb2.StepCost]:
        """The current table as ModelInfo.step_costs entries, smallest size first."""
        return _entries(self.seconds)

    def planned_to_proto(self) -> list[common_pb2.StepCost]:
        """The start-up table as ModelInfo.planned_step_costs entries, smallest size first."""
        return _entries(self.measured)

    def observe(self, rows: int, seconds: float) -> None:
        """A decode-only step of `rows` rows (padding included) took `seconds`: move that size's
        entry towards it (EWMA). Sizes not in the table change nothing: their cost is
        interpolated from the measured ones, and a step padded to a measured size reports
        that size (the planner pads to one wherever it pays)."""
        current = self.seconds.get(rows)
        if current is None or not math.isfinite(seconds) or seconds <= 0:
            return
        sample = min(seconds, OUTLIER_FACTOR * current)
        updated = dict(self.seconds)
        updated[rows] = current + OBSERVED_WEIGHT * (sample - current)
        self.seconds = updated

    def observe_extra_rows(self, sessions: int, rows: int, seconds: float) -> None:
        """A decode-only step of `sessions` sessions (two or more) with `rows` rows in all took
        `seconds`: learn how much more than the start-up table's growth its extra rows cost
        (RowPremiums), against the current cost of the sessions' one-row step."""
        if sessions < 2 or rows <= sessions or not math.isfinite(seconds) or seconds <= 0:
            return
        base = self.cost(sessions + self.padding(sessions))
        growth = base * (self.planned_cost(rows + self.padding(rows)) /
                         self.planned_cost(sessions + self.padding(sessions)) - 1.0)
        self.premiums.observe(sessions, growth, min(seconds, OUTLIER_FACTOR * (base + max(growth, 0.0))) - base)

    def extra_row_premium(self, sessions: int) -> float:
        """How many times the start-up table's growth extra rows cost beside `sessions` sessions (1 unknown)."""
        return self.premiums.premium(sessions)

    def cost(self, rows: int) -> float:
        """Seconds for `rows` rows now: measured (and kept current) or interpolated."""
        return _interpolated(self.seconds, rows)

    def padding(self, rows: int) -> int:
        """Rows to add to a step of `rows` so that it runs at the cheapest measured size."""
        return self.padded_rows.get(rows, rows) - rows

    def planned_cost(self, rows: int) -> float:
        """Seconds for `rows` rows by the start-up table (what planning decisions use)."""
        return _interpolated(self.measured, rows)

    def prefill_allowance(self, decode_rows: int, slowdown: float = 2.0, correction: float = 1.0) -> int:
        """The most prefill rows a step of decode_rows may add, by the start-up table.

        The step may cost `slowdown` x the decode rows alone, `correction` (ChunkSteering:
        how much dearer steps with a chunk really run than decode-only ones, relative to the
        table) scaling that. Where even MIN_PREFILL_CHUNK rows would pass it (on a CPU whose
        GEMM costs 1.7x more for 4 rows than for 3, any chunk beside 3 decode rows does), the
        chunk takes every row that costs at most EFFICIENT_CHUNK x what those would: a step
        that must pass the budget to move the prompt at all had best move it far, or the
        prompt takes many such steps (8 rows a step, a 40-token prompt held 5 steps of 2.5x
        where one of 2.8x would do)."""
        if decode_rows == 0:
            return max(self.measured)
        key = (decode_rows, round(slowdown, 2), round(correction, 2))
        if key not in self._allowances:
            if len(self._allowances) > 4096:  # the corrections wander: keep the memo bounded
                self._allowances.clear()
            alone = self.planned_cost(decode_rows)
            budget = slowdown * correction * alone
            smallest = self.planned_cost(decode_rows + MIN_PREFILL_CHUNK)
            if smallest > budget:
                budget = max(budget, EFFICIENT_CHUNK * smallest * min(1.0, correction))
            self._allowances[key] = max((extra for extra in range(max(self.measured) + 1)
                                         if self.planned_cost(decode_rows + extra) <= budget), default=0)
        return self._allowances[key]

    def _cheapest_at_least(self, rows: int) -> int:
        best = rows
        for size, seconds in self.measured.items():
            if rows < size <= 2 * rows and seconds < PAD_GAIN * self.measured[best]:
                best = size
        return best


def premium_bucket(sessions: int) -> int:
    """The largest session count of the load bucket `sessions` falls in: 2, 4, 8, 16, ..."""
    return 1 << max(1, math.ceil(math.log2(max(sessions, 2))))


class RowPremiums:
    """How much more than the start-up table's growth a step's extra rows cost, by load.

    The table times one session's rows over a fresh cache. Under load the extra rows (a
    verification's, prompt lookup's) sit beside several one-row sessions, and there they cost
    more: on the embedded pair eight one-row sessions with 5-7 more rows took 1.19-1.28x the
    eight-row step where the table grows 1.11-1.17x (step log, 2026-11-26 14:12), so lookup's
    rows were priced at 0.4-0.6x their cost and speculation on lost 2 % to off at concurrency 8.
    Per bucket of sessions, a least-squares slope through the origin of the extra seconds steps
    took over their base (the sessions' one-row step now) against the growth the table priced,
    its sums decayed (PREMIUM_DECAY) so that it follows the load. A slope over many steps, not
    a price per size: one noisy step moves it by a few percent (a size priced from its first
    step was priced out for good)."""

    def __init__(self):
        self._sums: dict[int, tuple[float, float, int]] = {}  # bucket -> (sum growth*extra, sum growth^2, steps)
        self.learned: dict[int, float] = {}  # bucket -> premium; replaced whole (read on other threads)

    def observe(self, sessions: int, growth_s: float, extra_s: float) -> None:
        """A step's extra seconds over its base, where the table priced `growth_s` (positive only:
        where the table dips, its growth says nothing of what rows cost)."""
        if not growth_s > 0 or not math.isfinite(extra_s):
            return
        bucket = premium_bucket(sessions)
        xy, xx, steps = self._sums.get(bucket, (0.0, 0.0, 0))
        xy, xx = PREMIUM_DECAY * xy + growth_s * extra_s, PREMIUM_DECAY * xx + growth_s * growth_s
        self._sums[bucket] = (xy, xx, steps + 1)
        if steps + 1 >= MIN_PREMIUM_STEPS:
            self.learned = {**self.learned, bucket: _within(xy / xx, PREMIUM_BOUNDS)}

    def premium(self, sessions: int) -> float:
        return self.learned.get(premium_bucket(sessions), 1.0) if sessions >= 2 else 1.0

    def reported(self, entries: Iterable[common_pb2.RowPremium]) -> None:
        """Take a service's reported premiums (ModelInfo.extra_row_premiums); garbage is dropped."""
        self.learned = {premium_bucket(entry.sessions): _within(entry.premium, PREMIUM_BOUNDS)
                        for entry in list(entries)[:MAX_REPORTED_SIZES]
                        if entry.sessions >= 2 and math.isfinite(entry.premium)}

    def to_proto(self) -> list[common_pb2.RowPremium]:
        return [common_pb2.RowPremium(sessions=bucket, premium=premium)
                for bucket, premium in sorted(self.learned.items())]


def _within(value: float, bounds: tuple[float, float]) -> float:
    return min(bounds[1], max(bounds[0], value))


def _valid_entries(entries: Iterable[common_pb2.StepCost]) -> dict[int, float]:
    seconds = {int(entry.rows): float(entry.seconds) for entry in entries
               if entry.rows > 0 and math.isfinite(entry.seconds) and entry.seconds > 0}
    return dict(sorted(seconds.items())[:MAX_REPORTED_SIZES])


def _entries(seconds: dict[int, float]) -> list[common_pb2.StepCost]:
    return [common_pb2.StepCost(rows=rows, seconds=cost) for rows, cost in seconds.items()]


def _interpolated(table: dict[int, float], rows: int) -> float:
    """Seconds for `rows` rows by `table`: its entry or linear between entries; past the largest
    size, in proportion to it (large steps are compute-bound, and a noisy slope must never make
    a huge chunk look cheap)."""
    sizes = list(table)
    if rows in table:
        return table[rows]
    if rows < sizes[0]:
        return table[sizes[0]]
    if rows > sizes[-1]:
        return table[sizes[-1]] * rows / sizes[-1]
    below = max(size for size in sizes if size < rows)
    above = min(size for size in sizes if size > rows)
    slope = (table[above] - table[below]) / (above - below)
    return table[below] + slope * (rows - below)


class ChunkSteering:
    """How much dearer steps with a prefill chunk really run than decode-only ones, next to the table.

    The start-up table times one session over a fresh cache. Real steps run dearer: a step
    of several sessions attends over each one's cache, and a long prompt's later chunks
    attend over everything before them, which a fresh cache never shows. Each step's time
    over what the table says for its rows is followed (EWMA) for decode-only steps and for
    steps with both decode rows and a chunk; `correction` is their quotient (at most
    MAX_CORRECTION), by which the planner scales the slowdown it allows a chunk
    (StepCosts.prefill_allowance): when chunks run dearer than the table says, relative to
    decode steps, they shrink, and when that passes, they grow back.
    """

    MAX_CORRECTION = 1.5

    def __init__(self, weight: float = 0.3):
        self.weight = weight
        self.decode_ratio: float | None = None
        self.chunk_ratio: float | None = None

    def observe(self, decode_rows: int, prefill_rows: int, seconds: float, table_seconds: float) -> None:
        if not decode_rows or not table_seconds > 0 or not seconds > 0:
            return
        ratio = seconds / table_seconds
        if prefill_rows:
            self.chunk_ratio = self._moved(self.chunk_ratio, ratio)
        else:
            self.decode_ratio = self._moved(self.decode_ratio, ratio)

    def _moved(self, current: float | None, ratio: float) -> float:
        return ratio if current is None else current + self.weight * (ratio - current)

    @property
    def correction(self) -> float:
        if self.decode_ratio is None or self.chunk_ratio is None:
            return 1.0
        return min(self.MAX_CORRECTION, self.decode_ratio / self.chunk_ratio)


class PrefillThroughput:
    """Prompt rows a service feeds per second of steps that carry them, for admission by expected wait.

    Decayed sums of the prefill rows and the seconds of every step that fed some: beside
    decoding streams a chunk gets only part of each step, on an idle service whole prompts go
    in, and the rate follows whichever the service is doing. Before any such step, the table's
    largest measured step stands in (a lone prefill at full speed: the optimistic end).
    """

    def __init__(self, decay: float = 0.9):
        self.decay = decay
        self.rows = 0.0
        self.seconds = 0.0

    def observe(self, prefill_rows: int, seconds: float) -> None:
        if prefill_rows <= 0 or not seconds > 0:
            return
        self.rows = self.decay * self.rows + prefill_rows
        self.seconds = self.decay * self.seconds + seconds

    def seconds_for(self, rows: int, table: StepCosts | None) -> float | None:
        """Seconds to feed `rows` prompt rows at the rate seen (None: no way to tell)."""
        if self.rows > 0:
            return rows * self.seconds / self.rows
        if table is None:
            return None
        largest = max(table.measured)
        return rows * table.planned_cost(largest) / largest
