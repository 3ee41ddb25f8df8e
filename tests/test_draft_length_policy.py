"""The default draft-length policy on constructed costs and acceptance (no timing, no servers).

Costs are injected as the step-cost tables the services report; acceptance as
simulated rounds drawn at known per-position rates. The policy must pick the
analytic optimum, turn speculation off when nothing pays (and back on when it
does), shrink k under load, and not oscillate.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from orchestrator.decoding.acceptance import AcceptanceMemory, PositionCounts, expected_tokens
from orchestrator.decoding.costs import BatchLoad, RoundCosts, step_s, target_steps_s
from orchestrator.decoding.loop import RoundTiming
from orchestrator.decoding.policy import AdaptiveSpeculation, PolicyConfig
from specmesh.step_costs import StepCosts

K_MAX = 8
SIZES = tuple(range(1, 9)) + (12, 16, 24, 32, 48, 64)


def table(cost_of_rows) -> StepCosts:
    return StepCosts({rows: cost_of_rows(rows) for rows in SIZES})


def cpu_target(rows: int) -> float:
    """A 2-core CPU's fp32 step: 1-3 rows one weight pass, 4-8 rows about 1.6, then compute-bound."""
    return 0.25 if rows <= 3 else 0.40 if rows <= 8 else 0.40 * rows / 8


def gpu_target(rows: int) -> float:
    """A GPU's memory-bound step: flat up to large batches."""
    return 0.012 + 0.00005 * rows


def shared(target_costs, draft_costs, config: PolicyConfig = PolicyConfig()) -> AdaptiveSpeculation:
    reports = SimpleNamespace(target=table(target_costs), draft=table(draft_costs))
    return AdaptiveSpeculation(config=config, costs=RoundCosts(reports))


def simulate(policy, rounds: int, acceptance: float, rng: random.Random, batch_rows: int = 0) -> list[int]:
    """Rounds whose costs are exactly the tables' and whose drafts are accepted at `acceptance` per token."""
    chosen = []
    costs = policy.costs
    for _ in range(rounds):
        k = policy.choose(K_MAX)
        accepted = next((j for j in range(k) if rng.random() >= acceptance), k)
        draft_s = k * step_s(costs.reports.draft, 1) if k else 0.0
        policy.observe(RoundTiming(draft_s=draft_s, verify_s=step_s(costs.reports.target, k + 1 + batch_rows)),
                       k, accepted)
        chosen.append(k)
    return chosen


def analytic_rates(acceptance: float, target_costs, draft_costs) -> list[float]:
    """Tokens per second of a lone request at each k, from the true acceptance and costs."""
    target, draft = table(target_costs), table(draft_costs)

    def rate(k: int) -> float:
        seconds = (k * step_s(draft, 1) if k else 0.0) + step_s(target, k + 1)
        return expected_tokens([acceptance] * k, k) / seconds
    return [rate(k) for k in range(K_MAX + 1)]


def test_expected_tokens_by_position():
    assert expected_tokens([], 0) == 1.0
    assert expected_tokens([1.0] * 5, 5) == 6.0
    assert expected_tokens([0.5, 0.5], 2) == pytest.approx(1.75)
    assert expected_tokens([0.9, 0.5, 0.0], 3) == pytest.approx(1 + 0.9 + 0.45)


def test_per_position_rates_are_learned_from_rounds():
    """Position 1 always accepted, position 2 half the time, position 3 never."""
    counts = PositionCounts(decay=1.0)
    rng = random.Random(0)
    for _ in range(400):
        counts.observe(drafted=3, accepted=1 + (rng.random() < 0.5))
    rates = counts.rates([0.7] * len(counts.reached))
    assert rates[5] == pytest.approx(0.7)  # never reached: the prior
    assert rates[0] > 0.98 and rates[1] == pytest.approx(0.5, abs=0.06) and rates[2] < 0.02


@pytest.mark.parametrize("acceptance, target_costs, draft_costs", [
    (0.9, cpu_target, lambda rows: 0.03),   # the embedded pair's shape: a long draft pays
    (0.6, cpu_target, lambda rows: 0.03),   # middling acceptance: a short one
    (0.9, cpu_target, lambda rows: 0.12),   # a slow draft
    (0.8, gpu_target, lambda rows: 0.002),  # a GPU: rows are nearly free
    (0.5, gpu_target, lambda rows: 0.004),
])
def test_picks_the_analytic_optimum(acceptance, target_costs, draft_costs):
    """Settled on the optimum, or on a k within the hysteresis margin of it (a near tie)."""
    policy = shared(target_costs, draft_costs).for_request("code")
    chosen = simulate(policy, 120, acceptance, random.Random(1))
    rates = analytic_rates(acceptance, target_costs, draft_costs)
    settled = chosen[-40:]
    usual = max(set(settled), key=settled.count)
    assert rates[usual] >= (1 - PolicyConfig().margin) * max(rates), (rates.index(max(rates)), chosen)
    assert min(rates[k] for k in settled) >= 0.85 * max(rates), chosen


