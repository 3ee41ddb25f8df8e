"""Prompt lookup (orchestrator.decoding.lookup): what it proposes, and what the policy verifies of it."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
from hypothesis import given, settings, strategies as st

from orchestrator.decoding.costs import BatchLoad, RoundCosts
from orchestrator.decoding.request import RoundTiming
from orchestrator.decoding.lookup import PromptLookup
from orchestrator.decoding.plan import RoundOutcome
from orchestrator.decoding.proposals import LOOKUP, FreeProposal
from orchestrator.decoding.policy import MARGIN, Speculation
from policy_costs import plan
from specmesh.engine.step_costs import MEASURED_ROWS, StepCosts
from specmesh.engine.step_model import StepModel, StepShape

pytestmark = pytest.mark.unit


def test_proposes_what_followed_the_longest_recurring_suffix():
    # ... 5 6 7 occurred followed by 8 9; 6 7 alone later, followed by 1.
    sequence = [5, 6, 7, 8, 9, 0, 6, 7, 1, 2, 5, 6, 7]
    assert PromptLookup(sequence).propose(4) == [8, 9, 0, 6]  # the 3-gram wins over the later 2-gram


def test_the_latest_occurrence_and_a_short_suffix():
    sequence = [1, 2, 3, 1, 2, 4, 9, 1, 2]
    assert PromptLookup(sequence).propose(2) == [4, 9]  # 1 2 was followed by 3, then later by 4
    assert PromptLookup([1, 2, 3, 4]).propose(3) == []  # nothing recurs
    assert PromptLookup([7, 7]).propose(3) == []  # one token: below the shortest n-gram
    assert PromptLookup([3, 1, 2, 3, 1]).propose(0) == []


def test_follows_the_sequence_as_it_grows():
    sequence = [1, 2, 3, 4]
    lookup = PromptLookup(sequence)
    assert lookup.propose(2) == []
    sequence.extend([1, 2])  # the committed sequence the loop extends in place
    assert lookup.propose(2) == [3, 4]
    sequence.extend([3, 9, 1, 2])
    assert lookup.propose(3) == [3, 9, 1]  # the newer continuation of 1 2 3 ... and of 1 2


def test_rejects_impossible_ngram_bounds():
    with pytest.raises(ValueError, match="min_ngram"):
        PromptLookup([], max_ngram=2, min_ngram=3)


def _brute_force(sequence: list[int], limit: int, max_ngram: int = 3, min_ngram: int = 2) -> list[int]:
    for n in range(min(max_ngram, len(sequence)), min_ngram - 1, -1):
        tail = sequence[-n:]
        for start in range(len(sequence) - n - 1, -1, -1):  # the latest earlier occurrence with a follower
            if sequence[start:start + n] == tail:
                return sequence[start + n:start + n + limit]
    return []


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 4), max_size=40), st.lists(st.integers(0, 4), max_size=10), st.integers(1, 5))
def test_incremental_index_matches_a_brute_force_search(head, tail, limit):
    """Indexed once on `head`, then read after `tail` was appended: the same as searching afresh."""
    sequence = list(head)
    lookup = PromptLookup(sequence)
    assert lookup.propose(limit) == _brute_force(sequence, limit)
    sequence.extend(tail)
    assert lookup.propose(limit) == _brute_force(sequence, limit)


def _table(seconds, model: StepModel | None = None) -> StepCosts:
    """A service's costs: its start-up table `seconds(rows)` at the measured sizes, and its model over it."""
    return StepCosts({rows: seconds(rows) for rows in MEASURED_ROWS}, model)


def _policies(target: StepCosts, lookup_rate: float, requests: int = 1, context: int = 0):
    """`requests` requests' policies under target-only rounds (a draft whose 100 s steps never pay), prompt
    lookup's acceptance `lookup_rate` at every position; each has chosen this round's k over `context` tokens."""
    shared = Speculation(costs=RoundCosts(SimpleNamespace(target=target, draft=_table(lambda rows: 100.0))))
    shared.lookup.prior = lookup_rate
    policies = [shared.for_request("code") for _ in range(requests)]
    for policy in policies:
        policy.arrive()
    assert [plan(policy, 4, context).k for policy in policies] == [0] * requests
    return policies, shared


def _lookup_length(policy, available: int) -> int:
    """How many of `available` prompt-lookup tokens the policy verifies in a target-only round (0: none pays)."""
    offer = FreeProposal(LOOKUP, list(range(100, 100 + available)))
    free = plan(policy, 4, policy.context, offers=lambda: [offer]).free
    return len(free.tokens) if free is not None else 0


def _lookup_tokens(rate: float, m: int) -> float:
    """E(m): committed tokens of a round verifying m lookup tokens accepted at `rate` each (and the bonus)."""
    return sum(rate ** position for position in range(m + 1))


def _optimum(goodput, available: int) -> int:
    """The count the policy should verify: the best, where it beats none by MARGIN."""
    best = max(range(1, available + 1), key=goodput)
    return best if goodput(best) > (1 + MARGIN) * goodput(0) else 0


