"""Drafts that cost no forward pass, from recent requests: what followed the sequence's suffix in them.

Suffix decoding: agents, tools and templated clients send many requests that share
long stretches (a system prompt, a file the model rewrites, a JSON schema it fills
in again). The orchestrator keeps the tokens of recent requests (prompt, then the
output as it commits) in one index, and for a request in flight proposes the most
likely continuation of its current suffix from what they said, its own tokens
included (an edit that copies its prompt). Prompt lookup (orchestrator.decoding.
lookup) looks only inside the request, at its latest 2-3-token match; this module
only indexes and proposes, and the caller verifies the tokens like any draft
(lossless for the same reason: the proposal is a function of committed tokens alone).

How: every n-gram of a few lengths (KEY_LENGTHS) that has a token after it is keyed
by its hash to the places it occurred (at most MAX_CANDIDATES, the most recent). A
proposal looks the sequence's suffix up from the longest key down, measures each
hit's real match backwards (up to MAX_MATCH tokens, which also rules out hash
collisions), keeps the hits with the longest match and walks forward by majority
vote. Costs do not depend on how much history is held: O(len(KEY_LENGTHS)) per
indexed token, O(MAX_MATCH + MAX_CANDIDATES * limit) per proposal.

A request that re-asks an earlier one with other names also gets a twin: a document holding
the earlier output with the same renames (orchestrator.decoding.renamed_repeats), dropped when
the request ends.

Memory: each stored token is charged TOKEN_BYTES (its storage and its index
entries) and each document DOCUMENT_BYTES; past max_bytes the oldest documents are
evicted, index entries included. A document keeps at most a quarter of the budget's
tokens (its first ones; later ones are neither stored nor indexed), so one huge
request cannot push out all the others. Token ids must fit in 32 bits.
"""

from __future__ import annotations

from array import array
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from itertools import islice
from typing import Sequence

from orchestrator.decoding.renamed_repeats import rename, renaming

DEFAULT_MAX_BYTES = 64 << 20
MIN_MATCH = 2  # one token matches everywhere and predicts little
MAX_MATCH = 64  # matches are measured back this far: longer evidence adds little
KEY_LENGTHS = (2, 4, 8, 16, 32)  # n-grams indexed: a long match is found even where short keys are crowded
MAX_CANDIDATES = 8  # occurrences kept per key, the most recent: bounds a proposal on repetitive history
CONFIDENCE_FLOOR = 0.25  # stop proposing once fewer than this share of the occurrences agree
# Per stored token: 4 bytes in its array and up to len(KEY_LENGTHS) dict entries (table slots, int key,
# int value); tracemalloc shows 360-690 on all-distinct n-grams, as dict tables swing between resizes.
TOKEN_BYTES = 800
DOCUMENT_BYTES = 512  # the document object, its array header, its place in the order of documents
_POSITION_BITS = 32  # an occurrence is one int: document serial << _POSITION_BITS | position
_POSITION_MASK = (1 << _POSITION_BITS) - 1
RENAME_CANDIDATES = 16  # the most recent requests a new prompt is compared with for a renamed repeat


@dataclass(frozen=True)
class SuffixProposal:
    tokens: list[int] = field(default_factory=list)  # the proposed continuation, may be empty
    match_length: int = 0  # trailing tokens of the sequence that matched the history (0 if none)
    confidence: list[float] = field(default_factory=list)  # per token: share of occurrences agreeing so far


class IndexedDocument:
    """One request's tokens in the index; `extend` appends committed tokens and indexes them."""

    __slots__ = ("_index", "serial", "tokens", "evicted", "prompt_length", "twin")

    def __init__(self, index: SuffixIndex, serial: int):
        self._index, self.serial = index, serial
        self.tokens = array("i")
        self.evicted = False  # an evicted document ignores further tokens
        self.prompt_length = 0  # its first tokens that were the request's prompt
        self.twin = False  # a predicted output (a renamed repeat's), not a request's own tokens

    def extend(self, tokens: Sequence[int]) -> None:
        self._index._extend(self, tokens)

    def __len__(self) -> int:
        return len(self.tokens)