def test_turns_off_within_the_first_rounds_when_nothing_pays():
    policy = shared(cpu_target, lambda rows: 0.03).for_request("creative")
    chosen = simulate(policy, 40, 0.0, random.Random(2))
    assert chosen.index(0) <= 3, chosen  # decided within the first rounds
    assert sum(k > 0 for k in chosen[4:]) <= 3, chosen  # a few cheap probes, no more
    assert all(k <= PolicyConfig().probe_k for k in chosen[4:]), chosen


def test_a_slow_draft_turns_it_off():
    policy = shared(cpu_target, lambda rows: 2.0).for_request("")
    assert policy.choose(K_MAX) == 0  # priced from the tables before any round


def test_comes_back_when_acceptance_returns():
    speculation = shared(cpu_target, lambda rows: 0.03)
    policy = speculation.for_request("edit")
    rng = random.Random(3)
    off = simulate(policy, 30, 0.0, rng)
    assert off[-10:].count(0) >= 9
    on = simulate(policy, 80, 0.95, rng)
    assert all(k >= 4 for k in on[-20:]), on


def test_a_new_request_starts_from_its_classs_history():
    speculation = shared(cpu_target, lambda rows: 0.03)
    rng = random.Random(4)
    for _ in range(3):
        policy = speculation.for_request("creative")
        simulate(policy, 20, 0.05, rng)
        policy.close()
        policy = speculation.for_request("code")
        simulate(policy, 20, 0.95, rng)
        policy.close()
    creative = speculation.for_request("creative")
    assert creative.choose(K_MAX) == 0
    creative.close()  # else the next request would not be alone
    assert speculation.for_request("code").choose(K_MAX) >= 6
    # its draft session need not open
    assert not speculation.for_request("creative").wants_draft(K_MAX, catch_up=1, tokens_left=400)


def test_class_memory_is_bounded():
    memory = AcceptanceMemory(max_classes=4)
    for index in range(10):
        memory.for_class(f"class-{index}").observe(4, 2)
    assert list(memory.classes) == [f"class-{index}" for index in range(6, 10)]


def test_k_shrinks_under_load_and_turns_off_at_high_load():
    """Requests in flight at k = 0 make every extra verified row cost the whole batch."""
    speculation = shared(cpu_target, lambda rows: 0.03)
    rng = random.Random(5)
    warm = speculation.for_request("code")
    simulate(warm, 30, 0.95, rng)
    alone = warm.best(K_MAX)
    others = [speculation.for_request("code") for _ in range(15)]
    for other in others:
        other.k = 0
        speculation.join(other)
    loaded = warm.best(K_MAX, speculation.batch_load(warm))
    assert alone >= 5 and loaded < alone and loaded == 0, (alone, loaded)
    for other in others:  # load falls: speculation comes back by itself
        other.close()
    assert warm.best(K_MAX, speculation.batch_load(warm)) == alone


def test_a_draft_beside_requests_that_do_not_draft_pays_for_a_step_of_its_own():
    """Beside seven target-only requests a draft reaches the target late and gets a step of its own,
    so on a GPU-like table, where its rows would cost nearly nothing in the shared step, it does
    not pay. Beside seven drafting requests it shares their step, and drafting pays again."""
    speculation = shared(gpu_target, lambda rows: 0.001)
    warm = speculation.for_request("code")
    simulate(warm, 30, 0.95, random.Random(7))
    assert warm.best(K_MAX) > 0
    others = [speculation.for_request("code") for _ in range(7)]
    for other in others:
        other.k = 0
        speculation.join(other)
    batch = speculation.batch_load(warm)
    assert (batch.rows, batch.drafting, batch.drafting_rows) == (7, 0, 0)
    two_steps = speculation.costs.round_s(4, batch)
    assert two_steps == pytest.approx(4 * 0.001 + gpu_target(7) + gpu_target(5))
    assert warm.best(K_MAX, batch) == 0
    for other in others:
        other.k = 3
    assert warm.best(K_MAX, speculation.batch_load(warm)) > 0


# The embedded 1.5B target's start-up table on the 2-core EPYC (2026-11-26 10:53, ms by rows).
EPYC_START_UP = {1: 255.0, 2: 287.6, 3: 212.6, 4: 201.4, 5: 192.3, 6: 195.0, 7: 244.0, 8: 268.8, 12: 271.9,
                 16: 341.5, 24: 431.1, 32: 530.8, 48: 723.6, 64: 972.3}