def test_lookup_tokens_ride_a_step_whose_extra_rows_are_nearly_free():
    [policy], _ = _policies(_table(lambda rows: 0.3 + 0.001 * rows), lookup_rate=0.6)
    assert policy.lookup.expected_tokens(4) == pytest.approx(_lookup_tokens(0.6, 4))
    assert _lookup_length(policy, 4) == 4  # each row costs 0.3 % more, each token brings 60 % of one more
    assert _lookup_length(policy, 0) == 0


def test_no_lookup_where_its_rows_cost_more_than_they_bring():
    # Every row costs as much as a one-row step: one token accepted 30 % of the time never pays for it.
    [policy], _ = _policies(_table(lambda rows: 0.3 * rows), lookup_rate=0.3)
    assert _lookup_length(policy, 4) == 0


@pytest.mark.parametrize("requests", [1, 4])
def test_lookup_length_is_the_analytic_optimum(requests):
    """Rows cost 5 % each past the first; acceptance 0.5 a position. Alone E(m) = 2 - 0.5^m over 1 + 0.05 m
    peaks at m = 3; beside three others verifying none, (3 + E(m)) / (1 + 0.05 (3 + m)) at m = 2."""
    [policy, *_], _ = _policies(_table(lambda rows: 1.0 + 0.05 * (rows - 1)), lookup_rate=0.5, requests=requests)

    def goodput(m: int) -> float:
        return (requests - 1 + _lookup_tokens(0.5, m)) / (1.0 + 0.05 * (requests - 1 + m))
    assert _lookup_length(policy, 6) == _optimum(goodput, 6) == {1: 3, 4: 2}[requests]


def test_the_service_models_sessions_and_context_price_the_rows():
    """A target whose steps cost 20 ms a session more and 1 ms per 1000 attended pairs (its fitted model):
    the round the policy prices is that model's, over the batch's sessions and context."""
    model = StepModel((1.2, 0.02, 0.001))
    target = _table(lambda rows: 0.1 + 0.004 * rows, model)
    policies, shared = _policies(target, lookup_rate=0.5, requests=3, context=3000)
    batch = shared.rule().batch
    assert batch == BatchLoad(requests=3, context=9000)
    for m in range(5):  # a target-only round: 3 sessions, 3 + m rows, each row over a session's 3000 tokens
        assert shared.costs.round_s(0, batch, m) == pytest.approx(
            1.2 * (0.1 + 0.004 * (3 + m)) + 0.02 * 2 + 0.001 * 3 * (3 + m))

    def goodput(m: int) -> float:
        return (2 + _lookup_tokens(0.5, m)) / shared.costs.round_s(0, batch, m)
    # every plan reads the batch as it stands: the three requests' contexts
    assert _lookup_length(policies[-1], 5) == _optimum(goodput, 5) > 0


def test_lookup_rows_over_a_long_context_pay_for_their_attention():
    """One request over 20 000 cached tokens at 50 ms per 1000 attended pairs: each lookup row attends over
    them too (another 1 s a row on a 1.3 s round) and brings 0.6 of a token: none pays."""
    target = _table(lambda rows: 0.3 + 0.001 * rows, StepModel((1.0, 0.0, 0.05)))
    [policy], shared = _policies(target, lookup_rate=0.6, context=20_000)
    batch = shared.rule().batch
    assert shared.costs.round_s(0, batch, 2) == pytest.approx(target.step_s(StepShape(1, 3, 3 * 20_000)))
    assert _lookup_length(policy, 4) == 0


def test_more_requests_in_flight_make_rows_dearer():
    """Steps up to 8 rows cost one weight pass (the GPU-like flat part), past that each row 1/8 more: alone,
    lookup rows ride free; beside more requests each row is paid for and brings less of the round's tokens."""
    target = _table(lambda rows: 0.4 * max(1.0, rows / 8))
    lengths = {}
    for requests in (1, 4, 8, 16):
        [policy, *_], _ = _policies(target, lookup_rate=0.6, requests=requests)
        lengths[requests] = _lookup_length(policy, 6)
    assert lengths[1] == 6  # 7 rows: inside the flat part
    assert lengths[1] >= lengths[4] >= lengths[8] >= lengths[16] == 0
    assert lengths[4] == 4 and lengths[8] == 0  # 4 + 4 rows fill the flat part; past it, 1/8 the round a row


def test_learns_lookup_acceptance_apart_from_the_drafts():
    [policy], shared = _policies(_table(lambda rows: 0.3 + 0.001 * rows), lookup_rate=0.5)
    draft_rates = policy.acceptance.rates()
    assert _lookup_length(policy, 4) == 4
    for _ in range(20):  # all rejected
        policy.learn(replace(plan(policy, 4), free=FreeProposal(LOOKUP, [1, 2, 3, 4])),
                     RoundOutcome(RoundTiming(draft_s=0.0, verify_s=0.3)))
    assert policy.lookup.rates()[0] < 0.1
    assert shared.lookup.deployment.rejections > 0 and shared.acceptance.deployment.rejections == 0
    assert policy.acceptance.rates() == pytest.approx(draft_rates)  # the draft's history untouched
    assert _lookup_length(policy, 4) == 0  # and lookup stops paying
    # A round that verified lookup tokens times the target step they widened (the 1 + 4 rows priced).
    assert shared.costs.target_ratio.get(1.0) == pytest.approx(0.3 / (0.3 + 0.001 * 5))
