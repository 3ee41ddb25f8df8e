"""Prompt lookup (orchestrator.decoding.lookup): what it proposes, and what the policy verifies of it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given, settings, strategies as st

from orchestrator.decoding.costs import BatchLoad, RoundCosts, step_s
from orchestrator.decoding.lookup import PromptLookup
from orchestrator.decoding.policy import AdaptiveSpeculation
from specmesh.step_costs import StepCosts


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


def _flat(seconds):
    return StepCosts({rows: seconds(rows) for rows in (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 48, 64)})


def _policy(target, lookup_rate: float, others: int = 0):
    """A request's policy beside `others` requests, all under target-only rounds (a draft that never pays),
    prompt lookup's acceptance `lookup_rate` at every position."""
    shared = AdaptiveSpeculation(costs=RoundCosts(SimpleNamespace(target=_flat(target), draft=_flat(lambda r: 100.0))))
    shared.lookup.prior = lookup_rate
    policies = [shared.for_request("code") for _ in range(others + 1)]
    for policy in policies:
        policy.arrive()
    assert [policy.choose(4) for policy in policies] == [0] * len(policies)  # a 100 s draft step never pays
    return policies[0], shared


def test_lookup_tokens_ride_a_step_whose_extra_rows_are_nearly_free():
    policy, _ = _policy(lambda rows: 0.3 + 0.001 * rows, lookup_rate=0.6)
    assert policy.lookup_length(4) == 4  # each row costs 0.3 % more, each token brings 60 % of one more
    assert policy.lookup_expected == pytest.approx(1 + 0.6 + 0.36 + 0.216 + 0.1296, rel=0.05)


def test_no_lookup_where_its_rows_cost_more_than_they_bring():
    # Every row costs as much as a one-row step: one token accepted 30 % of the time never pays for it.
    policy, _ = _policy(lambda rows: 0.3 * rows, lookup_rate=0.3)
    assert policy.lookup_length(4) == 0
    assert policy.lookup_rows == 0


def test_lookup_length_is_the_analytic_optimum():
    """Rows cost 5 % each past the first; acceptance 0.5 a position: E(m) = 2 - 0.5^m over seconds
    1 + 0.05 m peaks at m = 3 (m = 4 adds 1/16 of a token for 5 % more time)."""
    policy, _ = _policy(lambda rows: 1.0 + 0.05 * (rows - 1), lookup_rate=0.5)
    gains = {m: (2 - 0.5 ** m) / (1 + 0.05 * m) for m in range(1, 6)}
    assert policy.lookup_length(5) == max(gains, key=gains.get) == 3


def test_the_others_lookup_rows_are_priced_in():
    """Beside requests that verify lookup tokens, a step is already wider: the batch's rows count them."""
    policy, shared = _policy(lambda rows: 0.3 + 0.001 * rows, lookup_rate=0.6, others=3)
    others = [p for p in shared.active.values() if p is not policy]
    for other in others:
        other.lookup_length(4)
    load = shared.batch_load(policy, drafting=False)
    assert load.rows == 3 * (1 + 4) and load.lookup_rows == 3 * 4
    assert load.tokens == pytest.approx(sum(other.lookup_expected for other in others))
    assert policy.choose(4) == 0 and policy.lookup_rows == 0  # a new round starts with no lookup rows


def test_rows_past_a_decode_step_never_look_free():
    """Decode steps keep the table's current cost at their sizes: 16 sessions of one row at 486 ms, where
    the start-up table put 16 rows of one session at 310 and 24 at 429 (the 2-core EPYC, 2026-11-26).
    Read at 17-24 rows, the current table fell back to the start-up figures and lookup rows looked
    cheaper than none; priced in proportion to the start-up table, one more row costs about 5 %."""
    table = _flat(lambda rows: 0.31 + 0.015 * max(0, rows - 16) if rows >= 16 else 0.25)
    table.seconds = {**table.seconds, 16: 0.486}  # as decode steps of 16 sessions left it
    assert step_s(table, 20) < step_s(table, 16)  # read at the total: rows look free
    assert step_s(table, 16, extra_rows=4) == pytest.approx(0.486 * (0.31 + 4 * 0.015) / 0.31)
    shared = AdaptiveSpeculation(costs=RoundCosts(SimpleNamespace(target=table, draft=_flat(lambda r: 100.0))))
    shared.lookup.prior = 0.5
    policies = [shared.for_request("code") for _ in range(16)]
    for policy in policies:
        policy.arrive()
    assert [policy.choose(4) for policy in policies] == [0] * 16
    # One more row: +2.9 % time for +3.1 % tokens at best (a 0.5 chance of one token among 16): not 2 % better.
    assert policies[0].lookup_length(4) == 0


def test_undecided_requests_are_priced_with_this_rounds_lookup_rows():
    """Their tokens are priced as this round's (tokens_with), so their rows must be too."""
    load = BatchLoad(rows=3, tokens=3.0, undecided=2)
    assert load.with_round(0, lookup=2) == (3 + 3 * (1 + 2), 0, 0)
    assert load.tokens_with(1.8) == pytest.approx(3.0 + 3 * 1.8)


def test_learns_lookup_acceptance_apart_from_the_drafts():
    policy, shared = _policy(lambda rows: 0.3 + 0.001 * rows, lookup_rate=0.5)
    timing = SimpleNamespace(draft_s=0.0, verify_s=0.3)
    draft_rates = policy.acceptance.rates()
    for _ in range(20):
        policy.choose(4)
        policy.lookup_length(4)
        policy.observe(timing, drafted=0, accepted=0, looked_up=4)  # every lookup token rejected
    assert policy.lookup.rates()[0] < 0.1
    assert shared.lookup.deployment.rejections > 0 and shared.acceptance.deployment.rejections == 0
    assert policy.acceptance.rates()[0] == pytest.approx(draft_rates[0])  # the draft's history untouched
    assert policy.lookup_length(4) == 0  # and lookup stops paying
