"""What a forward of T rows costs on this machine, measured at start-up, and what steps cost now.

Two decisions hang on the start-up table (`measured`: one session's step by rows on a
fresh cache). Row padding: on a CPU, fp32 GEMM can cost a full weight pass per row for
2, 3 or 5-7 rows but one for 4 or 8, so a step of T rows is padded up to the cheapest
T' >= T. Prefill chunking: while streams decode, a step may add prefill rows only as long
as it costs at most `slowdown` times the decode rows alone (ChunkSteering corrects the
table's view of that online). Both keep the start-up table: one slow step must not flip them.

What a decode step costs now, with several sessions and their cached context in it, is
the table corrected by a model fitted to the steps the service runs (specmesh.engine.step_model);
services report both (ModelInfo.planned_step_costs, ModelInfo.step_model) to the
orchestrator's draft-length policy.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Iterable

from specmesh.ewma import Ewma
from specmesh.engine.step_model import StepModel, StepShape
from specmesh.timing_noise import PICK_GAIN
from specmesh.v1 import common_pb2

# Every size where padding decisions and one session's verification (drafts, then alternatives) live,
# then a few to extrapolate chunk costs from: a CPU GEMM's cost jumps past 8 rows, which interpolating
# from 8 to 12 would hide (what the table costs at start-up: docs/design/tuning.md).
MEASURED_ROWS = tuple(range(1, 13)) + (16, 24, 32, 48, 64)
# Past MEASURED_ROWS the table doubles its size while a doubling costs less than this many times the size
# before it: a GPU's step of a few hundred rows costs little more than one of 64 (the weights' read
# dominates), so priced in proportion to its rows a batch's drafting round would look several times
# dearer than it runs. Once a doubling costs about double, the step is compute-bound and the proportion
# holds from there on (_interpolated).
COMPUTE_BOUND_GROWTH = 1.8
MAX_REPORTED_SIZES = 256  # of a reported table (from_proto): a bad report stays cheap to read
MIN_PREFILL_CHUNK = 8  # rows a prefill moves in a step at the least, whatever the budget
EFFICIENT_CHUNK = 1.15  # a chunk that must pass the budget anyway may cost this much more than the smallest
OUTLIER_FACTOR = 4.0  # one step counts as at most this many times its prediction (a GC pause is not the new cost)


class StepCosts:
    def __init__(self, seconds: dict[int, float], model: StepModel | None = None):
        """`seconds`: the start-up table; `model`: what steps cost now over it (a report's, or fitted here)."""
        if not seconds:
            raise ValueError("no measurements")
        self.measured = dict(sorted(seconds.items()))  # the start-up table: planning decisions use it
        # Fitted on the model worker; readers on other threads see its coefficients as one tuple.
        self.model = model or StepModel()
        self.padded_rows = {rows: self._cheapest_at_least(rows) for rows in self.measured}
        self._allowances: dict[tuple[int, float], int] = {}

    @classmethod
    def measure(cls, forward_rows: Callable[[int], None], sizes=MEASURED_ROWS, repeats: int = 2,
                largest: int | None = None) -> "StepCosts":
        """forward_rows(T) runs one forward of T new rows on a fresh cache; the fastest of `repeats`
        (noise only ever adds time). The repeats are passes over every size, not back-to-back runs
        of one, so that a disturbance of a few seconds (another process starting beside this one)
        inflates one pass, never every sample of the sizes it hits. Given `largest` (the most rows a
        step may take), the first pass goes on past `sizes`, doubling, up to it or until a step is
        compute-bound (COMPUTE_BOUND_GROWTH), and the later passes time those sizes too."""
        seconds: dict[int, float] = {}

        def timed(rows: int) -> float:
            start = time.perf_counter()
            forward_rows(rows)
            elapsed = time.perf_counter() - start
            seconds[rows] = min(elapsed, seconds.get(rows, elapsed))
            return elapsed

        for rows in sizes:
            if largest is None or rows <= largest:
                timed(rows)
        size = max(seconds)
        while largest is not None and 2 * size <= largest and timed(2 * size) < COMPUTE_BOUND_GROWTH * seconds[size]:
            size *= 2
        for _ in range(repeats - 1):
            for rows in list(seconds):  # the first pass's sizes, grown ones included
                timed(rows)
        return cls(seconds)

    @classmethod
    def from_proto(cls, info: common_pb2.ModelInfo) -> "StepCosts | None":
        """The costs a service reported (ModelInfo.planned_step_costs and step_model; a service that
        sends only step_costs has them stand in for the start-up table); None when it reported none.

        Garbage never raises: entries with zero rows or seconds that are not positive and finite are
        dropped (a later duplicate size wins), past MAX_REPORTED_SIZES sizes the largest, and a model
        outside its bounds is brought within them."""
        table = _valid_entries(info.planned_step_costs) or _valid_entries(info.step_costs)
        if not table:
            return None
        return cls(table, StepModel.from_proto(info.step_model) if info.HasField("step_model") else None)

    def to_proto(self) -> list[common_pb2.StepCost]:
        """One session's step now at each start-up size (ModelInfo.step_costs), smallest first."""
        return _entries(self.seconds)

    def planned_to_proto(self) -> list[common_pb2.StepCost]:
        """The start-up table as ModelInfo.planned_step_costs entries, smallest size first."""
        return _entries(self.measured)

    @property
    def seconds(self) -> dict[int, float]:
        """One session's step now, by the start-up sizes (one fit throughout, whatever the worker does)."""
        model = StepModel(self.model.coefficients)
        return {rows: self.step_s(StepShape(1, rows), model) for rows in self.measured}

    def observe(self, shape: StepShape, seconds: float) -> None:
        """A decode-only step of `shape` (its rows padded as it ran) took `seconds`: fit the model to it."""
        if not math.isfinite(seconds) or seconds <= 0:
            return
        planned = self.planned_cost(shape.rows)
        self.model.observe(planned, shape, min(seconds, OUTLIER_FACTOR * self.model.predict(planned, shape)))

    def step_s(self, shape: StepShape, model: StepModel | None = None) -> float:
        """Seconds of a step of `shape` now, its rows padded as the service pads them."""
        padded = StepShape(shape.sessions, shape.rows + self.padding(shape.rows), shape.attended)
        return (model or self.model).predict(self.planned_cost(padded.rows), padded)

    def cost(self, rows: int) -> float:
        """Seconds of one session's step of `rows` rows now."""
        return self.step_s(StepShape(1, rows))

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
        GEMM costs far more for 4 rows than for 3, any chunk beside 3 decode rows does), the
        chunk takes every row that costs at most EFFICIENT_CHUNK x what those would: a step
        that must pass the budget to move the prompt at all had best move it far, or the
        prompt takes many such steps (docs/design/tuning.md)."""
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
            self._allowances[key] = self._most_rows_within(decode_rows, budget)
        return self._allowances[key]

    def _most_rows_within(self, decode_rows: int, budget: float) -> int:
        """The most rows a step of decode_rows may add and cost at most `budget` by the start-up table, up to
        its largest size. The scan ends once a step costs twice the budget: padding makes some sizes cheaper
        than smaller ones, never by half, and a table measured to thousands of rows is not read row by row."""
        most = 0
        for extra in range(max(self.measured) + 1):
            cost = self.planned_cost(decode_rows + extra)
            if cost <= budget:
                most = extra
            elif cost > 2.0 * budget:
                break
        return most

    def _cheapest_at_least(self, rows: int) -> int:
        best = rows
        for size, seconds in self.measured.items():
            if rows < size <= 2 * rows and seconds < PICK_GAIN * self.measured[best]:
                best = size
        return best


def _valid_entries(entries: Iterable[common_pb2.StepCost]) -> dict[int, float]:
    seconds = {int(entry.rows): float(entry.seconds) for entry in entries
               if entry.rows > 0 and math.isfinite(entry.seconds) and entry.seconds > 0}
    return dict(sorted(seconds.items())[:MAX_REPORTED_SIZES])


def _entries(seconds: dict[int, float]) -> list[common_pb2.StepCost]:
    return [common_pb2.StepCost(rows=rows, seconds=cost) for rows, cost in seconds.items()]


def _interpolated(table: dict[int, float], rows: int) -> float:
    """Seconds for `rows` rows by `table`: its entry or linear between entries; past the largest
    size, in proportion to it (the table is measured until a step is compute-bound or as large as a
    step may be: StepCosts.measure; and a noisy slope must never make a huge chunk look cheap)."""
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
        self.decode_ratio = Ewma(weight)
        self.chunk_ratio = Ewma(weight)

    def observe(self, decode_rows: int, prefill_rows: int, seconds: float, table_seconds: float) -> None:
        if not decode_rows or not table_seconds > 0 or not seconds > 0:
            return
        (self.chunk_ratio if prefill_rows else self.decode_ratio).update(seconds / table_seconds)

    @property
    def correction(self) -> float:
        if self.decode_ratio.value is None or self.chunk_ratio.value is None:
            return 1.0
        return min(self.MAX_CORRECTION, self.decode_ratio.value / self.chunk_ratio.value)


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
