"""The rule planned for a batch (orchestrator.decoding.policy.Speculation.plan_batch), on injected costs and
acceptance only (no timing of anything real): the sums it keeps as requests come, learn and go give the k the
straightforward computation over all active requests gives; a batch of 256 sessions is planned within a
millisecond of Python; pipelined rounds are priced as they run (the draft beside the verification)."""

from __future__ import annotations

import asyncio
import random
import time
from types import SimpleNamespace

import pytest

from orchestrator.decoding.acceptance import expected_tokens
from orchestrator.decoding.costs import BatchLoad, RoundCosts
from orchestrator.decoding.plan import DRAFT_OPEN, RoundAsk, RoundOutcome
from orchestrator.decoding.policy import MARGIN, DraftLength, Speculation
from orchestrator.decoding.proposals import LOOKUP, SUFFIX, FreeProposal
from orchestrator.decoding.request import RoundTiming
from orchestrator.decoding.timing import HIT, MISS
from policy_costs import cpu_target, gpu_target, plan, speculation
from specmesh.engine.step_costs import StepCosts

pytestmark = pytest.mark.unit

CLASSES = ("code", "chat", "edit", "creative")


State = dict[DraftLength, tuple[int | None, int]]  # each request in flight: (k_max, context)


def state_of(members: list[DraftLength], asks: dict[DraftLength, RoundAsk] | None = None) -> State:
    asks = asks or {}
    return {p: (asks[p].k_max, asks[p].context) if p in asks else (p.k_max, p.context) for p in members}


def reference_goodput(shared: Speculation, state: State, k: int) -> float:
    """The rule as written (docs/design/draft-length.md), summed afresh over every request in flight."""
    batch = BatchLoad(requests=max(1, len(state)), context=sum(context for _, context in state.values()))
    tokens = sum(p.acceptance.expected_tokens(k if k_max is None else min(k, k_max))
                 for p, (k_max, _) in state.items()) or 1.0
    round_s = shared.costs.target_only_s(batch) if k == 0 else shared.costs.round_s(k, batch)
    return tokens / max(round_s, 1e-9)


def reference_best_k(shared: Speculation, state: State) -> int:
    k_max = max((k_max or 0 for k_max, _ in state.values()), default=0)
    return max(range(0, k_max + 1), key=lambda k: reference_goodput(shared, state, k))


def reference_k(shared: Speculation, state: State, part: DraftLength) -> int:
    """A request's k under the rule, from its current k (it moves for a gain of MARGIN)."""
    k_max = state[part][0]
    if k_max == 0:
        return 0
    best = reference_best_k(shared, state)
    gains = reference_goodput(shared, state, best) > (1 + MARGIN) * reference_goodput(shared, state, part.k)
    return min(best if gains else part.k, k_max)


def learn_a_round(part: DraftLength, rng: random.Random) -> None:
    """A round at the request's k, its tokens accepted at a rate of its class, timed as the reports say."""
    planned = plan(part, part.k_max if part.k_max is not None else 8, part.context)
    k, batch = planned.k, planned.batch
    rate = 0.5 + 0.1 * CLASSES.index(part.acceptance.prompt_class)
    accepted = next((j for j in range(k) if rng.random() >= rate), k)
    reports = part.shared.costs.reports
    timing = RoundTiming(draft_s=k * reports.draft.step_s(batch.draft_step()),
                         verify_s=reports.target.step_s(batch.target_step(k)))
    part.learn(planned, RoundOutcome(timing, k, accepted))


