"""Tokens proposed without a forward pass: prompt lookup's and the suffix index's.

Both are functions of the committed sequence (and, for the suffix index, of what
earlier requests said), so as drafts their distribution is one-hot and the target
verifies them like any draft: lossless. They ride the target step the round runs
anyway, as extra rows; the policy (orchestrator.decoding.policy) chooses per round
between them, the draft model and none, by expected tokens per second.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

DRAFT, LOOKUP, SUFFIX, NONE = "draft", "lookup", "suffix", "none"  # a round's proposer, as metrics name it


@dataclass(frozen=True)
class FreeProposal:
    source: str  # LOOKUP (the request's own sequence) or SUFFIX (recent requests', its own included: suffix_index)
    tokens: list[int]
    match_length: int = 0  # suffix: how many trailing tokens matched the history (acceptance is learned by it)

    def first(self, count: int) -> "FreeProposal":
        return replace(self, tokens=self.tokens[:count])