def _key(ngram: array) -> int:
    return hash(ngram.tobytes())


class SuffixIndex:
    """Recent requests' tokens, indexed by n-gram, within max_bytes (oldest documents evicted first)."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES):
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.max_bytes = max_bytes
        self._document_cap = min(max_bytes // 4 // TOKEN_BYTES, _POSITION_MASK)
        self._documents: OrderedDict[int, IndexedDocument] = OrderedDict()  # serial -> document, oldest first
        self._tables: dict[int, dict[int, int | list[int]]] = {n: {} for n in KEY_LENGTHS}
        self._serial = 0
        self._bytes = 0

    @property
    def bytes_used(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._documents)

    def open(self, prompt: Sequence[int] = ()) -> IndexedDocument:
        """A new document holding `prompt`: the newest, so the last to be evicted."""
        self._serial += 1
        document = IndexedDocument(self, self._serial)
        self._documents[document.serial] = document
        self._bytes += DOCUMENT_BYTES
        self._evict_over_budget()
        document.extend(prompt)
        document.prompt_length = len(document.tokens)
        return document

    def renamed_twin(self, document: IndexedDocument) -> IndexedDocument | None:
        """A twin of `document` when its prompt re-asks a recent request's with other names: that request's
        output, renamed the same way, after the prompt's last tokens (so the prompt's end matches it); None
        when none does, or when one of them asked it in the same words."""
        prompt = document.tokens[:document.prompt_length]
        answered = (earlier for earlier in reversed(self._documents.values())  # newest first, read lazily
                    if earlier is not document and not earlier.twin and len(earlier) > earlier.prompt_length > 0)
        found = None
        for earlier in islice(answered, RENAME_CANDIDATES):
            earlier_prompt = earlier.tokens[:earlier.prompt_length]
            if earlier_prompt == prompt:
                return None  # asked before in these very words: its own answer is better evidence than a twin
            if found is None:
                substitutions = renaming(earlier_prompt, prompt)
                found = (earlier, substitutions) if substitutions else None
        if found is None:
            return None
        earlier, substitutions = found
        twin = self.open()
        twin.twin = True
        twin.extend(list(prompt[-MAX_MATCH:]) + rename(earlier.tokens[earlier.prompt_length:], substitutions))
        return twin

    def discard(self, document: IndexedDocument) -> None:
        """Forget `document` now (a twin whose request ended), not when its turn to be evicted comes."""
        if document.evicted or self._documents.pop(document.serial, None) is None:
            return
        self._remove(document)
        self._bytes -= DOCUMENT_BYTES + TOKEN_BYTES * len(document.tokens)
        document.evicted, document.tokens = True, array("i")

    def clear(self) -> None:
        """Forget every document; those still being extended (requests in flight) add nothing more."""
        for document in self._documents.values():
            document.evicted, document.tokens = True, array("i")
        self._documents.clear()
        self._tables = {n: {} for n in KEY_LENGTHS}
        self._bytes = 0

    def _extend(self, document: IndexedDocument, tokens: Sequence[int]) -> None:
        if document.evicted:
            return
        room = self._document_cap - len(document.tokens)
        if room <= 0:
            return
        stored = document.tokens
        start = len(stored)
        stored.extend(list(tokens)[:room])
        for position in range(max(start, 1), len(stored)):  # the n-grams the new tokens follow
            self._add(document, position)
        self._bytes += TOKEN_BYTES * (len(stored) - start)
        self._evict_over_budget()

    def _add(self, document: IndexedDocument, position: int) -> None:
        """Index the n-grams ending just before `position`: the token there follows them."""
        stored, occurrence = document.tokens, document.serial << _POSITION_BITS | position
        for n in KEY_LENGTHS:
            if n > position:
                break
            table, key = self._tables[n], _key(stored[position - n:position])
            held = table.get(key)
            if held is None:
                table[key] = occurrence  # most keys occur once: a bare int, no list
            elif type(held) is int:
                table[key] = [held, occurrence]
            else:
                held.append(occurrence)
                if len(held) > MAX_CANDIDATES:
                    del held[0]

    def _remove(self, document: IndexedDocument) -> None:
        """Drop a document's index entries, so the tables keep no keys for evicted tokens."""
        stored = document.tokens
        for position in range(1, len(stored)):
            occurrence = document.serial << _POSITION_BITS | position
            for n in KEY_LENGTHS:
                if n > position:
                    break
                table, key = self._tables[n], _key(stored[position - n:position])
                held = table.get(key)
                if held == occurrence:
                    del table[key]
                elif type(held) is list and occurrence in held:
                    held.remove(occurrence)
                    if len(held) == 1:
                        table[key] = held[0]

    def _evict_over_budget(self) -> None:
        while self._bytes > self.max_bytes and self._documents:
            self.discard(next(iter(self._documents.values())))

    def propose(self, sequence: Sequence[int], limit: int) -> SuffixProposal:
        """Up to `limit` tokens that followed the longest suffix of `sequence` found in the held
        documents (the request's own included: a document's tail is never its own match)."""
        if limit <= 0 or len(sequence) < MIN_MATCH:
            return SuffixProposal()
        tail = array("i", sequence[len(sequence) - min(len(sequence), MAX_MATCH):])
        occurrences, match_length = self._longest_matches(tail)
        tokens, confidence = _vote(occurrences, limit)
        return SuffixProposal(tokens, match_length, confidence)

    def _longest_matches(self, tail: array) -> tuple[list[tuple[array, int]], int]:
        """(document tokens, position after the match) of the hits with the longest match, and its length."""
        for n in reversed(KEY_LENGTHS):
            if n > len(tail):
                continue
            held = self._tables[n].get(_key(tail[-n:]))
            if held is None:
                continue
            hits = []
            for occurrence in [held] if type(held) is int else held:  # oldest first
                serial, position = occurrence >> _POSITION_BITS, occurrence & _POSITION_MASK
                stored = self._documents[serial].tokens
                length = _match_length(stored, position, tail)
                if length >= n:  # shorter: a hash collision
                    hits.append((length, stored, position))
            if hits:
                best = max(length for length, _, _ in hits)
                return [(stored, position) for length, stored, position in hits if length == best], best
        return [], 0


def _match_length(stored: array, position: int, tail: array) -> int:
    """How many tokens before `position` equal the end of `tail`."""
    most, length = min(position, len(tail)), 0
    while length < most and stored[position - 1 - length] == tail[-1 - length]:
        length += 1
    return length


def _vote(occurrences: list[tuple[array, int]], limit: int) -> tuple[list[int], list[float]]:
    """Walk the occurrences forward together, taking the token most of those still agreeing continue with.

    An occurrence whose document ends (or has not grown that far yet) drops out without a vote: it says
    nothing about the next token. Ties go to the most recent occurrence's token."""
    tokens: list[int] = []
    confidence: list[float] = []
    share, alive = 1.0, occurrences
    for step in range(limit):
        alive = [(stored, position) for stored, position in alive if position + step < len(stored)]
        if not alive:
            break
        following = [stored[position + step] for stored, position in alive]
        votes = Counter(following)
        token = max(reversed(following), key=votes.__getitem__)  # the first maximum: the newest on ties
        share *= votes[token] / len(alive)
        if share < CONFIDENCE_FLOOR:
            break
        tokens.append(token)
        confidence.append(share)
        alive = [(stored, position) for stored, position in alive if stored[position + step] == token]
    return tokens, confidence
