"""The step-cost model (specmesh.engine.step_model): a linear law fitted to a service's decode steps.

    seconds = scale * planned(rows) + per_session * (sessions - 1) + per_kilo_attended * attended / 1000

Synthetic steps from a known law over varied shapes; noise-free, so a fit is exact up to its prior."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from specmesh.engine.step_costs import StepCosts
from specmesh.engine.step_model import BOUNDS, DECAY, PRIOR, StepModel, StepShape
from specmesh.v1 import common_pb2

pytestmark = pytest.mark.unit

# A start-up table that grows with rows (padding never pays in it: every size is dearer than the one below).
TABLE = {1: 0.010, 2: 0.011, 4: 0.012, 8: 0.016, 16: 0.024, 32: 0.040, 64: 0.080}
LAW = (1.3, 0.01, 0.002)  # a slower machine than at start-up, 10 ms a session more, 2 ms per 1000 attended pairs

def _shapes(n: int, seed: int = 0, sessions=(1, 16), attended=(0, 20_000)):
    """Varied steps: 1-16 sessions, as many to 64 rows, 0-20k attended pairs (features far from collinear)."""
    rng = random.Random(seed)
    for _ in range(n):
        count = rng.randint(*sessions)
        yield StepShape(count, rng.randint(count, 64), rng.randint(*attended))


def _law(coefficients, planned_s: float, shape: StepShape) -> float:
    scale, per_session, per_kilo = coefficients
    return scale * planned_s + per_session * (shape.sessions - 1) + per_kilo * shape.attended / 1000


def _fitted(law, shapes, model: StepModel | None = None) -> StepModel:
    model = model or StepModel()
    costs = StepCosts(TABLE)
    for shape in shapes:
        planned = costs.planned_cost(shape.rows)
        model.observe(planned, shape, _law(law, planned, shape))
    return model


def test_with_no_steps_it_predicts_the_table_as_it_is():
    model = StepModel()
    assert model.coefficients == PRIOR == (1.0, 0.0, 0.0)
    assert model.predict(0.25, StepShape(sessions=12, rows=40, attended=500_000)) == 0.25
    costs = StepCosts(TABLE)
    for shape in _shapes(50):
        assert costs.step_s(shape) == costs.planned_cost(shape.rows)
    assert costs.seconds == TABLE and costs.cost(3) == pytest.approx((0.011 + 0.012) / 2)


def test_recovers_a_known_law_from_varied_steps():
    model = _fitted(LAW, _shapes(300))
    assert model.coefficients == pytest.approx(LAW, rel=0.03)
    costs = StepCosts(TABLE)
    for shape in _shapes(100, seed=1):  # steps it never saw, from the same law
        planned = costs.planned_cost(shape.rows)
        assert model.predict(planned, shape) == pytest.approx(_law(LAW, planned, shape), rel=0.02)


def test_fitting_moves_every_coefficient_towards_the_law():
    """What the fit gets right today (20 % off at most): each coefficient leaves the prior for the law."""
    scale, per_session, per_kilo = _fitted(LAW, _shapes(300)).coefficients
    assert scale > 1.2 and 0.008 < per_session < 0.012 and 0.0016 < per_kilo < 0.0024


def test_a_feature_never_seen_keeps_its_prior_coefficient():
    alone = _fitted(LAW, _shapes(200, sessions=(1, 1)))  # every step one session: nothing tells per_session
    assert alone.coefficients[1] == 0.0
    assert alone.coefficients[0] == pytest.approx(1.3, rel=0.02) and alone.coefficients[2] > 0.0015
    fresh = _fitted(LAW, _shapes(200, attended=(0, 0)))  # no cached context ever: nothing tells per_kilo
    assert fresh.coefficients[2] == 0.0 and fresh.coefficients[1] > 0.005


@pytest.mark.parametrize("law, index, bound", [
    ((1.3, -0.0005, 0.002), 1, 0.0),  # a session costs less than none: a cost never falls below zero
    # per_session shrunk towards 0 by the prior, per_kilo takes up the slack: fitted +0.00033, not fixed at 0
    ((1.3, 0.01, -0.0005), 2, 0.0),
    ((0.02, 0.0, 0.0), 0, BOUNDS[0][0]),  # a machine 50x faster than at start-up: the scale's floor
    ((80.0, 0.0, 0.0), 0, BOUNDS[0][1]),
])
def test_a_coefficient_past_its_bound_is_fixed_there(law, index, bound):
    coefficients = _fitted(law, _shapes(300)).coefficients
    assert coefficients[index] == bound
    assert all(low <= c <= high for c, (low, high) in zip(coefficients, BOUNDS))


def _constrained_least_squares(law, shapes, fixed: int) -> np.ndarray:
    """Decayed least squares over the steps with coefficient `fixed` at 0: what the re-solve should give."""
    costs = StepCosts(TABLE)
    rows, targets, weights = [], [], []
    for age, shape in enumerate(reversed(shapes)):
        planned = costs.planned_cost(shape.rows)
        rows.append(StepModel.features(planned, shape))
        targets.append(_law(law, planned, shape))
        weights.append(DECAY ** age)
    x, y, w = np.array(rows), np.array(targets), np.sqrt(np.array(weights))
    free = [i for i in range(3) if i != fixed]
    solved = np.zeros(3)
    solved[free] = np.linalg.lstsq(x[:, free] * w[:, None], y * w, rcond=None)[0]
    return solved


def test_the_rest_is_re_solved_with_a_coefficient_at_its_bound():
    law = (1.3, -0.0005, 0.002)
    shapes = list(_shapes(300))
    model = _fitted(law, shapes)
    expected = _constrained_least_squares(law, shapes, fixed=1)
    assert expected[1] == model.coefficients[1] == 0.0
    assert model.coefficients == pytest.approx(tuple(expected), rel=0.03)


@pytest.mark.parametrize("garbage", [math.nan, math.inf, -math.inf, 0.0, -1.0])
def test_garbage_seconds_change_nothing(garbage):
    shapes = list(_shapes(40))
    clean = _fitted(LAW, shapes)
    dirty = StepModel()
    costs = StepCosts(TABLE)
    for shape in shapes:
        planned = costs.planned_cost(shape.rows)
        dirty.observe(planned, shape, garbage)
        dirty.observe(planned, shape, _law(LAW, planned, shape))
        dirty.observe(0.0, shape, 1.0)  # a size the table cannot price: nothing either
    assert dirty.coefficients == clean.coefficients
    assert np.array_equal(dirty._xx, clean._xx) and dirty._steps == clean._steps  # not one decay more
    moved = StepCosts(TABLE)
    moved.observe(StepShape(3, 8, 4000), 0.5)
    before = moved.model.coefficients
    moved.observe(StepShape(3, 8, 4000), garbage)
    assert moved.model.coefficients == before


def test_old_steps_decay_and_the_fit_follows_a_new_law():
    old, new = (1.0, 0.0, 0.0), (2.0, 0.01, 0.004)
    changed = _fitted(old, _shapes(300, seed=1))
    assert changed.coefficients == pytest.approx(old, abs=1e-6)
    _fitted(new, _shapes(300, seed=2), model=changed)
    only_new = _fitted(new, _shapes(300, seed=2))
    # 300 steps on, the old law's weight is DECAY ** 300 = 0.2 %: the fit is that of the new steps alone
    # (without decay it would sit halfway, at a scale near 1.5).
    assert changed.coefficients == pytest.approx(only_new.coefficients, rel=0.01)
    assert changed.coefficients[0] > 1.9


def test_the_proto_round_trip():
    model = _fitted(LAW, _shapes(100))
    reported = model.to_proto()
    assert (reported.scale, reported.per_session_s, reported.per_kilo_attended_s) == model.coefficients
    assert StepModel.from_proto(reported).coefficients == model.coefficients
    assert StepModel.from_proto(common_pb2.StepCostModel()).coefficients == PRIOR  # unset: the table as it is


@pytest.mark.parametrize("scale, per_session, per_kilo, expected", [
    (math.nan, 0.01, 0.002, (1.0, 0.01, 0.002)),
    (-3.0, -1.0, -0.5, (BOUNDS[0][0], 0.0, 0.0)),
    (1e9, math.inf, -math.inf, (BOUNDS[0][1], 0.0, 0.0)),
    (math.inf, math.nan, 1e300, (1.0, 0.0, 1e300)),
    (0.0, 0.0, 0.0, PRIOR),
])
def test_garbage_in_a_reported_model_is_brought_within_bounds(scale, per_session, per_kilo, expected):
    reported = common_pb2.StepCostModel(scale=scale, per_session_s=per_session, per_kilo_attended_s=per_kilo)
    model = StepModel.from_proto(reported)
    assert model.coefficients == expected
    assert all(low <= c <= high for c, (low, high) in zip(model.coefficients, BOUNDS))


@pytest.mark.parametrize("seed", range(5))
def test_the_plain_float_solver_agrees_with_numpy_on_the_systems_the_fit_builds(seed):
    """_solve_linear stands in for numpy.linalg.solve on 1x1 to 3x3 ridge systems (symmetric, positive
    definite, scales as far apart as seconds and thousands of attended pairs)."""
    from specmesh.engine.step_model import _solve_linear
    rng = np.random.default_rng(seed)
    for n in (1, 2, 3):
        features = rng.random((20, n)) * np.array([0.5, 15.0, 20.0])[:n]  # [steps, n]
        a = features.T @ features + np.diag(rng.random(n) * 1e-3)  # [n, n]
        b = rng.random(n) * 10
        assert _solve_linear(a.tolist(), b.tolist()) == pytest.approx(np.linalg.solve(a, b), rel=1e-9, abs=1e-12)


def test_every_observed_step_leaves_the_fit_of_the_sums_so_far():
    model = StepModel()
    for shape in _shapes(40):
        model.observe(0.01 * shape.rows, shape, _law(LAW, 0.01 * shape.rows, shape))
        assert model.coefficients == model._solve()
