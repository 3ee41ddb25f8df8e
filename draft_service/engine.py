"""Draft-side session logic: prefill, propose k tokens, and commit/rollback.

The draft knows nothing about acceptance. After each verification the
orchestrator tells it the outcome as a commit: "truncate to position, append
these tokens" (the accepted prefix stays, the recovered or bonus token is added).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from specmesh.distributions import decode_distribution, encode_distribution
from specmesh.engine import ModelEngine, Session
from specmesh.errors import InvalidArgument, PositionMismatch
from specmesh.sampling import SamplingParams, logits_to_probs, sample_token
from specmesh.v1 import common_pb2

MAX_PROPOSAL_TOKENS = 32


@dataclass(frozen=True)
class CommitSpec:
    position: int  # truncate the sequence to this many tokens ...
    token_ids: tuple[int, ...]  # ... then append these


@dataclass(frozen=True)
class Proposal:
    position: int  # position of token_ids[0]
    token_ids: list[int]
    distributions: list[common_pb2.TokenDistribution]  # empty: ids are point masses
    forward_ns: int


class DraftEngine:
    """Proposes tokens; with greedy_proposals it sends argmax ids even when sampling."""

    def __init__(self, engine: ModelEngine, greedy_proposals: bool = False):
        self.engine = engine
        self.greedy_proposals = greedy_proposals

    async def open(self, request_id: str, prompt: Sequence[int], sampling: SamplingParams) -> int:
        """Prefill all but the last prompt token; return forward ns."""
        session = self.engine.new_session(request_id, prompt, sampling)
        if len(prompt) < 2:
            return 0
        try:
            _, forward_ns = await self.engine.run(self.engine.forward, session, list(prompt[:-1]), 1)
        except BaseException:
            self.engine.close(request_id)
            raise
        return forward_ns

    async def commit(self, request_id: str, round_number: int, commit: CommitSpec) -> int:
        session = self.engine.get(request_id)
        session.enter_round(round_number)
        await self.engine.run(self._apply_commit, session, commit)
        return len(session.token_ids)

    def _apply_commit(self, session: Session, commit: CommitSpec) -> None:
        self.engine.rollback(session, commit.position, commit.token_ids)

    async def propose(self, request_id: str, round_number: int, commit: CommitSpec | None,
                      position: int, num_tokens: int) -> Proposal:
        if not 1 <= num_tokens <= MAX_PROPOSAL_TOKENS:
            raise InvalidArgument("num_tokens", f"must be in [1, {MAX_PROPOSAL_TOKENS}]")
        session = self.engine.get(request_id)
        session.enter_round(round_number)
        return await self.engine.run(self._propose, session, commit, position, num_tokens)

    def _propose(self, session: Session, commit: CommitSpec | None, position: int,
                 num_tokens: int) -> Proposal:
        if commit is not None:
            self._apply_commit(session, commit)
        if position != len(session.token_ids):
            raise PositionMismatch(
                f"position {position} is not the sequence length {len(session.token_ids)}")
        room = self.engine.context_window - position - 1  # the target adds one token after the draft
        tokens, distributions, total_ns = [], [], 0
        for _ in range(min(num_tokens, room)):
            logits, forward_ns = self.engine.feed_uncached(session, keep_rows=1)  # [1, V]
            total_ns += forward_ns
            token_id, distribution = self._draw(session, logits)
            session.token_ids.append(token_id)
            tokens.append(token_id)
            if distribution is not None:
                distributions.append(distribution)
            if token_id in self.engine.eos_token_ids:
                break  # the target would stop here; drafting past EOS is wasted work
        return Proposal(position, tokens, distributions, total_ns)

    def _draw(self, session: Session, logits: torch.Tensor) -> tuple[int, common_pb2.TokenDistribution | None]:
        """logits [1, V] -> (token, the exact distribution it was drawn from or None)."""
        if session.sampling.greedy or self.greedy_proposals:
            return int(logits[0].argmax()), None
        distribution = encode_distribution(logits_to_probs(logits, session.sampling)[0])
        # Sample from the decoded wire form: the target's q is then exactly ours.
        q = decode_distribution(distribution, self.engine.vocab_size)
        return sample_token(q, session.generator), distribution
