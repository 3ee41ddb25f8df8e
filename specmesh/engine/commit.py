"""The commit rule: what a verification leaves in a session's sequence, wherever a copy of it is kept.

A round verified at `position` (the committed length) commits the accepted prefix of its draft
tokens, then the target's next token (recovered at the first rejection, or the bonus token when
every draft token was accepted), then any tokens the same Verify decided after it (a taken
alternative's follower, or tokens decoded ahead). A commit is applied the same way by every holder
of a sequence (the target, the draft, the orchestrator's record of each for failover): roll back
to its position, then append its tokens.
"""

from __future__ import annotations

from typing import Sequence


def committed_tokens(draft_token_ids: Sequence[int], accepted_count: int, next_token_id: int,
                     after_token_ids: Sequence[int] = ()) -> list[int]:
    """The tokens a verification commits at its position: accepted drafts, recovered or bonus, any after."""
    return [*draft_token_ids[:accepted_count], next_token_id, *after_token_ids]


def committed_sequence(sequence: Sequence[int], position: int, token_ids: Sequence[int]) -> list[int]:
    """`sequence` after a commit: rolled back to `position` tokens, then `token_ids` appended (a new list)."""
    return [*sequence[:position], *token_ids]
