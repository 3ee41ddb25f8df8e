"""What a forward of T rows costs on this machine, measured at start-up, for the step planner.

Two decisions hang on it. Row padding: on a CPU, MKL's fp32 GEMM can cost a full weight
pass per row for 2, 3 or 5-7 rows but one for 4 or 8 (README, "Figures"), so a step of
T rows is padded up to the cheapest T' >= T. Prefill chunking: while streams decode, a
step may add prefill rows only as long as it costs at most `slowdown` times the decode
rows alone, so a long prompt never holds their next tokens back by more than that.

Both decisions keep the start-up table (`measured`): one slow step must not flip
padding, and ChunkSteering already steers chunks by what steps really take. What the
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
OUTLIER_FACTOR = 4.0  # one step counts as at most this many times its entry (a GC pause is not the new cost)


class StepCosts:
    def __init__(self, seconds: dict[int, float]):
        if not seconds:
            raise ValueError("no measurements")
        self.measured = dict(sorted(seconds.items()))  # the start-up table: planning decisions use it
        # Current costs, replaced whole (never changed in place) by observe() on the model worker,
        # so a reader on another thread always holds one consistent table.
        self.seconds = dict(self.measured)
        self.padded_rows = {rows: self._cheapest_at_least(rows) for rows in self.measured}
        self._allowances: dict[tuple[int, float], int] = {}

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
    def from_proto(cls, entries: Iterable[common_pb2.StepCost]) -> "StepCosts | None":
        """The table a service reported (ModelInfo.step_costs); None when it reported none.

        Garbage never raises: entries with zero rows or seconds that are not positive and
        finite are dropped (a later duplicate size wins), and past MAX_REPORTED_SIZES sizes the
        largest."""
        seconds = {int(entry.rows): float(entry.seconds) for entry in entries
                   if entry.rows > 0 and math.isfinite(entry.seconds) and entry.seconds > 0}
        kept = dict(sorted(seconds.items())[:MAX_REPORTED_SIZES])
        return cls(kept) if kept else None

    def to_proto(self) -> list[common_pb2.StepCost]:
        """The current table as ModelInfo.step_costs entries, smallest size first."""
        return [common_pb2.StepCost(rows=rows, seconds=seconds) for rows, seconds in self.seconds.items()]

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

    def cost(self, rows: int) -> float:
        """Seconds for `rows` rows now: measured (and kept current) or interpolated."""
        return _interpolated(self.seconds, rows)

    def padding(self, rows: int) -> int:
        """Rows to add to a step of `rows` so that it runs at the cheapest measured size."""
        return self.padded_rows.get(rows, rows) - rows

    def prefill_allowance(self, decode_rows: int, slowdown: float = 2.0) -> int:
        """The most prefill rows a step of decode_rows may add and cost <= slowdown x without them
        (by the start-up table: ChunkSteering corrects it online)."""
        if decode_rows == 0:
            return max(self.measured)
        key = (decode_rows, slowdown)
        if key not in self._allowances:
            budget, extra = slowdown * _interpolated(self.measured, decode_rows), 0
            while extra < max(self.measured) and _interpolated(self.measured, decode_rows + extra + 1) <= budget:
                extra += 1
            self._allowances[key] = extra
        return self._allowances[key]

    def _cheapest_at_least(self, rows: int) -> int:
        best = rows
        for size, seconds in self.measured.items():
            if rows < size <= 2 * rows and seconds < PAD_GAIN * self.measured[best]:
                best = size
        return best


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
    """Prefill rows per step beside decode rows, steered by what steps really take.

    The start-up costs are for fresh caches; a long prompt's later chunks also attend
    over everything before them, and a batched step copies its sessions' caches, so a
    chunk the table calls cheap can cost several decode steps. After each step with both
    decode rows and a chunk, the chunk is rescaled from the rows that step fed when it
    took more than `slowdown` x a decode-only step (their running mean), and grows by an
    eighth, up to the table's chunk, when it took clearly less (below HEADROOM of the
    limit): grown faster, it overshot the limit by a quarter before each correction.
    """

    HEADROOM = 0.9

    def __init__(self, slowdown: float, minimum: int = 8, maximum: int = 2048, weight: float = 0.3):
        self.slowdown, self.minimum, self.maximum, self.weight = slowdown, minimum, maximum, weight
        self.decode_s: float | None = None
        self.rows: int | None = None  # the steered chunk; None until a step with both ran

    def allowance(self, planned: int) -> int:
        """The chunk for the next step, `planned` being what the cost table allows."""
        return planned if self.rows is None else min(planned, self.rows)

    def observe(self, decode_rows: int, prefill_rows: int, seconds: float, planned: int) -> None:
        if decode_rows and not prefill_rows:
            self.decode_s = seconds if self.decode_s is None else self.decode_s + self.weight * (seconds - self.decode_s)
        elif decode_rows and prefill_rows and self.decode_s:
            ratio = seconds / self.decode_s
            rows = self.allowance(planned)
            if ratio > self.slowdown:  # from what this step fed (a prompt's last chunk may be short)
                rows = int(prefill_rows * self.slowdown / ratio)
            elif ratio < self.HEADROOM * self.slowdown:
                rows = min(planned, rows + max(1, rows // 8))
            self.rows = max(self.minimum, min(self.maximum, rows))
