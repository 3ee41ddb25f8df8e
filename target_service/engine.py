"""Target-side session logic: prefill with the first token, and verification rounds."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from specmesh.engine.commit import committed_tokens
from specmesh.engine.distributions import decode_distribution
from specmesh.engine.model_engine import ModelEngine, Session
from specmesh.errors import InvalidArgument, PositionMismatch
from specmesh.roles import MAX_DECODE_AHEAD, MAX_DRAFT_TOKENS
from specmesh.engine.sampling_params import SamplingParams
from specmesh.engine.sampling import logits_to_probs, make_generator, sample_token
from specmesh.v1 import common_pb2, target_pb2
from target_service.alternatives import (Alternative, after_alternative, check_alternatives, taken_alternative,
                                         tree_parents)
from target_service.disagreements import Disagreement, DisagreementLog, context_hash
from target_service.logprobs import token_logprobs
from target_service.rejection_sampler import Verdict, verify_greedy, verify_sampled



@dataclass(frozen=True)
class Opened:
    token_id: int  # first generated token, at position len(prompt)
    committed_length: int
    forward_ns: int
    logprob: common_pb2.TokenLogprob | None = None  # when the session asks for logprobs


@dataclass(frozen=True)
class Verification:
    verdict: Verdict
    committed_length: int
    forward_ns: int
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)  # one per committed token, if asked
    after: list[int] = field(default_factory=list)  # committed after verdict.next_token_id (an alternative's)


class TargetEngine:
    """Keeps each session's committed sequence; the KV cache covers all but its last token."""

    def __init__(self, engine: ModelEngine, disagreements: DisagreementLog | None = None):
        self.engine = engine
        self.disagreements = disagreements

    async def open(self, request_id: str, prompt: Sequence[int], sampling: SamplingParams,
                   caller: str = "", max_new_tokens: int = 0, admission_timeout_s: float | None = None) -> Opened:
        session = await self.engine.admit(request_id, prompt, sampling, caller, max_new_tokens, admission_timeout_s)
        try:
            return await self.engine.submit(session, self._prefill(session))
        except BaseException:
            self.engine.close(request_id)
            raise

    async def resume(self, request_id: str, committed: Sequence[int], sampling: SamplingParams,
                     caller: str = "", max_new_tokens: int = 0, admission_timeout_s: float | None = None) -> Opened:
        """Take over a session another replica lost: prefill its committed sequence, sample nothing.

        The cache covers all but the last committed token, as after any round, so the
        next Verify at position len(committed) feeds that token with its drafts.
        """
        session = await self.engine.admit(request_id, committed, sampling, caller, max_new_tokens, admission_timeout_s)
        # A seeded stream restarted from the seed would reuse the uniforms that already
        # decided earlier tokens; salting it with the position keeps the draws fresh.
        session.generator = make_generator(sampling.seed, salt=len(committed))
        if len(committed) < 2:
            return Opened(-1, len(committed), 0)
        try:
            _, forward_ns = await self.engine.submit(
                session, self.engine.feed(session, list(committed[:-1]), 1, chunkable=True))
        except BaseException:
            self.engine.close(request_id)
            raise
        return Opened(-1, len(committed), forward_ns)

    def _prefill(self, session: Session):
        """A job (specmesh.engine.batching): the prompt, chunked as the steps allow -> Opened."""
        token_id, logprobs, forward_ns = yield from self._decode_step(session, chunkable=True)
        return Opened(token_id, len(session.token_ids), forward_ns, logprobs[0] if logprobs else None)

    def _decode_step(self, session: Session, chunkable: bool = False):
        """In a job: feed the uncached tail and append the token the target alone chooses after it (penalties,
        a draw from the session's generator) -> (token, its logprobs if asked, forward ns)."""
        logits, forward_ns = yield from self.engine.feed_tail(session, keep_rows=1, chunkable=chunkable)  # [1, V]
        logits = session.penalize(logits)
        token_id = self._next_token(session, logits)
        logprobs = self._logprobs(session, logits, [token_id])
        session.token_ids.append(token_id)  # the cache now covers all but this newest token
        return token_id, logprobs, forward_ns

    @staticmethod
    def _logprobs(session: Session, logits: torch.Tensor, token_ids: list[int]) -> list[common_pb2.TokenLogprob]:
        """logits [m, V], penalized, row i deciding token_ids[i] -> their logprobs if the session asks."""
        if session.sampling.logprobs is None:
            return []
        return token_logprobs(logits[: len(token_ids)], token_ids, session.sampling.logprobs)

    def _next_token(self, session: Session, logits: torch.Tensor) -> int:
        """logits [1, V] -> a token from the target alone."""
        if session.sampling.greedy:
            return int(logits[0].argmax())
        return sample_token(logits_to_probs(logits, session.sampling)[0], session.generator)

    async def verify(self, request_id: str, round_number: int, position: int, draft_token_ids: Sequence[int],
                     draft_distributions: Sequence[common_pb2.TokenDistribution],
                     alternatives: Sequence[target_pb2.DraftAlternative] = (), decode_ahead: int = 0) -> Verification:
        return await self.engine.submit(*self.verification(
            request_id, round_number, position, draft_token_ids, draft_distributions, alternatives, decode_ahead))

    def verification(self, request_id: str, round_number: int, position: int, draft_token_ids: Sequence[int],
                     draft_distributions: Sequence[common_pb2.TokenDistribution],
                     alternatives: Sequence[target_pb2.DraftAlternative] = (), decode_ahead: int = 0):
        """A round's request checked -> (its session, the job that verifies it -> Verification), for
        ModelEngine.submit, or submit_all with the other parts of a batch. Raises on a bad request."""
        session = self.engine.get(request_id)
        self._check_draft(session, position, draft_token_ids, draft_distributions)
        _check_decode_ahead(decode_ahead, draft_token_ids, alternatives)
        checked = check_alternatives(alternatives, draft_token_ids, session.sampling)
        self.engine.check_token_ids("alternatives", [alternative.token_id for alternative in checked])
        if not self.engine.verifies_trees:
            checked = []  # verified as drafts alone: an alternative only ever adds a chance
        session.enter_round(round_number)
        return session, self._verify(session, list(draft_token_ids), draft_distributions, checked, decode_ahead)

    def _check_draft(self, session: Session, position: int, draft_token_ids: Sequence[int],
                     draft_distributions: Sequence[common_pb2.TokenDistribution]) -> None:
        if len(draft_token_ids) > MAX_DRAFT_TOKENS:
            raise InvalidArgument("draft_token_ids", f"at most {MAX_DRAFT_TOKENS} tokens")
        self.engine.check_token_ids("draft_token_ids", draft_token_ids)
        if draft_distributions and len(draft_distributions) != len(draft_token_ids):
            raise InvalidArgument("draft_distributions", "need one distribution per draft token, or none")
        if position != len(session.token_ids):
            raise PositionMismatch(
                f"position {position} is not the committed length {len(session.token_ids)}")
        if position + len(draft_token_ids) >= self.engine.context_window:
            raise InvalidArgument("draft_token_ids", "draft runs past the context window")

    def _verify(self, session: Session, draft_ids: list[int],
                draft_distributions: Sequence[common_pb2.TokenDistribution], alternatives: list[Alternative],
                decode_ahead: int = 0):
        """A job (specmesh.engine.batching): one forward of the last committed token, the drafts and any alternatives
        (target_service.alternatives), then decode_ahead steps of the target alone -> Verification."""
        k = len(draft_ids)
        draft_probs = self._decode_draft_probs(draft_distributions)  # [k, V] or None
        tail = session.uncached_tail
        parents = tree_parents(len(tail), k, alternatives) if alternatives else ()
        # [k+1+m, V]: row i <= k predicts position `position + i`, after the draft tokens before it; row k+1+j
        # the position after alternative j
        logits, forward_ns = yield from self.engine.feed(
            session, tail + draft_ids + [a.token_id for a in alternatives], keep_rows=k + 1 + len(alternatives),
            parents=parents)
        logits, alternative_logits = logits[: k + 1], logits[k + 1:]
        logits = session.penalize(logits, draft_ids=draft_ids)
        draft_tensor = torch.tensor(draft_ids, dtype=torch.long)  # [k]
        target_probs = None if session.sampling.greedy else logits_to_probs(logits, session.sampling)  # [k+1, V]
        if target_probs is None:
            verdict = verify_greedy(logits, draft_tensor)
        else:
            verdict = verify_sampled(target_probs, draft_tensor, draft_probs, session.generator)
        position = len(session.token_ids)
        if self.disagreements is not None and verdict.accepted_count < k:
            row = verdict.accepted_count
            # Under greedy the logged distribution is the model's own (temperature 1).
            p = torch.softmax(logits[row], -1) if target_probs is None else target_probs[row]  # [V]
            self._log_rejection(session, position, draft_ids, verdict, p, draft_probs)
        after, deciding = self._after_alternative(alternatives, logits, alternative_logits, verdict)
        committed = committed_tokens(draft_ids, verdict.accepted_count, verdict.next_token_id, after)
        # The forward cached every draft (and alternative) after the sequence: keep the accepted drafts'
        # entries (the next verification then feeds its next tokens and drafts only), drop the rest.
        self.engine.rollback(session, position, committed, cached=verdict.accepted_count)
        logprobs = self._logprobs(session, deciding, committed)
        if decode_ahead:
            ahead, ahead_logprobs, ahead_ns = yield from self._decode_ahead(session, decode_ahead)
            after, logprobs, forward_ns = after + ahead, logprobs + ahead_logprobs, forward_ns + ahead_ns
        return Verification(verdict, len(session.token_ids), forward_ns, logprobs, after)

    def _decode_ahead(self, session: Session, limit: int):
        """In a job: up to `limit` more tokens from the target alone, one step each, as a plain decode step
        would choose them (penalties, sampling draws from the session's generator in the same order);
        stops after an EOS token or at the context window -> (tokens, their logprobs, forward ns)."""
        tokens, logprobs, forward_ns = [], [], 0
        while (len(tokens) < limit and session.token_ids[-1] not in self.engine.eos_token_ids
               and len(session.token_ids) < self.engine.context_window):
            token_id, step_logprobs, step_ns = yield from self._decode_step(session)
            tokens.append(token_id)
            logprobs += step_logprobs
            forward_ns += step_ns
        return tokens, logprobs, forward_ns

    def _after_alternative(self, alternatives: list[Alternative], logits: torch.Tensor,
                           alternative_logits: torch.Tensor, verdict: Verdict) -> tuple[list[int], torch.Tensor]:
        """(tokens committed after the verdict's next token, the logits [n, V] that decided each committed
        token): the taken alternative's next token, if the verdict's next token is an alternative's."""
        place = taken_alternative(alternatives, verdict.accepted_count, verdict.next_token_id,
                                  self.engine.eos_token_ids)
        if place is None:
            return [], logits
        return after_alternative(logits, alternative_logits, verdict.accepted_count, place)

    def _log_rejection(self, session: Session, position: int, draft_ids: list[int], verdict: Verdict,
                       p: torch.Tensor, draft_probs: torch.Tensor | None) -> None:
        """p [V]: the target's distribution at the rejected row; draft_probs [k, V] or None."""
        row = verdict.accepted_count
        draft_token, target_token = draft_ids[row], verdict.next_token_id
        q = draft_probs[row] if draft_probs is not None else None  # [V]
        context = session.token_ids + draft_ids[:row]
        self.disagreements.record(Disagreement(
            request_id=session.request_id, round=session.round, position=position + row,
            context_hash=context_hash(context),
            draft_token_id=draft_token, target_token_id=target_token,
            target_prob_of_draft_token=float(p[draft_token]), target_prob_of_target_token=float(p[target_token]),
            draft_prob_of_draft_token=None if q is None else float(q[draft_token]),
            draft_prob_of_target_token=None if q is None else float(q[target_token]),
            context_token_ids=tuple(context) if self.disagreements.include_context else None))

    def _decode_draft_probs(
            self, distributions: Sequence[common_pb2.TokenDistribution]) -> torch.Tensor | None:
        if not distributions:
            return None
        try:
            rows = [decode_distribution(d, self.engine.vocab_size) for d in distributions]
        except ValueError as error:
            raise InvalidArgument("draft_distributions", str(error)) from error
        return torch.stack(rows)  # [k, V]


def _check_decode_ahead(decode_ahead: int, draft_token_ids: Sequence[int],
                        alternatives: Sequence[target_pb2.DraftAlternative]) -> None:
    if not 0 <= decode_ahead <= MAX_DECODE_AHEAD:
        raise InvalidArgument("decode_ahead", f"must be in [0, {MAX_DECODE_AHEAD}]")
    if decode_ahead and (draft_token_ids or alternatives):
        raise InvalidArgument("decode_ahead", "only on a plain decode step (no draft tokens, no alternatives)")
