"""Pre-drafted branches: which outcomes to draft for, and adopting one after a commit.

While the target verifies a round of k assumed tokens, the draft drafts the next
round for the outcomes it finds likely. The all-accepted branch lives in the
session's own cache; every other branch is a fork with its own cache copy. A
commit then adopts whichever drafted sequence shares the longest prefix with the
committed one, so the work it already did is kept and only the rest is cropped.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Sequence

import torch

from specmesh.engine.model_engine import Session


@dataclass
class Branch:
    session: Session  # a fork: its own token_ids and KV cache

    @classmethod
    def fork(cls, session: Session, recovered_position: int, recovered: int) -> "Branch":
        """The session's sequence cut to recovered_position, then the guessed recovered token."""
        cache = copy.deepcopy(session.cache)
        surplus = cache.get_seq_length() - recovered_position
        if surplus > 0:
            cache.crop(-surplus)  # negative = remove that many tokens from the end
        token_ids = session.token_ids[:recovered_position] + [recovered]
        return cls(Session(session.request_id, token_ids, cache, session.sampling, session.generator,
                           round=session.round, seed=session.seed))


@dataclass
class DraftState:
    """The draft's per-session pipelining state (Session.ahead)."""

    calls: int = 0  # calls that arrived for the session; a pre-draft stops when this changes
    branches: list[Branch] = field(default_factory=list)  # forks from the latest pre-draft


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def adopt_longest_prefix(session: Session, wanted: Sequence[int]) -> None:
    """Swap in the fork that agrees longest with `wanted`, if it beats the session; drop the forks."""
    state = session.ahead
    if state is None:
        return
    best, best_common = None, common_prefix(session.token_ids, wanted)
    for branch in state.branches:
        common = common_prefix(branch.session.token_ids, wanted)
        if common > best_common:
            best, best_common = branch, common
    if best is not None:
        session.token_ids, session.cache = best.session.token_ids, best.session.cache
    state.branches = []


def plan_extra_branches(logits: torch.Tensor, assumed: Sequence[int], count: int,
                        eos_token_ids: Sequence[int]) -> list[tuple[int, int]]:
    """The `count` likeliest rejection outcomes as (accepted_count, recovered token guess).

    logits [k+1, V]: row j is the draft's prediction for assumed[j]'s position. With
    the draft standing in for the target, "accept assumed[:j], then token t at j"
    (t not assumed[j]) has probability prod_{i<j} P(assumed[i]) * P(t); the likeliest
    such outcomes win, so early positions may get several guesses.
    """
    k = len(assumed)
    probs = torch.softmax(logits[:k].float(), dim=-1)  # [k, V]
    drafted = torch.tensor(list(assumed), dtype=torch.long)  # [k]
    p_drafted = probs[torch.arange(k), drafted]  # [k]
    others = probs.scatter(1, drafted[:, None], 0.0)  # [k, V]
    others[:, list(eos_token_ids)] = 0.0  # an EOS ends the generation: nothing to draft after it
    reach = torch.cat([torch.ones(1), torch.cumprod(p_drafted, 0)[:-1]])  # [k]: P(accept assumed[:j])
    scores = reach[:, None] * others  # [k, V]
    best = torch.topk(scores.flatten(), min(count, scores.numel())).indices  # [count]
    vocab = probs.shape[-1]
    return [(int(i) // vocab, int(i) % vocab) for i in best if float(scores.flatten()[i]) > 0]
