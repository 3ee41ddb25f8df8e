"""The speculative loop: draft proposes, target verifies, both commit; repeat.

One `SpeculativeGeneration` drives one request. It owns the committed sequence
(prompt + generated tokens) and how much of it the draft agrees with; every
exchange carries the request id, the absolute position and the round number.
If the draft fails, times out or answers nonsense, the generation carries on
target-only from the committed prefix: the target alone decides every token,
so the output is unchanged (identical under greedy). A draft that is only
unreachable (UNAVAILABLE: a replica restarting, none healthy in its pool) is
asked again after a few target-only rounds, the interval doubling while it stays
away; the next Propose's commit catches it up, so speculation comes back within
the request. A draft that refused to open the session for now (RESOURCE_EXHAUSTED:
its KV room or its queue of prefills full) waits out the same interval, and the
session is opened again where the policy asks for it. Any other draft failure drops
the draft for the rest of the request.
Each round is planned by the request's policy (orchestrator.decoding.plan: the adaptive
rule, or a fixed k) and the policy learns from its outcome. A round may verify tokens
proposed at no model cost in place of the draft's (orchestrator.decoding.proposals);
the draft's session then falls behind by the round's tokens, and the next Propose's
commit catches it up the same way.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import AsyncIterator, Callable

import grpc

from opentelemetry import trace

from orchestrator.decoding.background import retrieve_outcome, spawn_background
from orchestrator.decoding.costs import RoundCosts
from orchestrator.decoding.endpoints import DraftEndpoint, TargetEndpoint
from orchestrator.decoding.lookup import PromptLookup
from orchestrator.decoding.plan import (DRAFT_AWAY, DRAFT_CLOSED, DRAFT_OPEN, DRAFT_OPENING, DraftLengthPolicy,
                                        FixedLength, RoundAsk, RoundOutcome, RoundPlan, no_offers)
from orchestrator.decoding.proposals import DRAFT, LOOKUP, NONE, SUFFIX, FreeProposal
from orchestrator.decoding.request import GenerationRequest, LoopConfig, LoopStats, RoundTiming, SpeculationSwitch
from orchestrator.decoding.suffix_index import SuffixIndex
from orchestrator.decoding.round_spans import describe_breakdown, describe_round
from orchestrator.decoding.timing import RoundBreakdown, RoundClock
from specmesh.engine.commit import committed_tokens
from specmesh.roles import MAX_DRAFT_TOKENS
from specmesh.v1 import common_pb2, draft_pb2, target_pb2

log = logging.getLogger(__name__)
MAX_DRAFT_RETRY_TOKENS = 32  # most tokens committed target-only between two tries of a draft unreachable or full


class SpeculativeGeneration:
    """Yields committed tokens, a list per round, until max_tokens or an EOS token."""

    offers_alternatives = True  # verifications may try the draft's second choices (target_service.alternatives)

    def __init__(self, request: GenerationRequest, target: TargetEndpoint, draft: DraftEndpoint | None,
                 eos_token_ids: set[int], config: LoopConfig,
                 on_round: Callable[[int, int], None] = lambda drafted, accepted: None,
                 tracer: trace.Tracer | None = None, switch: SpeculationSwitch | None = None,
                 policy: "DraftLengthPolicy | None" = None,
                 on_timing: Callable[[RoundBreakdown], None] = lambda breakdown: None,
                 history: SuffixIndex | None = None,
                 on_proposer: Callable[[str, int, int], None] = lambda proposer, proposed, accepted: None):
        self.request = request
        # Plans every round; none given: the request's k every round, over round costs of its own.
        self.policy = policy or FixedLength(RoundCosts(decode_ahead=config.decode_ahead))
        self.costs = self.policy.costs  # what rounds cost: decoding ahead and pre-drafts are sized by it too
        self.on_timing = on_timing  # where each round's time went
        self.tracer = tracer or trace.NoOpTracer()
        self.switch = switch or SpeculationSwitch()
        self.on_round = on_round  # (drafted, accepted) after every verification round
        self.target = target
        self.draft = draft if request.num_speculative_tokens > 0 else None
        self.eos_token_ids = eos_token_ids
        self.config = config
        self.stats = LoopStats()
        # Clients may reuse request ids; the services' session ids must be unique.
        self.session_id = f"{request.request_id}/{uuid.uuid4().hex[:12]}"
        self.sequence = list(request.prompt_token_ids)  # committed: prompt + generated
        self.lookup = PromptLookup(self.sequence)  # drafts from the sequence itself
        self.history = history  # earlier and concurrent requests' sequences; this one's is added as it grows
        self._document = history.open(self.sequence) if history is not None else None
        # a re-asked request's earlier answer with its renames, while this one runs
        self._twin = history.renamed_twin(self._document) if history is not None else None
        self.on_proposer = on_proposer  # (draft/lookup/suffix/none, tokens proposed, accepted) every round
        # The target's logprob of each generated token, when the request's sampling asks for them.
        self.logprobs: list[common_pb2.TokenLogprob] = []
        self.draft_agreed = 0  # the draft's sequence equals sequence[:draft_agreed]
        self._draft_opening: asyncio.Task | None = None
        self._draft_open_deadline = 0.0  # time.monotonic() by which the draft's prefill must be done
        self._draft_asked = False  # the draft's session was opened, or is opening
        self._draft_back_at = 0  # a draft unreachable or full is asked again once the sequence is this long
        self._draft_retry_tokens = 1
        self._round = 0
        self._clock = RoundClock()
        self._plan = RoundPlan()  # this round's
        self._stop_below = 0.0  # this round's: the draft stops where its run probability falls below it
        self._alternatives: list[target_pb2.DraftAlternative] = []  # this round's, sent with its Verify
        self._target_steps = 1  # this round's Verify's target steps

    @property
    def generated(self) -> int:
        return len(self.sequence) - len(self.request.prompt_token_ids)

    @property
    def tokens_left(self) -> int:
        """Tokens the request may still make (max_tokens less those generated)."""
        return self.request.max_tokens - self.generated

    async def tokens(self) -> AsyncIterator[list[int]]:
        try:
            self.policy.arrive()  # from now on it is part of the load the others decode under
            batch = await self._open()
            while True:
                batch = self._cut_at_eos(batch)
                yield batch
                if self._finished(batch):
                    return
                batch = await self._run_round()
        finally:
            self.policy.close()
            if self._twin is not None:
                self.history.discard(self._twin)
            self._close_sessions()

    def _finished(self, batch: list[int]) -> bool:
        return self.generated >= self.request.max_tokens or any(t in self.eos_token_ids for t in batch)

    def _cut_at_eos(self, batch: list[int]) -> list[int]:
        for index, token_id in enumerate(batch):
            if token_id in self.eos_token_ids:
                return batch[: index + 1]
        return batch

    def _timeout(self, per_call: float) -> float:
        if self.request.deadline is None:
            return per_call
        return max(0.001, min(per_call, self.request.deadline - time.monotonic()))

    def _kv_new_tokens(self) -> int:
        """What a session may add to the prompt, reserved in each service's KV budget: the output, plus a
        last round's draft tokens past the end (verified, then cut at max_tokens) and its bonus token."""
        return self.request.max_tokens + MAX_DRAFT_TOKENS + 1

    async def _open(self) -> list[int]:
        """Prefill the target; the draft's prefill starts once the target's first token is out.

        The first token never waits for the draft, nor shares the hardware with its prefill
        (on one machine the two would compete). The adaptive policy runs rounds target-only
        until the draft's session is open, and does not open it at all until it first wants a
        draft token (a prompt class that never pays never costs a draft prefill).
        """
        request = self.request
        with self.tracer.start_as_current_span("specmesh.prefill", attributes={
                "specmesh.request_id": self.session_id,
                "specmesh.prompt_tokens": len(request.prompt_token_ids)}) as span:
            prefill_s = self.config.target_timeout_s + self.config.prefill_timeout_per_token_s * len(
                request.prompt_token_ids)
            opened = await self.target.open(self.session_id, request.prompt_token_ids, request.sampling,
                                            timeout=self._timeout(prefill_s), max_new_tokens=self._kv_new_tokens())
            span.set_attribute("specmesh.target_forward_ns", opened.forward_ns)
        self.stats.target_forward_passes += 1
        self.draft_agreed = len(request.prompt_token_ids)
        self._commit([opened.token_id])
        if opened.HasField("logprob"):
            self.logprobs.append(opened.logprob)
        if self.draft is not None and self.policy.plan(self._ask(DRAFT_CLOSED, no_offers)).open_draft:
            self._open_draft()
        return [opened.token_id]

    def _open_draft(self) -> None:
        """Start the draft's prefill of the prompt in the background; the next Propose's commit
        brings it the tokens generated since. Its deadline allows for the prompt's rows, as the target's
        prefill does: a burst of requests opens its drafts at once, and the draft feeds them in turn (held
        to one round's deadline, the draft would refuse the burst's later opens)."""
        request = self.request
        self._draft_asked = True
        timeout = self._timeout(self.config.draft_timeout_s
                                + self.config.prefill_timeout_per_token_s * len(request.prompt_token_ids))
        self._draft_open_deadline = time.monotonic() + timeout
        self._draft_opening = asyncio.ensure_future(self.draft.open(
            self.session_id, request.prompt_token_ids, request.sampling, timeout=timeout,
            max_new_tokens=self._kv_new_tokens()))

    async def _run_round(self) -> list[int]:
        self._round += 1
        position = len(self.sequence)
        with self.tracer.start_as_current_span("specmesh.round", attributes={
                "specmesh.request_id": self.session_id, "specmesh.round": self._round,
                "specmesh.position": position}) as span:
            plan = await self._plan_round()
            free = plan.free
            k, self._stop_below = self._draft_request(plan)
            span.set_attributes({"specmesh.draft_length": k, "specmesh.proposer": _proposer(k, free),
                                 "specmesh.free_length": len(free.tokens) if free else 0,
                                 "specmesh.stop_below": self._stop_below})
            # Off, the draft keeps its session: the next commit catches it up if speculation returns.
            started = time.monotonic()
            self._clock = RoundClock()
            proposal = await self._proposal_for_round(k)
            draft_ids = list(proposal.token_ids) if proposal else (free.tokens if free else [])
            verified = await self._verify_round(position, proposal, k, free)
            describe_round(span, proposal, verified, len(draft_ids))
            breakdown = self._clock.finish(time.monotonic() - started)
            describe_breakdown(span, breakdown)
        self.on_timing(breakdown)
        accepted = verified.accepted_count
        drafted = 0 if free else len(draft_ids)  # by the draft model
        timing = RoundTiming(draft_s=self._clock.draft_wall_s, verify_s=self._clock.target_wall_s,
                             draft_forward_s=self._clock.draft_busy_s, verify_forward_s=self._clock.target_busy_s,
                             target_steps=self._target_steps, predraft=self._clock.predraft)
        self.policy.learn(plan, RoundOutcome(timing, drafted, accepted, list(proposal.probabilities) if proposal
                                             else [], len(self._alternatives)))
        batch = committed_tokens(draft_ids, accepted, verified.next_token_id, verified.after_token_ids)
        if proposal is not None:
            self.draft_agreed = position + accepted  # past the accepted prefix the draft's tokens were rejected
        self._commit(batch)
        self.logprobs.extend(verified.logprobs)
        self._count_round(drafted, 0 if free else accepted, len(batch))
        if free is not None:
            self.stats.count_free(free, accepted)
        self.stats.alternative_tokens += len(self._alternatives)
        # after_token_ids are an alternative's follower, or (target-only rounds) the tokens decoded ahead
        self.stats.alternative_accepted_tokens += bool(self._alternatives and verified.after_token_ids)
        self.on_proposer(_proposer(k, free), len(draft_ids), accepted)
        return batch

    def _commit(self, tokens: list[int]) -> None:
        self.sequence.extend(tokens)
        self._record(tokens)

    def _record(self, tokens: list[int]) -> None:
        if self._document is not None:
            self._document.extend(tokens)

    async def _plan_round(self) -> RoundPlan:
        """The policy's plan for this round, made with the other sessions planning now; the draft's session
        opens here where the plan says so."""
        self._plan = await self.policy.plan_with_batch(self._ask(self._draft_state(), self._offers))
        if self._plan.open_draft:
            self._open_draft()
        return self._plan

    def _ask(self, draft: str, offers: Callable[[], list[FreeProposal]]) -> RoundAsk:
        return RoundAsk(self._k_max(), len(self.sequence), self.tokens_left, draft, offers)

    def _draft_state(self) -> str:
        if self._draft_unavailable():
            return DRAFT_AWAY
        if not self._draft_asked:
            return DRAFT_CLOSED
        return DRAFT_OPENING if self._draft_prefilling() else DRAFT_OPEN

    def _offers(self) -> list[FreeProposal]:
        """Tokens this round may verify in place of the draft model's, for a policy that weighs them: prompt
        lookup's and the suffix index's. None with speculation off. (A fixed k, or seeded sampling, which must
        not depend on the load or on other requests, never asks.)"""
        if not self.switch.enabled or self._k_max() <= 0:
            return []
        limit = min(MAX_DRAFT_TOKENS, self.tokens_left - 1)
        offers = []
        if self.config.prompt_lookup:
            found = self.lookup.propose(limit)
            if found:
                offers.append(FreeProposal(LOOKUP, found))
        if self.history is not None:
            suffix = self.history.propose(self.sequence, limit)  # its own tokens too: copies of a long match
            if suffix.tokens:
                offers.append(FreeProposal(SUFFIX, suffix.tokens, suffix.match_length))
        return offers

    async def _proposal_for_round(self, k: int) -> draft_pb2.ProposeResponse | None:
        """This round's draft tokens, or None for a target-only round."""
        if k <= 0:
            return None
        started = time.monotonic()
        proposal = await self._propose(k)
        self._clock.draft_call(time.monotonic() - started, proposal.forward_ns / 1e9 if proposal else 0.0)
        return proposal

    async def _verify_round(self, position: int, proposal: draft_pb2.ProposeResponse | None,
                            k: int, free: FreeProposal | None = None) -> target_pb2.VerifyResponse:
        """The target's verdict on the draft's proposal, or on a free proposal (ids only: one-hot q)."""
        started = time.monotonic()
        self._alternatives = self._choose_alternatives(proposal)
        target_only = proposal is None and free is None
        # The next token counts as one of the tokens the request may still make. While the draft's prefill
        # runs, rounds are target-only only until it is done: decoding ahead would put off its first draft.
        # A free proposal on offer and passed up does not stop it: the plan weighed the proposal against a
        # round of one token and found it not worth its rows, so against this round it is worth less still.
        decodes_ahead = target_only and not self._draft_prefilling()
        limit = min(self.tokens_left - 1, self.config.decode_ahead)
        if self._draft_back_at > len(self.sequence):  # an unreachable draft: ahead no further than its next try
            limit = min(limit, self._draft_back_at - len(self.sequence) - 1)
        ahead = self.costs.tokens_ahead(self._plan.batch, limit) if decodes_ahead else 0
        verified = await self.target.verify(
            self.session_id, self._round, position, list(proposal.token_ids) if proposal else list(
                free.tokens if free else []),
            list(proposal.distributions) if proposal else [], timeout=self._timeout(self.config.target_timeout_s),
            draft_source=DRAFT_SOURCES[free.source] if free else target_pb2.DRAFT_SOURCE_DRAFT_MODEL,
            alternatives=self._alternatives, decode_ahead=ahead)
        wall_s, forward_s = time.monotonic() - started, verified.forward_ns / 1e9
        self._target_steps = 1 + len(verified.after_token_ids) if ahead else 1
        self._clock.target_call(wall_s, forward_s)
        return verified

    def _choose_alternatives(self, proposal: draft_pb2.ProposeResponse | None) -> list[target_pb2.DraftAlternative]:
        """The draft's second choices this round's verification also tries (as its plan prices them; greedy only)."""
        if proposal is None or not self.offers_alternatives:
            return []
        indices = self._plan.alternatives(self.costs, list(proposal.probabilities),
                                          list(proposal.alternative_probabilities))
        return [target_pb2.DraftAlternative(index=i, token_id=proposal.alternative_token_ids[i]) for i in indices]

    def _draft_request(self, plan: RoundPlan) -> tuple[int, float]:
        """(tokens to ask the draft for, its stop_below): the plan's."""
        return plan.ask, plan.stop_below

    def _k_max(self) -> int:
        return max(0, min(self.request.num_speculative_tokens, self.tokens_left - 1))

    def _draft_prefilling(self) -> bool:
        return self._draft_opening is not None and not self._draft_opening.done()

    def _draft_unavailable(self) -> bool:
        return self.draft is None or not self.switch.enabled or len(self.sequence) < self._draft_back_at

    def _count_round(self, drafted: int, accepted: int, committed: int) -> None:
        self.stats.rounds += 1
        self.stats.target_forward_passes += self._target_steps
        self.stats.draft_tokens += drafted
        self.stats.accepted_tokens += accepted
        self.stats.round_tokens += committed
        self.on_round(drafted, accepted)

    async def _propose(self, k: int) -> draft_pb2.ProposeResponse | None:
        """Ask the draft for k tokens, or give up on the draft and return None."""
        position = len(self.sequence)
        commit = self._draft_commit()
        try:
            if self._draft_opening is not None and not await self._draft_opened():
                return None
            proposal = await self.draft.propose(self.session_id, self._round, commit, position, k,
                                                timeout=self._timeout(self.config.draft_timeout_s),
                                                stop_below=self._stop_below)
        except (grpc.aio.AioRpcError, asyncio.TimeoutError) as error:
            if isinstance(error, grpc.aio.AioRpcError) and error.code() == grpc.StatusCode.UNAVAILABLE:
                self._pause_draft(error.details())
            else:
                self._abandon_draft(f"{type(error).__name__}: {getattr(error, 'code', lambda: '')()}")
            return None
        if not self._proposal_is_sound(proposal, position, k):
            self._abandon_draft("malformed proposal")
            return None
        self._draft_retry_tokens = 1
        return proposal

    async def _draft_opened(self) -> bool:
        """Wait for the draft's prefill, within its own deadline; False where the draft refused the session
        for now (RESOURCE_EXHAUSTED: its KV room or its prefill queue full). That is no fault of the draft's:
        the request goes target-only for a few tokens, and its policy may then open the session again."""
        opening, self._draft_opening = self._draft_opening, None
        try:
            await asyncio.wait_for(opening, max(0.001, self._draft_open_deadline - time.monotonic()))
        except grpc.aio.AioRpcError as error:
            if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
            log.info("request %s: the draft refused its session at round %d (%s); target-only for %d tokens",
                     self.session_id, self._round, error.details(), self._draft_retry_tokens)
            self._draft_asked = False  # it holds no session: the next open is a new one
            self._draft_back_later()
            return False
        return True

    def _draft_commit(self) -> draft_pb2.Commit:
        """What brings the draft's session to the committed sequence: roll back to where it agrees, append the rest."""
        return draft_pb2.Commit(position=self.draft_agreed, token_ids=self.sequence[self.draft_agreed:])

    @staticmethod
    def _proposal_is_sound(proposal: draft_pb2.ProposeResponse, position: int, k: int) -> bool:
        count = len(proposal.token_ids)
        return (proposal.position == position and 0 < count <= k
                and len(proposal.distributions) in (0, count))

    def _pause_draft(self, reason: str) -> None:
        """Target-only for a few rounds; the session is kept (a pooled client moves it when asked again)."""
        log.warning("request %s: draft unreachable at round %d (%s); target-only for %d tokens",
                    self.session_id, self._round, reason, self._draft_retry_tokens)
        self._draft_back_later()

    def _draft_back_later(self) -> None:
        """Target-only for the next few tokens, twice as many as after the last time (up to a most)."""
        self.stats.draft_fallback = True
        # Counted in tokens, not rounds: a target-only round that decodes ahead commits several.
        self._draft_back_at = len(self.sequence) + 1 + self._draft_retry_tokens
        self._draft_retry_tokens = min(2 * self._draft_retry_tokens, MAX_DRAFT_RETRY_TOKENS)

    def _abandon_draft(self, reason: str) -> None:
        log.warning("request %s: draft abandoned at round %d (%s); continuing target-only",
                    self.session_id, self._round, reason)
        self.stats.draft_fallback = True
        draft, self.draft = self.draft, None
        spawn_background(draft.close(self.session_id))

    def _close_sessions(self) -> None:
        """Free both sessions in the background, even when the client's stream was cancelled."""
        opening, self._draft_opening = self._draft_opening, None
        if opening is not None:
            opening.cancel()
            opening.add_done_callback(retrieve_outcome)
        spawn_background(self.target.close(self.session_id))
        if self.draft is not None and self._draft_asked:
            spawn_background(close_after(opening, self.draft, self.session_id))


DRAFT_SOURCES = {LOOKUP: target_pb2.DRAFT_SOURCE_PROMPT_LOOKUP, SUFFIX: target_pb2.DRAFT_SOURCE_SUFFIX_INDEX}


def _proposer(k: int, free: FreeProposal | None) -> str:
    """Who proposed a round's tokens (orchestrator.decoding.proposals)."""
    return free.source if free is not None else (DRAFT if k > 0 else NONE)


async def close_after(opening: asyncio.Task | None, endpoint: DraftEndpoint, session_id: str) -> None:
    """Close the session once its open has ended, whichever way: a close sent beside a cancelled open
    could reach the service first (the service refuses such an open too: specmesh.engine.closed_sessions)."""
    if opening is not None:
        await asyncio.wait([opening])
    await endpoint.close(session_id)
