"""The default draft-length rule on injected costs and acceptance (no timing, no servers).

Costs are injected as the step-cost reports the services send; acceptance as simulated
rounds drawn at known per-token rates. The rule must pick the analytic optimum, choose
k = 0 when nothing pays (and draft again when it does), shrink k under load, give the
requests of a batch one k, and not oscillate.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from orchestrator.decoding.acceptance import AcceptanceMemory, PositionCounts, expected_tokens
from orchestrator.decoding.costs import BatchLoad, RoundCosts
from orchestrator.decoding.request import RoundTiming
from orchestrator.decoding.policy import MARGIN, Speculation
from specmesh.step_costs import StepCosts
from specmesh.step_model import StepModel, StepShape

K_MAX = 8
SIZES = tuple(range(1, 9)) + (12, 16, 24, 32, 48, 64)


def table(cost_of_rows, model: StepModel | None = None) -> StepCosts:
    return StepCosts({rows: cost_of_rows(rows) for rows in SIZES}, model)


def cpu_target(rows: int) -> float:
    """A CPU's fp32 step: 1-3 rows one weight pass, 4-8 rows about 1.6, then compute-bound."""
    return 0.25 if rows <= 3 else 0.40 if rows <= 8 else 0.40 * rows / 8


def gpu_target(rows: int) -> float:
    """A GPU's memory-bound step: flat up to large batches."""
    return 0.012 + 0.00005 * rows


def speculation(target_costs, draft_costs, target_model: StepModel | None = None) -> Speculation:
    reports = SimpleNamespace(target=table(target_costs, target_model), draft=table(draft_costs))
    return Speculation(costs=RoundCosts(reports))


def true_round_s(shared: Speculation, k: int, batch: BatchLoad) -> float:
    """What a round takes in these simulations: exactly what the reports say."""
    reports = shared.costs.reports
    draft = k * reports.draft.step_s(batch.draft_step()) if k else 0.0
    return draft + reports.target.step_s(batch.target_step(k))


def simulate(policy, rounds: int, acceptance: float, rng: random.Random, context: int = 0) -> list[int]:
    """Rounds whose costs are exactly the reports' and whose drafts are accepted at `acceptance` per token."""
    chosen = []
    for _ in range(rounds):
        k = policy.choose(K_MAX, context)
        accepted = next((j for j in range(k) if rng.random() >= acceptance), k)
        batch = policy.shared.batch()
        reports = policy.shared.costs.reports
        policy.observe(RoundTiming(draft_s=k * reports.draft.step_s(batch.draft_step()) if k else 0.0,
                                   verify_s=reports.target.step_s(batch.target_step(k))), k, accepted)
        chosen.append(k)
    return chosen


def analytic_rates(acceptance: float, target_costs, draft_costs) -> list[float]:
    """Tokens per second of a lone request at each k, from the true acceptance and costs."""
    target, draft = table(target_costs), table(draft_costs)

    def rate(k: int) -> float:
        seconds = (k * draft.step_s(StepShape(1, 1)) if k else 0.0) + target.step_s(StepShape(1, k + 1))
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
    (0.9, cpu_target, lambda rows: 0.03),   # a cheap draft, high acceptance: a long draft pays
    (0.6, cpu_target, lambda rows: 0.03),   # middling acceptance: a short one
    (0.9, cpu_target, lambda rows: 0.12),   # a slow draft
    (0.8, gpu_target, lambda rows: 0.002),  # a GPU: rows are nearly free
    (0.5, gpu_target, lambda rows: 0.004),
])
def test_picks_the_analytic_optimum(acceptance, target_costs, draft_costs):
    """Settled on the optimum, or on a k within MARGIN of it (a tie)."""
    policy = speculation(target_costs, draft_costs).for_request("code")
    chosen = simulate(policy, 150, acceptance, random.Random(1))
    rates = analytic_rates(acceptance, target_costs, draft_costs)
    settled = chosen[-40:]
    usual = max(set(settled), key=settled.count)
    assert rates[usual] >= (1 - 2 * MARGIN) * max(rates), (rates.index(max(rates)), chosen)
    assert min(rates[k] for k in settled) >= 0.85 * max(rates), chosen


def test_k_is_zero_when_nothing_pays():
    """A useless draft: k = 0 within the first rounds; a draft dearer than the target: k = 0 at once."""
    policy = speculation(cpu_target, lambda rows: 0.03).for_request("creative")
    chosen = simulate(policy, 40, 0.0, random.Random(2))
    assert chosen.index(0) <= 3 and chosen[4:].count(0) >= len(chosen[4:]) - 2, chosen
    assert speculation(cpu_target, lambda rows: 2.0).for_request("").choose(K_MAX) == 0


