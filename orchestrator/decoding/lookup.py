"""Drafts that cost no forward pass: the continuation of the sequence's last n-gram where it occurred before.

Prompt lookup (n-gram drafting): when the last `n` committed tokens occurred earlier
in the sequence (prompt or output), the tokens that followed them there are
proposed as the next ones. Code that repeats a name, an edit that copies its
input, a list that continues a pattern: the target would write the same tokens,
and verifying them rides the target step the round runs anyway, as extra rows.

The policy (orchestrator.decoding.policy) weighs such a proposal every round
against the draft model's tokens and the suffix index's, and sends as many of its
tokens as pay for their rows. The draft model's session sees them only once they
are committed.

Lossless: the proposal is a function of the committed sequence alone, so as a
draft its distribution q is one-hot; the target accepts a token with probability
p(token) and on a rejection samples from p without it, which is p again
(specmesh verification with ids and no distributions). Under greedy the target's
argmax decides every token, as always.
"""

from __future__ import annotations

from orchestrator.decoding.suffix_index import MIN_MATCH  # the shortest match that predicts: one rule for both

MAX_NGRAM = 3  # the longest suffix matched: longer ones rarely recur in a short context


class PromptLookup:
    """An index of the sequence's n-grams (MIN_MATCH..MAX_NGRAM) to the latest place each was followed
    by a token, kept up to date as the sequence grows: O(1) per token and per proposal."""

    def __init__(self, sequence: list[int], max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_MATCH):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.sequence = sequence  # the caller's committed sequence, read as it grows
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self._followed: dict[tuple[int, ...], int] = {}  # n-gram -> index just past its latest occurrence
        self._indexed = 0  # n-grams ending before this index are in _followed

    def _catch_up(self) -> None:
        """Index every n-gram that now has a token after it (so the sequence's own tail is never its match)."""
        sequence = self.sequence
        for end in range(max(self._indexed, 1), len(sequence)):  # n-grams ending just before `end`
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                self._followed[tuple(sequence[end - n:end])] = end
        self._indexed = max(self._indexed, len(sequence))

    def propose(self, limit: int) -> list[int]:
        """Up to `limit` tokens that followed the longest recurring suffix of the sequence, or []."""
        if limit <= 0:
            return []
        self._catch_up()
        sequence = self.sequence
        for n in range(min(self.max_ngram, len(sequence)), self.min_ngram - 1, -1):
            start = self._followed.get(tuple(sequence[-n:]))
            if start is not None:
                return sequence[start:start + limit]
        return []
