"""Draft-side session logic: prefill, propose k tokens, commit/rollback, and pre-draft.

The draft knows nothing about acceptance. The orchestrator tells it each
verification's outcome as the commit carried by its next Propose or PreDraft:
"truncate to position, append these tokens" (the accepted prefix stays, the
recovered or bonus token is added, and after target-only rounds every token
committed meanwhile).
While the target verifies, the draft may pre-draft the next round for the likely
outcomes (draft_service.branches); a later commit adopts whichever drafted
sequence shares the longest prefix with the committed one, so a hit costs no
recomputation and a miss costs a crop.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence

import torch

from draft_service.branches import Branch, DraftState, adopt_longest_prefix, common_prefix, plan_extra_branches
from specmesh.engine.commit import committed_sequence
from specmesh.engine.distributions import decode_distribution, encode_distribution
from specmesh.engine.model_engine import ModelEngine, Session
from specmesh.errors import InvalidArgument, PositionMismatch
from specmesh.roles import MAX_DRAFT_TOKENS
from specmesh.engine.sampling_params import SamplingParams
from specmesh.engine.sampling import generator_at, logits_to_probs, sample_token
from specmesh.v1 import common_pb2


@dataclass(frozen=True)
class CommitSpec:
    position: int  # truncate the sequence to this many tokens ...
    token_ids: tuple[int, ...]  # ... then append these


@dataclass
class Proposal:
    position: int  # position of token_ids[0]
    token_ids: list[int]
    distributions: list[common_pb2.TokenDistribution]  # empty: ids are point masses
    forward_ns: int
    probabilities: list[float] = field(default_factory=list)  # the draft's, of each token it proposed
    # greedy without penalties: the draft's second choice at each position and its probability
    alternative_token_ids: list[int] = field(default_factory=list)
    alternative_probabilities: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class BranchProposal:
    """A pre-drafted proposal, valid only for the outcome (accepted_count, next_token_id)."""

    accepted_count: int
    next_token_id: int
    proposal: Proposal  # no tokens: nothing to draft for this outcome
    planned: tuple[tuple[int, int], ...] = ()  # on the first branch: the keys of the branches to follow


@dataclass(frozen=True)
class PredraftStart:
    """A pre-draft begun (DraftEngine.predraft_start): its first job, and what its later branches need."""

    session: Session
    position: int  # of the assumed tokens
    num_tokens: int  # per branch
    interrupted: Callable[[], bool]  # a newer call for the session arrived
    main: tuple[Session, Any]  # (session, the all-accepted branch's job -> BranchProposal), to submit


class DraftEngine:
    """Proposes tokens; with greedy_proposals it sends argmax ids even when sampling."""

    def __init__(self, engine: ModelEngine, greedy_proposals: bool = False):
        self.engine = engine
        self.greedy_proposals = greedy_proposals

    async def open(self, request_id: str, prompt: Sequence[int], sampling: SamplingParams,
                   caller: str = "", max_new_tokens: int = 0, admission_timeout_s: float | None = None) -> int:
        """Once admitted (KV room reserved), prefill all but the last prompt token; return forward ns."""
        session = await self.engine.admit(request_id, prompt, sampling, caller, max_new_tokens, admission_timeout_s)
        session.ahead = DraftState()
        if len(prompt) < 2:
            return 0
        try:
            _, forward_ns = await self.engine.submit(
                session, self.engine.feed(session, list(prompt[:-1]), 1, chunkable=True))
        except BaseException:
            self.engine.close(request_id)
            raise
        return forward_ns

    def _arrive(self, request_id: str, round_number: int) -> tuple[Session, int]:
        """A call for the session arrived: interrupt its pre-draft; refuse a stale round."""
        session = self.engine.get(request_id)
        state: DraftState = session.ahead
        state.calls += 1  # read by a pre-draft between its forward steps
        session.enter_round(round_number)
        return session, state.calls

    def _apply_commit(self, session: Session, commit: CommitSpec, then: Sequence[int] = ()) -> None:
        """Move the session to sequence[:commit.position] + commit.token_ids + then."""
        if not 0 < commit.position <= len(session.token_ids):
            raise PositionMismatch(f"cannot roll back to position {commit.position}: "
                                   f"sequence has {len(session.token_ids)} tokens")
        wanted = committed_sequence(session.token_ids, commit.position, [*commit.token_ids, *then])
        self.engine.check_token_ids("token_ids", wanted[commit.position:])
        adopt_longest_prefix(session, wanted)
        common = common_prefix(session.token_ids, wanted)
        self.engine.rollback(session, max(common, 1), wanted[max(common, 1):])

    async def propose(self, request_id: str, round_number: int, commit: CommitSpec | None,
                      position: int, num_tokens: int, stop_below: float = 0.0) -> Proposal:
        return await self.engine.submit(*self.proposal(request_id, round_number, commit, position, num_tokens,
                                                       stop_below))

    def proposal(self, request_id: str, round_number: int, commit: CommitSpec | None, position: int,
                 num_tokens: int, stop_below: float = 0.0):
        """A Propose checked -> (its session, the job that drafts it -> Proposal), for ModelEngine.submit, or
        submit_all with the other parts of a batch. Raises on a bad request."""
        _check_count("num_tokens", num_tokens, 1, MAX_DRAFT_TOKENS)
        if not 0.0 <= stop_below <= 1.0:  # NaN fails too
            raise InvalidArgument("stop_below", "must be in [0, 1]")
        session, _ = self._arrive(request_id, round_number)
        return session, self._propose(session, commit, position, num_tokens, stop_below)

    def _propose(self, session: Session, commit: CommitSpec | None, position: int, num_tokens: int,
                 stop_below: float):
        """A job (specmesh.engine.batching) -> Proposal."""
        if commit is not None:
            self._apply_commit(session, commit)
        if position != len(session.token_ids):
            raise PositionMismatch(
                f"position {position} is not the sequence length {len(session.token_ids)}")
        return (yield from self._draft(session, num_tokens, stop_below=stop_below))

    def _draft(self, session: Session, num_tokens: int, interrupted: Callable[[], bool] = lambda: False,
               stop_below: float = 0.0):
        """In a job: draft up to num_tokens after the session's sequence, one step each, stopping
        early when interrupted, at EOS, or after the token whose run probability falls below
        stop_below -> Proposal."""
        position = len(session.token_ids)
        generator = generator_at(session.seed, position)
        room = self.engine.context_window - position - 1  # the target adds one token after the draft
        proposal = Proposal(position, [], [], 0)
        run = 1.0
        for _ in range(min(num_tokens, room)):
            if interrupted():
                break
            logits, forward_ns = yield from self.engine.feed_tail(session, keep_rows=1)  # [1, V]
            token_id, probability = self._draw_into(proposal, session, logits, generator, forward_ns)
            session.token_ids.append(token_id)
            run *= probability
            if token_id in self.engine.eos_token_ids or run < stop_below:
                break  # the target would stop at EOS; past a doubtful token, drafting costs more than it gains
        return proposal

    def _draw_into(self, proposal: Proposal, session: Session, logits: torch.Tensor, generator: torch.Generator,
                   forward_ns: int) -> tuple[int, float]:
        """Draw the next token from logits [1, V] and add it to the proposal -> (token, confidence)."""
        proposal.forward_ns += forward_ns
        token_id, distribution, probability, alternative = self._draw(session, logits, generator)
        if distribution is not None:
            proposal.distributions.append(distribution)
        if alternative is not None and session.sampling.tries_alternatives:
            proposal.alternative_token_ids.append(alternative[0])  # for the target to try (target_service.alternatives)
            proposal.alternative_probabilities.append(alternative[1])
        proposal.token_ids.append(token_id)
        proposal.probabilities.append(probability)
        return token_id, probability

    def _draw(self, session: Session, logits: torch.Tensor,
              generator: torch.Generator
              ) -> tuple[int, common_pb2.TokenDistribution | None, float, tuple[int, float] | None]:
        """logits [1, V] -> (token, the exact distribution it was drawn from or None, the draft's
        confidence at this position: its largest probability, and under greedy its second choice with
        that choice's probability). Under greedy the confidence is the proposed token's; a sampled
        token's own probability would add the draw's randomness, which says nothing of acceptance (a
        token drawn from q where the target's p is q is accepted whatever q gave it)."""
        logits = session.penalize(logits)  # as the target will at this position
        if session.sampling.greedy or self.greedy_proposals:
            (token_id, probability), alternative = _top_two(logits[0])
            return token_id, None, probability, alternative
        distribution = encode_distribution(logits_to_probs(logits, session.sampling)[0])
        # Sample from the decoded wire form: the target's q is then exactly ours.
        q = decode_distribution(distribution, self.engine.vocab_size)
        token_id = sample_token(q, generator)
        return token_id, distribution, float(q.max()), None

    async def predraft(self, request_id: str, round_number: int, commit: CommitSpec | None, position: int,
                       assumed: Sequence[int], num_tokens: int,
                       extra_branches: int) -> AsyncIterator[BranchProposal]:
        """Branches for round_number, the all-accepted one first; stops when a newer call arrives."""
        started = self.predraft_start(request_id, round_number, commit, position, assumed, num_tokens,
                                      extra_branches)
        main = self.engine.submit(*started.main)
        async for branch in self.predraft_branches(started, main):
            yield branch

    def predraft_start(self, request_id: str, round_number: int, commit: CommitSpec | None, position: int,
                       assumed: Sequence[int], num_tokens: int, extra_branches: int) -> "PredraftStart":
        """A PreDraft checked and its session told: the job of its all-accepted branch, for ModelEngine.submit
        (or submit_all beside a batch's other parts), then predraft_branches. Raises on a bad request."""
        _check_count("num_tokens", num_tokens, 1, MAX_DRAFT_TOKENS)
        _check_count("extra_branches", extra_branches, 0, MAX_DRAFT_TOKENS)
        if not 1 <= len(assumed) <= MAX_DRAFT_TOKENS:
            raise InvalidArgument("assumed_token_ids", f"need 1 to {MAX_DRAFT_TOKENS} tokens")
        session, call = self._arrive(request_id, round_number)
        state: DraftState = session.ahead

        def interrupted() -> bool:
            return state.calls != call
        job = self._predraft_main(session, commit, position, list(assumed), num_tokens, extra_branches, interrupted)
        return PredraftStart(session, position, num_tokens, interrupted, (session, job))

    async def predraft_branches(self, started: "PredraftStart",
                                main: Awaitable[BranchProposal]) -> AsyncIterator[BranchProposal]:
        """The started pre-draft's branches: its all-accepted one (`main`, the result of its submitted job), then
        the planned rejection branches, each drafted once the one before is out, until a newer call arrives."""
        session, interrupted = started.session, started.interrupted
        try:
            main = await main
            yield main
            for accepted, next_token in main.planned:
                if interrupted():
                    return
                branch = await self.engine.submit(session, self._predraft_extra(
                    session, started.position + accepted, next_token, started.num_tokens, interrupted))
                if branch is not None:
                    yield BranchProposal(accepted, next_token, branch)
        except (asyncio.CancelledError, GeneratorExit):
            if not interrupted():  # the caller stopped listening: stop the worker's forward steps too
                session.ahead.calls += 1
            raise

    def close(self, request_id: str) -> bool:
        session = self.engine.sessions.get(request_id)
        if session is not None and session.ahead is not None:
            session.ahead.calls += 1  # a pre-draft in progress stops at its next step
        return self.engine.close(request_id)

    def _predraft_main(self, session: Session, commit: CommitSpec | None, position: int, assumed: list[int],
                       num_tokens: int, extra_branches: int, interrupted: Callable[[], bool]):
        """A job: take the sequence to prefix + assumed, guess the bonus token, draft after it; plan the rest."""
        base = commit if commit is not None else CommitSpec(min(position, len(session.token_ids)), ())
        if base.position + len(base.token_ids) != position:
            raise PositionMismatch(f"position {position} is not the committed length "
                                   f"{base.position + len(base.token_ids)}")
        self._apply_commit(session, base, then=assumed)
        bonus_logits, plans, score_ns = yield from self._score_assumed(session, position, assumed, extra_branches)
        bonus = int(bonus_logits[0].argmax())
        proposal = Proposal(position + len(assumed) + 1, [], [], 0)
        if not (assumed[-1] in self.engine.eos_token_ids or bonus in self.engine.eos_token_ids or interrupted()):
            session.token_ids.append(bonus)
            proposal = yield from self._draft(session, num_tokens, interrupted)
        proposal = Proposal(proposal.position, proposal.token_ids, proposal.distributions,
                            proposal.forward_ns + score_ns, proposal.probabilities)
        return BranchProposal(len(assumed), bonus, proposal, tuple(plans))

    def _score_assumed(self, session: Session, position: int, assumed: list[int], extra_branches: int):
        """In a job: (logits [1, V] for the bonus position, the extra branches to draft, forward ns)."""
        if not extra_branches:
            logits, forward_ns = yield from self.engine.feed_tail(session, keep_rows=1)  # [1, V]
            return session.penalize(logits), [], forward_ns
        # Re-score the assumed tokens in one forward (cheap on a batch-friendly device):
        # fed from position - 1 on, row j of the logits predicts position + j.
        surplus = session.cached_length - max(0, position - 1)
        if surplus > 0:
            session.cache.crop(-surplus)  # negative = remove that many tokens from the end
        logits, forward_ns = yield from self.engine.feed_tail(session, keep_rows=len(assumed) + 1)  # [k+1, V]
        logits = session.penalize(logits, position, assumed)
        plans = plan_extra_branches(logits, assumed, extra_branches, self.engine.eos_token_ids)
        return logits[-1:], plans, forward_ns

    def _predraft_extra(self, session: Session, recovered_position: int, recovered: int, num_tokens: int,
                        interrupted: Callable[[], bool]):
        """A job: draft after a guessed rejection in a copy of the cache, kept for a later commit to adopt."""
        branch = Branch.fork(session, recovered_position, recovered)
        proposal = yield from self._draft(branch.session, num_tokens, interrupted)
        if interrupted() or not proposal.token_ids:
            return None
        session.ahead.branches.append(branch)
        return proposal


def _top_two(logits: torch.Tensor) -> tuple[tuple[int, float], tuple[int, float]]:
    """logits [V] -> ((argmax, its probability), (the second most likely token, its probability))."""
    probabilities, tokens = torch.softmax(logits.float(), dim=0).topk(2)
    return (int(tokens[0]), float(probabilities[0])), (int(tokens[1]), float(probabilities[1]))


def _check_count(field: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise InvalidArgument(field, f"must be in [{low}, {high}]")
