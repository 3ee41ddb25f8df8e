"""What a decode step of several sessions costs now: a linear model each service fits to its own steps.

    seconds = scale * planned(padded rows) + per_session * (sessions - 1) + per_kilo_attended * attended / 1000

`planned` is the start-up table (specmesh.step_costs: one session's step by rows on a fresh
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

import numpy as np

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
    """The three coefficients, fitted online; `predict` reads them, `observe` adds a step."""

    def __init__(self, coefficients: tuple[float, float, float] = PRIOR):
        self.coefficients = tuple(float(c) for c in coefficients)
        self._xx = np.zeros((3, 3))  # decayed sums of feature products ...
        self._xy = np.zeros(3)  # ... and of features times seconds
        self._x2 = np.zeros(3)  # decayed mean squares: the prior's weight per feature, in its units
        self._steps = 0.0
        self._prior_steps = PRIOR_STEPS

    @staticmethod
    def features(planned_s: float, shape: StepShape) -> np.ndarray:
        return np.array([planned_s, max(0, shape.sessions - 1), shape.attended / 1000.0])

    def predict(self, planned_s: float, shape: StepShape) -> float:
        return float(np.dot(self.coefficients, self.features(planned_s, shape)))

    def observe(self, planned_s: float, shape: StepShape, seconds: float) -> None:
        if not (math.isfinite(seconds) and seconds > 0 and planned_s > 0):
            return
        x = self.features(planned_s, shape)
        self._xx = DECAY * self._xx + np.outer(x, x)
        self._xy = DECAY * self._xy + x * seconds
        self._steps = DECAY * self._steps + 1.0
        self._x2 = DECAY * self._x2 + x * x
        self._prior_steps = max(PRIOR_FLOOR, DECAY * self._prior_steps)
        self.coefficients = self._solve()

    def _solve(self) -> tuple[float, ...]:
        """Ridge towards PRIOR, then each coefficient past its bound fixed there and the rest re-solved."""
        prior_weight = self._prior_steps * np.maximum(self._x2 / max(self._steps, 1e-9), 1e-12)
        a = self._xx + np.diag(prior_weight)
        b = self._xy + prior_weight * np.array(PRIOR)
        fixed: dict[int, float] = {}
        solved: dict[int, float] = {}
        for _ in range(4):  # each pass fixes at least one coefficient or ends
            free = [i for i in range(3) if i not in fixed]
            if not free:
                break
            rhs = b[free] - a[np.ix_(free, list(fixed))] @ np.array(list(fixed.values())) if fixed else b[free]
            solved = dict(zip(free, np.linalg.solve(a[np.ix_(free, free)], rhs)))
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