def test_drafts_again_once_old_evidence_has_faded():
    """Evidence decays at k = 0 too: a class turned off by rejections is tried again, and when its
    drafts are accepted now, it drafts from then on (no probe machinery)."""
    policy = speculation(cpu_target, lambda rows: 0.03).for_request("edit")
    rng = random.Random(3)
    off = simulate(policy, 30, 0.0, rng)
    assert off[-10:].count(0) == 10, off
    on = simulate(policy, 400, 0.95, rng)
    first = next(index for index, k in enumerate(on) if k > 0)
    assert first < 300 and all(k >= 3 for k in on[first + 20:]), (first, on)


def test_a_new_request_starts_from_its_classs_history():
    shared = speculation(cpu_target, lambda rows: 0.03)
    rng = random.Random(4)
    for _ in range(3):
        for prompt_class, acceptance in (("creative", 0.05), ("code", 0.95)):
            policy = shared.for_request(prompt_class)
            simulate(policy, 20, acceptance, rng)
            policy.close()
    creative = shared.for_request("creative")
    assert creative.choose(K_MAX) == 0
    creative.close()  # else the next request would not be alone
    code = shared.for_request("code")
    assert code.choose(K_MAX) >= 3
    code.close()
    # a class that does not pay never opens its draft's session
    assert not shared.for_request("creative").wants_draft(K_MAX, catch_up=1, tokens_left=400)


def test_class_memory_is_bounded():
    memory = AcceptanceMemory(max_classes=4)
    for index in range(10):
        memory.for_class(f"class-{index}").observe(4, 2)
    assert list(memory.classes) == [f"class-{index}" for index in range(6, 10)]


def test_the_requests_of_a_batch_draft_one_k_which_shrinks_with_load():
    """Rows cost 30 ms each and every session adds 10 ms to a draft step: as requests join, the
    batch's extra rows and draft steps cost more than their tokens bring, down to k = 0 at 16."""
    shared = speculation(lambda rows: 0.15 + 0.03 * rows, lambda rows: 0.02)
    shared.costs.reports.draft.model = StepModel((1.0, 0.01, 0.0))
    rng = random.Random(5)
    requests, by_load = [], {}
    for load in (1, 2, 4, 16):
        while len(requests) < load:
            requests.append(shared.for_request("code"))
            requests[-1].arrive()
        for _ in range(30 if load == 1 else 5):  # every request runs its rounds under this load
            chosen = [simulate(policy, 1, 0.9, rng)[0] for policy in requests]
        assert len(set(chosen)) == 1, (load, chosen)
        by_load[load] = chosen[0]
    assert list(by_load.values()) == sorted(by_load.values(), reverse=True), by_load
    assert by_load[1] >= 3 and by_load[16] == 0, by_load


def test_the_chosen_k_is_the_batchs_analytic_optimum():
    """Four requests with known acceptance: the k chosen maximises the batch's tokens per second."""
    shared = speculation(gpu_target, lambda rows: 0.003, StepModel((1.0, 0.002, 0.0)))
    requests = [shared.for_request("chat") for _ in range(4)]
    rng = random.Random(6)
    for _ in range(60):
        for policy in requests:
            simulate(policy, 1, 0.75, rng)
    batch = shared.batch()
    rates = [shared.tokens(k, batch) / true_round_s(shared, k, batch) for k in range(K_MAX + 1)]
    chosen = requests[0].choose(K_MAX)
    assert rates[chosen] >= (1 - MARGIN) * max(rates), (chosen, rates)


def test_cached_context_makes_rows_dearer():
    """Attention over a long context, as the target's model prices it, shortens the draft."""
    model = StepModel((1.0, 0.0, 0.05))  # 50 ms per thousand query-key pairs over cached context
    short, long_ = [speculation(gpu_target, lambda rows: 0.002, model).for_request("code") for _ in range(2)]
    rng = random.Random(7)
    k_short = simulate(short, 40, 0.8, rng, context=10)[-1]
    k_long = simulate(long_, 40, 0.8, rng, context=4000)[-1]
    assert k_short > k_long, (k_short, k_long)


def test_does_not_oscillate_near_break_even():
    """Measured costs jitter by 10% around the reports: k changes rarely."""
    policy = speculation(cpu_target, lambda rows: 0.03).for_request("")
    rng = random.Random(8)
    chosen = [policy.choose(K_MAX)]
    for _ in range(300):
        k = chosen[-1]
        accepted = next((j for j in range(k) if rng.random() >= 0.7), k)
        jitter = 1 + rng.uniform(-0.1, 0.1)
        policy.observe(RoundTiming(draft_s=k * 0.03 * jitter, verify_s=cpu_target(k + 1) * jitter), k, accepted)
        chosen.append(policy.choose(K_MAX))
    switches = sum(a != b for a, b in zip(chosen, chosen[1:]))
    assert switches <= 12, (switches, chosen)


def test_the_drafts_prefill_must_pay_for_itself():
    """Late in a request the draft's prefill of a long sequence costs more than its last tokens save."""
    shared = speculation(cpu_target, lambda rows: 0.03 if rows <= 8 else 0.03 * rows / 8)
    policy = shared.for_request("code")
    assert policy.wants_draft(K_MAX, catch_up=64, tokens_left=200)
    assert not policy.worth_opening(policy.choose(K_MAX), catch_up=3000, tokens_left=3)


