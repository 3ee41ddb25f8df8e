"""Alternatives: other tokens for some draft positions, verified in the same forward as the drafts.

Under greedy a round ends at the first draft token that is not the target's argmax, and the
target's own token there is committed in its place. Where the draft's second choice at that
position is the target's token, a row fed for that alternative, seeing the drafts before its
position, already holds the target's logits after it: its argmax commits one more token for
the price of a row (VerifyRequest.alternatives). The rows form a tree: the chain of the last
committed tokens and the drafts, then each alternative as a child of the row before its draft
(specmesh.engine.ragged.tree_ancestry). Greedy only: what is committed is the target's argmax at every
position either way, so the output is the one the target alone makes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Sequence

import torch

from specmesh.errors import InvalidArgument
from specmesh.engine.sampling_params import SamplingParams
from specmesh.v1 import target_pb2


@dataclass(frozen=True)
class Alternative:
    index: int  # the draft position it stands in for
    token_id: int


def check_alternatives(alternatives: Sequence[target_pb2.DraftAlternative], draft_ids: Sequence[int],
                       sampling: SamplingParams) -> list[Alternative]:
    """The request's alternatives, by index; INVALID_ARGUMENT naming `alternatives` when unsound."""
    if not alternatives:
        return []
    if not sampling.tries_alternatives:
        raise InvalidArgument("alternatives", "only for greedy sessions without penalties or biases")
    checked: dict[int, Alternative] = {}
    for alternative in alternatives:
        index = alternative.index
        if index >= len(draft_ids):
            raise InvalidArgument("alternatives", f"index {index} is past the {len(draft_ids)} draft tokens")
        if index in checked:
            raise InvalidArgument("alternatives", f"index {index} given twice")
        if alternative.token_id == draft_ids[index]:
            raise InvalidArgument("alternatives", f"the alternative at index {index} is the draft token itself")
        checked[index] = Alternative(index, alternative.token_id)
    return [checked[index] for index in sorted(checked)]


def tree_parents(tail: int, drafts: int, alternatives: Sequence[Alternative]) -> tuple[int, ...]:
    """Parents of the rows fed: `tail` uncached committed tokens and the drafts as a chain, then each
    alternative after the row before its draft (the last tail row for index 0)."""
    chain = tuple(range(-1, tail + drafts - 1))
    return chain + tuple(tail - 1 + alternative.index for alternative in alternatives)


def taken_alternative(alternatives: Sequence[Alternative], accepted: int, next_token_id: int,
                      eos_token_ids: Collection[int]) -> int | None:
    """Which alternative the verdict commits a token after (its place in `alternatives`): the one at the
    rejected position whose token is the target's there; None if none is, or if that token ends the
    sequence."""
    if next_token_id in eos_token_ids:
        return None
    for place, alternative in enumerate(alternatives):
        if alternative.index == accepted and alternative.token_id == next_token_id:
            return place
    return None


def after_alternative(chain_logits: torch.Tensor, alternative_logits: torch.Tensor, accepted: int,
                      place: int) -> tuple[list[int], torch.Tensor]:
    """chain_logits [k+1, V], alternative_logits [m, V] -> (the token after the taken alternative, the
    rows that decided each committed token [accepted + 2, V])."""
    row = alternative_logits[place: place + 1]  # [1, V]
    return [int(row[0].argmax())], torch.cat([chain_logits[: accepted + 1], row])