def test_drafting_rows_are_priced_from_the_drafting_sessions_step_as_it_runs_now():
    """Four sessions of one row ran at 286 ms, with 10-11 rows at 359-384, while the table still had
    12 rows at their start-up 272 (step log, 11:00): read there, four requests drafting two tokens
    each looked cheaper than the same four drafting none, and the forecast said drafting at 4
    requests would deliver 1.28x (it delivered 0.96x). Grown from the four sessions' step by the
    start-up table, the drafting step costs what it ran at; where a size has run, its current
    cost is the floor."""
    target = StepCosts({rows: ms / 1e3 for rows, ms in EPYC_START_UP.items()})
    for _ in range(40):
        target.observe(4, 0.286)  # decode steps of four sessions
        target.observe(5, 0.283)  # one session verifying four draft tokens (concurrency 1)
    assert target.cost(12) < target.cost(4)  # the stale entry: rows past the decode step look free
    four_drafting = target_steps_s(target, steady_rows=0, drafting_rows=4 * 3, drafting=4)
    assert four_drafting == pytest.approx(0.286 * 271.9 / 201.4, rel=1e-3)
    assert 0.359 < four_drafting < 0.40 and four_drafting > target_steps_s(target, 4, 0)
    # One session of 5 rows ran at 283 ms; grown from its one-row step (255 at start-up) it would be 192/255 of that.
    assert target_steps_s(target, 0, 5, drafting=1) == pytest.approx(0.283, rel=1e-3)
    speculation = AdaptiveSpeculation(costs=RoundCosts(SimpleNamespace(target=target, draft=table(lambda r: 0.05))))
    assert speculation.costs.round_s(2, BatchLoad(undecided=3)) == pytest.approx(2 * 0.05 + four_drafting)


def test_no_probes_while_the_load_alone_rules_drafting_out():
    """At k = 0 under a load where even a draft accepting 90 % would lose, probing finds nothing:
    none runs (nor opens a draft). When the load falls, the next round may probe again."""
    speculation = shared(cpu_target, lambda rows: 0.03)
    rng = random.Random(6)
    policy = speculation.for_request("creative")
    others = [speculation.for_request("code") for _ in range(15)]
    for other in others:
        other.k = 0
        speculation.join(other)
    loaded = simulate(policy, 40, 0.0, rng, batch_rows=15)
    assert loaded[-30:] == [0] * 30, loaded
    for other in others:
        other.close()
    alone = simulate(policy, 12, 0.0, rng)
    assert alone[0] == PolicyConfig().probe_k, alone  # the overdue probe, at once


def test_does_not_oscillate_near_break_even():
    """Measured costs jitter by 10% around the tables: k changes rarely."""
    speculation = shared(cpu_target, lambda rows: 0.03)
    policy = speculation.for_request("")
    rng = random.Random(6)
    chosen = [policy.choose(K_MAX)]
    for _ in range(300):
        k = chosen[-1]
        accepted = next((j for j in range(k) if rng.random() >= 0.7), k)
        jitter = 1 + rng.uniform(-0.1, 0.1)
        policy.observe(RoundTiming(draft_s=k * 0.03 * jitter, verify_s=cpu_target(k + 1) * jitter), k, accepted)
        chosen.append(policy.choose(K_MAX))
    switches = sum(a != b for a, b in zip(chosen, chosen[1:]))
    assert switches <= 12, (switches, chosen)


def test_without_reported_costs_it_learns_them_from_rounds():
    """A service that reports no step costs: wall-clock costs per row count stand in."""
    policy = AdaptiveSpeculation().for_request("")
    assert policy.choose(K_MAX) == K_MAX  # nothing to weigh k against yet: the most evidence
    for _ in range(3):  # target-only rounds (the draft was away) time no draft
        policy.observe(RoundTiming(draft_s=0.0, verify_s=cpu_target(1)), 0, 0)
    assert policy.choose(K_MAX) == K_MAX
    chosen = []
    for _ in range(60):  # a useless draft: nothing is ever accepted
        chosen.append(policy.choose(K_MAX))
        policy.observe(RoundTiming(draft_s=chosen[-1] * 0.09, verify_s=cpu_target(chosen[-1] + 1)), chosen[-1], 0)
    assert chosen[-30:].count(0) >= 27, chosen


def test_one_rejected_round_does_not_set_the_deployments_prior():
    """A warm-up's single rejected round must not turn the next class's first rounds off (the prior
    counts for a few rounds), while rejections of the request's own still turn it off at once."""
    speculation = shared(cpu_target, lambda rows: 0.048)
    warm_up = speculation.for_request("chat")
    assert warm_up.choose(K_MAX) >= 2
    warm_up.observe(RoundTiming(draft_s=0.1, verify_s=0.25), 2, 0)
    warm_up.close()
    policy = speculation.for_request("code")
    chosen = []
    for _ in range(4):
        k = policy.choose(K_MAX)
        policy.observe(RoundTiming(draft_s=0.048 * k, verify_s=0.25), k, 0)
        chosen.append(k)
    assert chosen[0] >= 2 and chosen[-1] == 0, chosen
