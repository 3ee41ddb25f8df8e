"""The cross-request suffix index (orchestrator.decoding.suffix_index): what it proposes, and what it holds."""

from __future__ import annotations

import random
import time
import tracemalloc

import pytest
from hypothesis import given, settings, strategies as st

from orchestrator.decoding.suffix_index import (
    DOCUMENT_BYTES, KEY_LENGTHS, MAX_CANDIDATES, MAX_MATCH, MIN_MATCH, TOKEN_BYTES, SuffixIndex,
)


def _index_of(*documents: list[int], max_bytes: int | None = None) -> SuffixIndex:
    index = SuffixIndex() if max_bytes is None else SuffixIndex(max_bytes)
    for tokens in documents:
        index.open().extend(tokens)
    return index


def _random_tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(50_000) for _ in range(count)]


@pytest.mark.unit
def test_an_exact_earlier_request_is_proposed_in_full():
    earlier = _random_tokens(random.Random(1), 100)
    index = _index_of(_random_tokens(random.Random(2), 100), earlier, _random_tokens(random.Random(3), 100))
    proposal = index.propose(earlier[:40], 50)
    assert proposal.tokens == earlier[40:90]
    assert proposal.match_length == 40
    assert proposal.confidence == [1.0] * 50


@pytest.mark.unit
def test_the_longest_match_wins_over_a_shorter_more_frequent_one():
    longer = [7, 8, 1, 2, 3, 40, 41, 42]
    shorter = [9, 1, 2, 3, 50, 51, 52]
    index = _index_of(longer, shorter, shorter, shorter)  # the shorter match: newer and three times as often
    proposal = index.propose([6, 7, 8, 1, 2, 3], 3)
    assert (proposal.tokens, proposal.match_length) == ([40, 41, 42], 5)
    tied = index.propose([5, 1, 2, 3], 3)  # three tokens match everywhere: the majority
    assert (tied.tokens, tied.match_length) == ([50, 51, 52], 3)
    assert tied.confidence == [0.75, 0.75, 0.75]


@pytest.mark.unit
def test_majority_vote_and_confidence_falling_as_occurrences_disagree():
    index = _index_of([10, 11, 12, 20, 21, 22], [10, 11, 12, 20, 21, 22],
                      [10, 11, 12, 20, 21, 23], [10, 11, 12, 30, 31, 32])
    proposal = index.propose([10, 11, 12], 10)
    assert proposal.tokens == [20, 21, 22]  # then both agreeing documents end
    assert proposal.confidence == [0.75, 0.75, 0.5]
    assert proposal.match_length == 3


@pytest.mark.unit
def test_too_little_agreement_proposes_nothing_and_ties_go_to_the_newest():
    scattered = _index_of(*([10, 11, 12, 100 + i] for i in range(5)))  # five continuations, one each
    proposal = scattered.propose([10, 11, 12], 4)
    assert (proposal.tokens, proposal.match_length) == ([], 3)
    tie = _index_of([10, 11, 12, 1], [10, 11, 12, 2])
    assert tie.propose([10, 11, 12], 4).tokens == [2]
    assert tie.propose([10, 11, 12], 4).confidence == [0.5]


@pytest.mark.unit
def test_a_request_in_flight_is_found_as_it_grows():
    index = SuffixIndex()
    earlier, other = index.open(), index.open()
    earlier.extend([0, 1, 2, 3, 4, 5, 6])
    other.extend([9, 1, 2, 3, 7])
    assert index.propose([9, 1, 2, 3], 4).tokens == [7]  # the longer match: `other`'s
    other.extend([8, 9])  # the other request commits more: its continuation grows
    assert index.propose([9, 1, 2, 3], 4).tokens == [7, 8, 9]
    assert index.propose([0, 1, 2, 3], 4).tokens == [4, 5, 6]