def test_without_reported_costs_it_learns_them_from_rounds():
    """A service that reports no step costs: the wall clock of rounds by draft length stands in."""
    policy = Speculation().for_request("")
    assert policy.choose(K_MAX) == K_MAX  # nothing to weigh k against yet: the most evidence
    chosen = []
    for _ in range(60):  # a useless draft: nothing is ever accepted
        chosen.append(policy.choose(K_MAX))
        policy.observe(RoundTiming(draft_s=chosen[-1] * 0.09, verify_s=cpu_target(chosen[-1] + 1)), chosen[-1], 0)
    assert chosen[-30:].count(0) >= 27, chosen


def test_one_rejected_round_does_not_set_the_deployments_prior():
    """A warm-up's single rejected round must not turn the next class's first rounds off (the prior
    counts for a few rounds), while rejections of the request's own still turn it off at once."""
    shared = speculation(cpu_target, lambda rows: 0.048)
    warm_up = shared.for_request("chat")
    assert warm_up.choose(K_MAX) >= 2
    warm_up.observe(RoundTiming(draft_s=0.1, verify_s=0.25), 2, 0)
    warm_up.close()
    policy = shared.for_request("code")
    chosen = []
    for _ in range(4):
        k = policy.choose(K_MAX)
        policy.observe(RoundTiming(draft_s=0.048 * k, verify_s=0.25), k, 0)
        chosen.append(k)
    assert chosen[0] >= 2 and chosen[-1] == 0, chosen


def simulate_link(policy, rounds: int, acceptance: float, rng: random.Random, draft_latency_s: float,
                  target_latency_s: float) -> list[int]:
    """Rounds whose forwards cost what the reports say and whose calls add a latency each: the draft behind
    a link of that round trip (a drafting round waits for it once), the target's calls their own."""
    chosen = []
    for _ in range(rounds):
        k = policy.choose(K_MAX, 0)
        accepted = next((j for j in range(k) if rng.random() >= acceptance), k)
        batch = policy.shared.batch()
        reports = policy.shared.costs.reports
        draft_forward = k * reports.draft.step_s(batch.draft_step()) if k else 0.0
        verify_forward = reports.target.step_s(batch.target_step(k))
        policy.observe(RoundTiming(draft_s=draft_forward + (draft_latency_s if k else 0.0),
                                   verify_s=verify_forward + target_latency_s, draft_forward_s=draft_forward,
                                   verify_forward_s=verify_forward), k, accepted)
        chosen.append(k)
    return chosen


def link_rates(acceptance: float, draft_latency_s: float, target_latency_s: float) -> list[float]:
    """A lone request's tokens per second at each k on gpu_target with a 2 ms draft behind the link."""
    def rate(k: int) -> float:
        seconds = (draft_latency_s + k * 0.002 if k else 0.0) + target_latency_s + gpu_target(k + 1)
        return expected_tokens([acceptance] * k, k) / seconds
    return [rate(k) for k in range(K_MAX + 1)]


@pytest.mark.parametrize("draft_latency_s", [0.0, 0.005, 0.080])
def test_a_links_round_trip_is_priced_once_a_round(draft_latency_s):
    """A draft across a network: its round trip is paid once per drafting round whatever k, so the rule
    drafts longer to amortise it, or not at all where no k pays for it; trying the draft again now and then
    costs a small share of the time (RETRY_SHARE), however long the link."""
    policy = speculation(gpu_target, lambda rows: 0.002).for_request("code")
    chosen = simulate_link(policy, 600, 0.8, random.Random(3), draft_latency_s, target_latency_s=0.001)[-300:]
    seconds = sum((draft_latency_s + k * 0.002 if k else 0.0) + 0.001 + gpu_target(k + 1) for k in chosen)
    tokens = sum(expected_tokens([0.8] * k, k) for k in chosen)
    rates = link_rates(0.8, draft_latency_s, 0.001)
    assert tokens / seconds >= 0.95 * max(rates), (rates.index(max(rates)), chosen)
    if draft_latency_s == 0.080:
        assert chosen.count(0) >= len(chosen) - 3, chosen
    assert policy.shared.costs.target_latency.value == pytest.approx(0.001)


def test_the_latency_shifts_the_best_k_longer():
    """The same acceptance and steps: a few milliseconds of round trip make the chosen draft longer."""
    usual = {}
    for latency in (0.0, 0.005):
        chosen = simulate_link(speculation(gpu_target, lambda rows: 0.002).for_request("code"), 300, 0.8,
                               random.Random(4), latency, 0.001)
        usual[latency] = sorted(chosen[-100:])[50]  # the median of the settled rounds
    assert usual[0.005] > usual[0.0] > 0, usual