@pytest.mark.parametrize("seed", range(6))
def test_the_sums_kept_give_the_k_of_the_rule_summed_afresh(seed):
    """Random arrivals, departures, rounds learned and k_max and context moved: after each, every request's
    plan has the k (and the batch its rates) that summing over all requests in flight gives."""
    rng = random.Random(seed)
    shared = speculation(rng.choice((cpu_target, gpu_target)), lambda rows: rng.choice((0.002, 0.01, 0.03)))
    members: list[DraftLength] = []
    for _ in range(120):
        action = rng.random()
        if action < 0.3 or not members:
            part = shared.for_request(rng.choice(CLASSES))
            part.arrive()  # before its first plan: no k_max yet
            members.append(part)
        elif action < 0.4:
            members.pop(rng.randrange(len(members))).close()
        elif action < 0.7:
            learn_a_round(rng.choice(members), rng)
        else:
            chosen = rng.sample(members, rng.randint(1, len(members)))
            asks = [RoundAsk(rng.randint(0, 12), rng.randint(0, 4000)) for _ in chosen]
            state = state_of(members, dict(zip(chosen, asks)))  # what the plans read: their k_max and context
            expected = [reference_k(shared, state, part) for part in chosen]
            assert [p.k for p in shared.plan_batch(chosen, asks)] == expected
        rule, state = shared.rule(), state_of(members)
        assert rule.batch == BatchLoad(max(1, len(members)), sum(p.context for p in members))
        assert rule.best_k() == reference_best_k(shared, state)
        for k in range(0, 13):
            assert rule.goodput(k) == pytest.approx(reference_goodput(shared, state, k), rel=1e-12)


def test_a_batch_of_256_sessions_is_planned_within_a_millisecond():
    """Steps measured up to 4096 rows, whose rows cost little beside the step (a large GPU): the batch drafts."""
    sizes = [2 ** power for power in range(13)]
    reports = SimpleNamespace(target=StepCosts({rows: 0.02 + 0.000002 * rows for rows in sizes}),
                              draft=StepCosts({rows: 0.001 + 0.000001 * rows for rows in sizes}))
    shared = Speculation(costs=RoundCosts(reports))
    parts = [shared.for_request(CLASSES[index % len(CLASSES)]) for index in range(256)]
    rng = random.Random(7)
    for part in parts:
        part.arrive()
    for _ in range(3):  # each has rounds of its own: its acceptance is its own
        for part in parts:
            learn_a_round(part, rng)
    best = float("inf")
    for round_number in range(7):  # a round further each time: every context moves
        asks = [RoundAsk(8, 200 + 4 * round_number + index) for index in range(256)]
        started = time.perf_counter()
        plans = shared.plan_batch(parts, asks)
        best = min(best, time.perf_counter() - started)
    assert all(p.k > 0 for p in plans)  # the batch drafts (each at the best k, or one within MARGIN of it)
    print(f"256 sessions planned in {best * 1e3:.3f} ms")
    assert best < 1e-3, f"{best * 1e3:.2f} ms"


def priced_rounds(sessions: int) -> tuple[list, list, list]:
    """(the round shapes (k, free rows) priced by one plan_batch call of `sessions` sessions each offered 32 free
    tokens, its plans, each session's plan worked out alone over the same state)."""
    shared = speculation(gpu_target, lambda rows: 0.002)
    offered = [FreeProposal(SUFFIX, list(range(32)), 16), FreeProposal(LOOKUP, list(range(12)))]
    parts = [shared.for_request("code") for _ in range(sessions)]
    asks = [RoundAsk(8, 100, tokens_left=500, draft=DRAFT_OPEN, offers=lambda: offered) for _ in parts]
    shared.plan_batch(parts, asks)  # every session joins the batch's sums
    priced, round_s = [], shared.costs.round_s
    shared.costs.round_s = lambda k, batch, lookup=0: priced.append((k, lookup)) or round_s(k, batch, lookup)
    plans = shared.plan_batch(parts, asks)
    shared.costs.round_s = round_s
    rule = shared.rule()
    alone = [part.plan_round(rule, ask) for part, ask in zip(parts, asks)]
    return priced, plans, alone