@pytest.mark.unit
def test_a_documents_tail_is_not_its_own_match():
    index = SuffixIndex()
    document = index.open()
    document.extend([5, 6])
    assert index.propose([5, 6], 4).match_length == 0  # 5 6 has no token after it yet
    document.extend([7, 8, 5, 6])
    proposal = index.propose([8, 5, 6], 4)
    assert (proposal.tokens, proposal.match_length) == ([7, 8, 5, 6], 2)


@pytest.mark.unit
def test_limit_and_short_or_empty_sequences():
    tokens = list(range(100, 140))
    index = _index_of(tokens)
    assert index.propose(tokens[:5], 3).tokens == tokens[5:8]
    assert index.propose(tokens[:5], 0).tokens == []
    assert index.propose(tokens[:5], -1).match_length == 0
    assert index.propose([], 5).tokens == []
    assert index.propose(tokens[3:4], 5).tokens == []  # one token: below the shortest match
    assert index.propose([1, 2, 3], 5).tokens == []  # never seen
    assert index.propose(tuple(tokens[:5]), 2).tokens == tokens[5:7]  # any sequence type


@pytest.mark.unit
def test_the_match_is_measured_back_to_max_match():
    tokens = _random_tokens(random.Random(4), 3 * MAX_MATCH)
    proposal = _index_of(tokens).propose(tokens[:2 * MAX_MATCH], 4)
    assert (proposal.tokens, proposal.match_length) == (tokens[2 * MAX_MATCH:2 * MAX_MATCH + 4], MAX_MATCH)


@pytest.mark.unit
def test_invalid_budget_names_the_argument():
    for bad in (0, -1):
        with pytest.raises(ValueError, match="max_bytes"):
            SuffixIndex(bad)


def _keys(index: SuffixIndex) -> dict[int, set[int]]:
    return {n: set(table) for n, table in index._tables.items()}


@pytest.mark.unit
def test_the_oldest_documents_are_evicted_with_their_index_entries():
    document_bytes = DOCUMENT_BYTES + 50 * TOKEN_BYTES
    index = SuffixIndex(max_bytes=int(4.5 * document_bytes))  # four documents of 50 tokens fit
    rng = random.Random(5)
    documents = [_random_tokens(rng, 50) for _ in range(6)]
    handles = []
    for tokens in documents:
        handles.append(index.open())
        handles[-1].extend(tokens)
        assert index.bytes_used <= index.max_bytes
    assert len(index) == 4
    for evicted in documents[:2]:
        assert index.propose(evicted[:10], 5).tokens == []
    for held in documents[2:]:
        assert index.propose(held[:10], 5).tokens == held[10:15]
    handles[0].extend([1, 2, 3])  # an evicted document takes no more tokens
    assert index.bytes_used == 4 * document_bytes
    assert _keys(index) == _keys(_index_of(*documents[2:]))  # no stale keys left behind


