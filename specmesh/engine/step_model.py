"""What a decode step of several sessions costs now: a linear model each service fits to its own steps.

    seconds = scale * planned(padded rows) + per_session * (sessions - 1) + per_kilo_attended * attended / 1000

`planned` is the start-up table (specmesh.engine.step_costs: one session's step by rows on a fresh
cache), which prices the weights and the row padding. What it cannot see is learned from
every decode step the service runs: more sessions in a step (each its own cache and mask),
attention over long cached contexts (`attended`: the step's query-key pairs, the sum over
its sessions of rows x cached tokens), and a machine slower than at start-up (`scale`:
another process on its cores, a draft beside the target). Least squares over the steps,
older ones decayed, with the start-up table as it is for a prior worth a few steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from specmesh.v1 import common_pb2

PRIOR = (1.0, 0.0, 0.0)  # the start-up table as it is: nothing added per session or per attended pair
PRIOR_STEPS = 4.0  # the prior counts for this many steps of evidence, decaying like one ...
PRIOR_FLOOR = 0.01  # ... down to this many: a feature the steps never vary keeps its prior
DECAY = 0.98  # older steps' weight at each new one: about the last 50 steps count
BOUNDS = ((0.1, 50.0), (0.0, math.inf), (0.0, math.inf))  # costs never fall below zero


@dataclass(frozen=True)
class StepShape:
    """A step as the model sees it: its sessions, its rows (padding included), its attended pairs."""

    sessions: int
    rows: int
    attended: int = 0


class StepModel:
    """The three coefficients, fitted online; `predict` reads them, `observe` adds a step.

    A service observes every step it runs, right after a forward that has just swept the caches, so
    the sums and the 3x3 least squares run in plain floats: numpy's dispatch costs milliseconds there.
    """

    def __init__(self, coefficients: tuple[float, float, float] = PRIOR):
        self.coefficients = tuple(float(c) for c in coefficients)
        self._xx = [[0.0] * 3 for _ in range(3)]  # decayed sums of feature products ...
        self._xy = [0.0] * 3  # ... and of features times seconds
        self._x2 = [0.0] * 3  # decayed mean squares: the prior's weight per feature, in its units
        self._steps = 0.0
        self._prior_steps = PRIOR_STEPS

    @staticmethod
    def features(planned_s: float, shape: StepShape) -> tuple[float, float, float]:
        return planned_s, float(max(0, shape.sessions - 1)), shape.attended / 1000.0

    @property
    def evidence(self) -> tuple[float, ...]:
        """Each feature's decayed sum of squares over the observed steps: zero where none varied it."""
        return tuple(self._x2)

    def predict(self, planned_s: float, shape: StepShape) -> float:
        return sum(c * x for c, x in zip(self.coefficients, self.features(planned_s, shape)))

    def observe(self, planned_s: float, shape: StepShape, seconds: float) -> None:
        if not (math.isfinite(seconds) and seconds > 0 and planned_s > 0):
            return
        x = self.features(planned_s, shape)
        for i in range(3):
            row = self._xx[i]
            for j in range(3):
                row[j] = DECAY * row[j] + x[i] * x[j]
            self._xy[i] = DECAY * self._xy[i] + x[i] * seconds
            self._x2[i] = DECAY * self._x2[i] + x[i] * x[i]
        self._steps = DECAY * self._steps + 1.0
        self._prior_steps = max(PRIOR_FLOOR, DECAY * self._prior_steps)
        self.coefficients = self._solve()

    def _solve(self) -> tuple[float, ...]:
        """Ridge towards PRIOR, then each coefficient past its bound fixed there and the rest re-solved."""
        prior_weight = [self._prior_steps * max(x2 / max(self._steps, 1e-9), 1e-12) for x2 in self._x2]
        a = [[self._xx[i][j] + (prior_weight[i] if i == j else 0.0) for j in range(3)] for i in range(3)]
        b = [self._xy[i] + prior_weight[i] * PRIOR[i] for i in range(3)]
        fixed: dict[int, float] = {}
        solved: dict[int, float] = {}
        for _ in range(4):  # each pass fixes at least one coefficient or ends
            free = [i for i in range(3) if i not in fixed]
            if not free:
                break
            rhs = [b[i] - sum(a[i][j] * value for j, value in fixed.items()) for i in free]
            solved = dict(zip(free, _solve_linear([[a[i][j] for j in free] for i in free], rhs)))
            outside = {i: min(max(v, BOUNDS[i][0]), BOUNDS[i][1]) for i, v in solved.items()
                       if not BOUNDS[i][0] <= v <= BOUNDS[i][1]}
            if not outside:
                break
            fixed.update(outside)
            solved = {}
        values = {**solved, **fixed}
        return tuple(float(values[i]) for i in range(3))

    def to_proto(self) -> common_pb2.StepCostModel:
        scale, per_session, per_kilo = self.coefficients
        return common_pb2.StepCostModel(scale=scale, per_session_s=per_session, per_kilo_attended_s=per_kilo)

    @classmethod
    def from_proto(cls, reported: common_pb2.StepCostModel) -> "StepModel":
        """A reported model; garbage (not finite, outside the bounds) is brought within the bounds."""
        values = (reported.scale or PRIOR[0], reported.per_session_s, reported.per_kilo_attended_s)
        return cls(tuple(min(max(v if math.isfinite(v) else PRIOR[i], BOUNDS[i][0]), BOUNDS[i][1])
                         for i, v in enumerate(values)))


def _solve_linear(a: list[list[float]], b: list[float]) -> list[float]:
    """x with a x = b for a small positive-definite a (the ridge makes it so): Gaussian elimination."""
    n = len(b)
    rows = [list(a[i]) + [b[i]] for i in range(n)]  # [n, n + 1] augmented
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(rows[r][col]))
        rows[col], rows[pivot] = rows[pivot], rows[col]
        for r in range(col + 1, n):
            factor = rows[r][col] / rows[col][col]
            rows[r] = [value - factor * top for value, top in zip(rows[r], rows[col])]
    x = [0.0] * n
    for i in reversed(range(n)):
        x[i] = (rows[i][n] - sum(rows[i][j] * x[j] for j in range(i + 1, n))) / rows[i][i]
    return x