def test_a_batch_weighing_free_proposals_prices_each_round_shape_once():
    """Sessions each offered 32 free tokens: a round with every count of them is priced once for the batch,
    not once per session (each weighs all 32 counts), and each session's plan is what it would be alone."""
    priced, plans, alone = priced_rounds(64)
    assert max(lookup for _, lookup in priced) >= 31  # every count of the offer was weighed
    # a shape priced again is RoundCosts' own (its target-only price reads its one-token round): a few, where
    # each session pricing every count of its offer would repeat each shape 64 times
    assert len(priced) - len(set(priced)) <= 4, len(priced)
    assert [(p.k, p.free) for p in plans] == [(p.k, p.free) for p in alone]


async def test_sessions_that_ask_in_the_same_turns_are_planned_by_one_call():
    """Every session a verification releases asks for its next plan before the event loop goes quiet: one
    plan_batch call plans them all, and each gets the plan a call of its own would give."""
    shared = speculation(gpu_target, lambda rows: 0.002)
    parts = [shared.for_request(CLASSES[index % len(CLASSES)]) for index in range(8)]
    for part in parts:
        part.arrive()
    calls, plan_batch = [], shared.plan_batch
    shared.plan_batch = lambda batch, asks: calls.append(len(batch)) or plan_batch(batch, asks)
    asks = [RoundAsk(4, 100 + index) for index in range(8)]
    plans = await asyncio.gather(*(part.plan_with_batch(ask) for part, ask in zip(parts, asks)))
    assert calls == [8]
    assert [p.k for p in plans] == [p.k for p in plan_batch(parts, asks)]


# ---- pipelined rounds: the draft runs beside the previous verification, so a hit costs the longer side


def lone_request(acceptance: float) -> tuple[Speculation, DraftLength]:
    """A GPU-like target (12 ms, flat in rows) and a 2 ms draft step, acceptance `acceptance` at every position."""
    shared = speculation(gpu_target, lambda rows: 0.002)
    shared.acceptance.prior = acceptance
    return shared, shared.for_request("code")


def best_k(acceptance: float, round_s) -> int:
    """The drafting k (1..8) that maximises E(k) / round_s(k), at `acceptance` a position."""
    return max(range(1, 9), key=lambda k: expected_tokens([acceptance] * k, k) / round_s(k))


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_pipelined_round_is_priced_at_the_longer_side_when_its_branch_is_ready(pipelined):
    """Hit rate 1: E(k) / max(draft side, target side); sequential (no hit rate): E(k) / (the two summed)."""
    shared, part = lone_request(0.8)
    reports, batch = shared.costs.reports, BatchLoad(1, 0)

    def draft_s(k: int) -> float:
        return k * reports.draft.step_s(batch.draft_step())

    def target_s(k: int) -> float:
        return reports.target.step_s(batch.target_step(k))
    beside = best_k(0.8, lambda k: max(draft_s(k), target_s(k)))
    after = best_k(0.8, lambda k: draft_s(k) + target_s(k))
    assert beside > after  # the draft's steps hide behind the verification up to its length
    if pipelined:
        shared.costs.hit_rate.value = 1.0
    assert plan(part, 8).k == (beside if pipelined else after)


def test_the_hit_rate_is_learned_and_a_hits_short_wait_does_not_price_drafting_free():
    shared, part = lone_request(0.8)
    planned = plan(part, 8)
    k = planned.k
    part.learn(planned, RoundOutcome(RoundTiming(draft_s=k * 0.004, verify_s=0.0124, predraft=MISS), k, k))
    ratio = shared.costs.draft_ratio.value
    assert ratio == pytest.approx(2.0)  # a miss drafts afresh after the verification: its wait shows the cost
    for _ in range(40):  # hits: the branch was ready, the round waited for nothing
        planned = plan(part, 8)
        part.learn(planned, RoundOutcome(RoundTiming(draft_s=0.0001, verify_s=0.0124, predraft=HIT), planned.k,
                                         planned.k))
    assert shared.costs.hit_rate.value > 0.95
    assert shared.costs.draft_ratio.value == ratio