@pytest.mark.unit
def test_a_document_bigger_than_the_budget_keeps_within_it():
    max_bytes = 1 << 20
    index = _index_of([1, 2, 3, 4], max_bytes=max_bytes)
    huge = index.open()
    tokens = _random_tokens(random.Random(6), 10 * max_bytes // TOKEN_BYTES)
    huge.extend(tokens)
    assert index.bytes_used <= max_bytes
    assert len(index) == 2  # the earlier request is still held: one document takes at most a quarter
    assert 0 < len(huge) <= max_bytes // 4 // TOKEN_BYTES
    assert index.propose(tokens[:20], 3).tokens == tokens[20:23]
    assert index.propose([1, 2], 2).tokens == [3, 4]


def _traced_while_filling(max_bytes: int, fill) -> tuple[int, SuffixIndex]:
    """The most memory traced above the baseline after any step of `fill(index)`, a generator."""
    tracemalloc.start()
    try:
        baseline = tracemalloc.get_traced_memory()[0]
        index = SuffixIndex(max_bytes)
        most = 0
        for _ in fill(index):
            most = max(most, tracemalloc.get_traced_memory()[0] - baseline)
            assert index.bytes_used <= max_bytes
        return most, index
    finally:
        tracemalloc.stop()


def test_the_budget_bounds_the_memory_really_held():
    max_bytes = 4 << 20
    rng = random.Random(7)

    def fill(index):
        for _ in range(150):  # about six times the budget, in documents of random (all distinct) n-grams
            index.open().extend(_random_tokens(rng, 300))
            yield
        index.open().extend(_random_tokens(rng, 100_000))  # one huge request
        yield
        for _ in range(30):
            index.open().extend(_random_tokens(rng, 300))
            yield

    most, index = _traced_while_filling(max_bytes, fill)
    assert most <= 1.5 * max_bytes, f"{most} bytes traced for a budget of {max_bytes}"
    assert index.bytes_used > max_bytes // 2  # the budget is used, not sidestepped
    assert sum(len(table) for table in index._tables.values()) <= len(KEY_LENGTHS) * index.bytes_used / TOKEN_BYTES


@pytest.mark.unit
def test_repetitive_history_stays_fast_and_small():
    max_bytes = 4 << 20

    def fill(index):
        index.open().extend([7] * 200_000)
        yield
        index.open().extend([3, 4] * 100_000)
        yield
        for _ in range(5):  # more requests that repeat: the same keys, in every document
            index.open().extend([7] * 300)
            yield

    most, index = _traced_while_filling(max_bytes, fill)
    assert most <= 1.5 * max_bytes
    assert len(index) == 7
    assert all(len(held) <= MAX_CANDIDATES for table in index._tables.values()
               for held in table.values() if isinstance(held, list))
    for query in ([7] * 500, [3, 4] * 250, [4, 3, 4, 3, 7, 7]):
        started = time.perf_counter()
        proposal = index.propose(query, 1_000)
        assert time.perf_counter() - started < 0.2
        assert proposal.match_length >= MIN_MATCH
        assert set(proposal.tokens) <= set(query)


@pytest.mark.unit
def test_extend_on_repetitive_history_is_not_quadratic():
    index = SuffixIndex()
    started = time.perf_counter()
    index.open().extend([7] * 200_000)  # stored up to the per-document cap
    index.open().extend([3, 4] * 100_000)
    assert time.perf_counter() - started < 5.0


def _brute_force_match(documents: list[list[int]], sequence: list[int]) -> int:
    """The longest suffix of `sequence` that occurs with a token after it, capped at MAX_MATCH (0 below MIN_MATCH)."""
    best = 0
    for tokens in documents:
        for position in range(1, len(tokens)):
            length = 0
            while (length < min(position, len(sequence), MAX_MATCH)
                   and tokens[position - 1 - length] == sequence[-1 - length]):
                length += 1
            best = max(best, length)
    return best if best >= MIN_MATCH else 0


def _occurrences(documents: list[list[int]], ngram: list[int]) -> int:
    n = len(ngram)
    return sum(tokens[p - n:p] == ngram for tokens in documents for p in range(n, len(tokens)))


@pytest.mark.unit
@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), max_size=30), min_size=1, max_size=4),
       st.lists(st.integers(0, 3), max_size=12), st.integers(1, 8))
def test_every_proposal_followed_its_matched_suffix_in_a_held_document(documents, sequence, limit):
    index = SuffixIndex()
    handles = [index.open() for _ in documents]
    for handle, tokens in zip(handles, documents):
        handle.extend(tokens)
    proposal = index.propose(sequence, limit)
    searched = documents
    assert len(proposal.tokens) == len(proposal.confidence) <= limit
    assert all(0 < later <= earlier <= 1 for earlier, later in zip([1.0] + proposal.confidence, proposal.confidence))
    if len(sequence) >= MIN_MATCH and _occurrences(searched, sequence[-MIN_MATCH:]) <= MAX_CANDIDATES:
        assert proposal.match_length == _brute_force_match(searched, sequence)  # nothing crowded out
    if proposal.tokens:
        m, proposed = proposal.match_length, proposal.tokens
        assert m >= MIN_MATCH
        assert any(tokens[p - m:p] == sequence[-m:] and tokens[p:p + len(proposed)] == proposed
                   for tokens in searched for p in range(m, len(tokens)))
