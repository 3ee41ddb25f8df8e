"""One choice per round among proposers (orchestrator.decoding.policy): the draft model, prompt lookup, the
suffix index, or none, by the batch's expected tokens per second, each with its own learned acceptance."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from orchestrator.decoding.costs import RoundCosts
from orchestrator.decoding.request import RoundTiming
from orchestrator.decoding.policy import MARGIN, Speculation, suffix_bucket
from orchestrator.decoding.proposals import LOOKUP, SUFFIX, FreeProposal
from specmesh.step_costs import MEASURED_ROWS, StepCosts

TARGET_S, TARGET_ROW_S, DRAFT_S = 0.3, 0.01, 0.05  # a target step, each row more, a draft step (seconds)
REPEAT = list(range(100, 132))  # a 32-token continuation found in an earlier request


def _table(seconds) -> StepCosts:
    return StepCosts({rows: seconds(rows) for rows in MEASURED_ROWS})


def _policy(draft_rate: float = 0.7, suffix_rate: float = 0.5, requests: int = 1, k_max: int = 7):
    """`requests` requests' policies over a target whose rows cost TARGET_ROW_S each and a draft step of
    DRAFT_S; the first has chosen its k for this round."""
    costs = RoundCosts(SimpleNamespace(target=_table(lambda rows: TARGET_S + TARGET_ROW_S * (rows - 1)),
                                       draft=_table(lambda rows: DRAFT_S)))
    shared = Speculation(costs=costs)
    shared.acceptance.prior, shared.suffix.prior = draft_rate, suffix_rate
    policies = [shared.for_request("code") for _ in range(requests)]
    for policy in policies:
        policy.arrive()
    ks = [policy.choose(k_max) for policy in policies]
    return policies[0], ks[0], shared


def _round_s(k: int, rows: int) -> float:
    return k * DRAFT_S + TARGET_S + TARGET_ROW_S * (rows - 1)


def test_a_long_repeat_found_in_the_index_beats_the_draft_model():
    policy, k, _ = _policy(suffix_rate=0.95)
    assert k > 0  # the draft pays on its own
    chosen, count = policy.choose_proposal(k, [FreeProposal(SUFFIX, REPEAT, match_length=40)])
    assert chosen.source == SUFFIX and count > k
    # Alone, a suffix round runs no draft step: it is priced as the target's step over 1 + count rows.
    expected = policy.suffix[suffix_bucket(40)].expected_tokens(count)
    assert policy._free_goodput(policy.suffix[suffix_bucket(40)], count, k) == pytest.approx(
        expected / _round_s(0, 1 + count))


def test_the_draft_model_keeps_the_round_when_the_index_is_rarely_right():
    policy, k, _ = _policy(suffix_rate=0.1)
    assert k > 0
    assert policy.choose_proposal(k, [FreeProposal(SUFFIX, REPEAT, match_length=4)]) == (None, 0)


def test_the_best_of_several_offers_and_how_many_of_its_tokens():
    policy, k, shared = _policy(draft_rate=0.05, suffix_rate=0.9)  # a draft that never pays: k = 0
    shared.lookup.prior = 0.3
    assert k == 0
    offers = [FreeProposal(LOOKUP, REPEAT[:8]), FreeProposal(SUFFIX, REPEAT, match_length=20)]
    chosen, count = policy.choose_proposal(0, offers)
    assert chosen.source == SUFFIX
    suffix = policy.suffix[suffix_bucket(20)]
    best = max(range(1, len(REPEAT) + 1), key=lambda m: suffix.expected_tokens(m) / _round_s(0, 1 + m))
    assert count == best
    assert suffix.expected_tokens(count) / _round_s(0, 1 + count) > (1 + MARGIN) * 1.0 / _round_s(0, 1)


def test_nothing_to_offer_or_nothing_timed_keeps_the_draft():
    policy, k, _ = _policy()
    assert policy.choose_proposal(k, []) == (None, 0)
    fresh = Speculation().for_request("code")  # no step costs reported, no round timed
    fresh.arrive()
    assert fresh.choose_proposal(fresh.choose(7), [FreeProposal(SUFFIX, REPEAT, match_length=40)]) == (None, 0)


def test_suffix_acceptance_is_learned_by_match_length_apart_from_the_others():
    policy, k, shared = _policy(suffix_rate=0.9)
    draft_rates, lookup_rates = policy.acceptance.rates(), policy.lookup.rates()
    long_before = policy._acceptance_of(FreeProposal(SUFFIX, REPEAT, match_length=40)).rates()[0]
    short = FreeProposal(SUFFIX, REPEAT[:8], match_length=3)
    for _ in range(20):
        policy.choose(7)
        policy.observe(RoundTiming(draft_s=0.0, verify_s=0.3), drafted=0, accepted=0, free=short)  # all rejected
    assert policy._acceptance_of(short).rates()[0] < 0.1
    assert policy._acceptance_of(FreeProposal(SUFFIX, REPEAT, match_length=40)).rates()[0] == pytest.approx(
        long_before)
    assert policy.lookup.rates() == pytest.approx(lookup_rates)
    assert policy.acceptance.rates() == pytest.approx(draft_rates)
    assert policy.choose_proposal(policy.choose(7), [short]) == (None, 0)


def test_beside_requests_that_draft_a_suffix_round_still_pays_their_draft_steps():
    policy, k, shared = _policy(suffix_rate=0.95, requests=4)
    assert k > 0
    acceptance = policy._acceptance_of(FreeProposal(SUFFIX, REPEAT, match_length=40))
    batch = shared.batch()
    others = shared.tokens(k, batch) - policy.acceptance.expected_tokens(k)
    # 4 sessions: the others' k draft steps, and a target step over their 3 (k + 1) rows and this one's 1 + m.
    assert policy._free_goodput(acceptance, 10, k) == pytest.approx(
        (others + acceptance.expected_tokens(10)) / shared.costs.round_s(k, batch, 10 - k))
    assert shared.costs.round_s(k, batch, 10 - k) > shared.costs.round_s(0, batch, 10)
