"""What a forward of T rows costs on this machine, measured at start-up, for the step planner.

Two decisions hang on it. Row padding: on a CPU, MKL's fp32 GEMM can cost a full weight
pass per row for 2, 3 or 5-7 rows but one for 4 or 8 (README, "Figures"), so a step of
T rows is padded up to the cheapest T' >= T. Prefill chunking: while streams decode, a
step may add prefill rows only as long as it costs at most `slowdown` times the decode
rows alone, so a long prompt never holds their next tokens back by more than that.
"""

from __future__ import annotations

import time
from typing import Callable

# Every size where padding decisions live, then a few to extrapolate chunk costs from.
# About 20 s at start-up for a 1.5B fp32 model on 2 CPU cores; milliseconds on a GPU.
MEASURED_ROWS = tuple(range(1, 9)) + (12, 16, 24, 32, 48, 64)
PAD_GAIN = 0.9  # pad only to a size at least 10 % cheaper: measurements are noisy


class StepCosts:
    def __init__(self, seconds: dict[int, float]):
        if not seconds:
            raise ValueError("no measurements")
        self.seconds = dict(sorted(seconds.items()))
        self.padded_rows = {rows: self._cheapest_at_least(rows) for rows in self.seconds}
        self._allowances: dict[tuple[int, float], int] = {}

    @classmethod
    def measure(cls, forward_rows: Callable[[int], None], sizes=MEASURED_ROWS, repeats: int = 2) -> "StepCosts":
        """forward_rows(T) runs one forward of T new rows on a fresh cache; the fastest of `repeats`
        (noise only ever adds time)."""
        seconds = {}
        for rows in sizes:
            samples = []
            for _ in range(repeats):
                start = time.perf_counter()
                forward_rows(rows)
                samples.append(time.perf_counter() - start)
            seconds[rows] = min(samples)
        return cls(seconds)

    def cost(self, rows: int) -> float:
        """Seconds for `rows` rows: measured or interpolated; past the largest measured size, in
        proportion to it (large steps are compute-bound, and a noisy slope must never make a
        huge chunk look cheap)."""
        sizes = list(self.seconds)
        if rows in self.seconds:
            return self.seconds[rows]
        if rows < sizes[0]:
            return self.seconds[sizes[0]]
        if rows > sizes[-1]:
            return self.seconds[sizes[-1]] * rows / sizes[-1]
        below = max(size for size in sizes if size < rows)
        above = min(size for size in sizes if size > rows)
        slope = (self.seconds[above] - self.seconds[below]) / (above - below)
        return self.seconds[below] + slope * (rows - below)

    def padding(self, rows: int) -> int:
        """Rows to add to a step of `rows` so that it runs at the cheapest measured size."""
        return self.padded_rows.get(rows, rows) - rows

    def prefill_allowance(self, decode_rows: int, slowdown: float = 2.0) -> int:
        """The most prefill rows a step of decode_rows may add and cost <= slowdown x without them."""
        if decode_rows == 0:
            return max(self.seconds)
        key = (decode_rows, slowdown)
        if key not in self._allowances:
            budget, extra = slowdown * self.cost(decode_rows), 0
            while extra < max(self.seconds) and self.cost(decode_rows + extra + 1) <= budget:
                extra += 1
            self._allowances[key] = extra
        return self._allowances[key]

    def _cheapest_at_least(self, rows: int) -> int:
        best = rows
        for size, seconds in self.seconds.items():
            if rows < size <= 2 * rows and seconds < PAD_GAIN * self.seconds[best]:
                best = size
        return best


class ChunkSteering:
    """Prefill rows per step beside decode rows, steered by what steps really take.

    The start-up costs are for fresh caches; a long prompt's later chunks also attend
    over everything before them, and a batched step copies its sessions' caches, so a
    chunk the table calls cheap can cost several decode steps. After each step with both
    decode rows and a chunk, the chunk shrinks in proportion when the step took more than
    `slowdown` x a decode-only step (their running mean), and grows by a quarter when it
    took less.
    """

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
            rows = self.rows if self.rows is not None else planned
            ratio = seconds / self.decode_s
            if ratio > self.slowdown:
                rows = int(rows * self.slowdown / ratio)
            else:
                rows += max(1, rows // 4)
            self.rows = max(self.minimum, min(self.maximum, rows))
