"""Pipelined speculation: the draft drafts round r+1 while the target verifies round r.

While Verify(r) runs, a PreDraft(r+1) stream asks the draft for branches keyed by
the outcome they assume, (accepted count, next token): first "all of round r
accepted, the draft's argmax as bonus", then, where measured costs leave the
draft idle time, the likeliest rejections. When the verification arrives, a
branch whose key, round and position match the committed outcome becomes round
r+1's proposal at once; otherwise the stream is dropped and a fresh Propose
(whose commit rolls the draft back to the committed sequence) drafts it.

Lossless: a branch is drafted from q given exactly the prefix it assumes, and
which branch is used depends only on the target's outcome, never on the
branch's tokens; a seeded draft samples a proposal from a generator derived
from its first position, so a branch and a fresh Propose give the same tokens.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

import grpc

from orchestrator.decoding.costs import BatchLoad, RoundCosts
from orchestrator.decoding.endpoints import BranchStream
from orchestrator.decoding.loop import SpeculativeGeneration
from orchestrator.decoding.plan import RoundPlan
from orchestrator.decoding.proposals import FreeProposal
from orchestrator.decoding.timing import HIT, MISS
from specmesh.v1 import common_pb2, draft_pb2, target_pb2

log = logging.getLogger(__name__)
MAX_AUTO_EXTRA_BRANCHES = 4
PIPELINE_MODES = ("auto", "on", "off")


class Predraft:
    """One PreDraft stream, its branches collected in the background by key."""

    def __init__(self, call: BranchStream, round_number: int, request_id: str, position: int,
                 assumed_count: int, extra_branches: int):
        self.call = call
        self.round = round_number
        self.request_id = request_id
        self.position = position  # of the assumed tokens (the round under verification)
        self.assumed_count = assumed_count
        self.extra_branches = extra_branches  # rejection branches asked for
        self.branches: dict[tuple[int, int], draft_pb2.DraftBranch] = {}
        self.planned: set[tuple[int, int]] = set()  # keys the draft said it would send
        self.arrived_forward_s = 0.0  # draft forward time of the branches received so far
        self.counted_s = 0.0  # of the draft's busy time, what a round breakdown already holds
        self.last_event = time.monotonic()  # the start, or the latest branch's arrival
        self.first_arrived = False
        self.done = False
        self.timed_out = False  # a take() waited its whole wait_s for a branch that may still have come
        self._changed = asyncio.Condition()
        self.task = asyncio.ensure_future(self._collect())

    async def _collect(self) -> None:
        try:
            async for branch in self.call:
                await self._add(branch)
        except (grpc.aio.AioRpcError, asyncio.CancelledError) as error:
            log.debug("pre-draft for round %d ended: %s", self.round, error)
        finally:
            self.done = True
            async with self._changed:
                self._changed.notify_all()

    async def _add(self, branch: draft_pb2.DraftBranch) -> None:
        self.arrived_forward_s += branch.forward_ns / 1e9
        self.last_event = time.monotonic()
        if branch.round == self.round and branch.request_id == self.request_id:  # stale ones are never kept
            key = (branch.accepted_count, branch.next_token_id)
            self.branches[key] = branch
            if not self.first_arrived:
                self.planned = {key, *zip(branch.planned_accepted_counts, branch.planned_next_token_ids)}
        self.first_arrived = True
        async with self._changed:
            self._changed.notify_all()

    def _may_still_come(self, key: tuple[int, int]) -> bool:
        """All-accepted comes first and is the likeliest; others only if the draft planned them.

        Rejection branches are asked for only when measured costs say the draft finishes
        them within a verification, so waiting for the plan (on the first branch) is cheap.
        """
        if self.done or key in self.branches:
            return False
        if not self.first_arrived:
            return key[0] == self.assumed_count or self.extra_branches > 0
        return key in self.planned

    async def take(self, accepted: int, next_token_id: int, wait_s: float) -> draft_pb2.DraftBranch | None:
        """The branch for this outcome, waiting (at most wait_s) while the draft is still drafting it."""
        key = (accepted, next_token_id)
        try:
            async with asyncio.timeout(wait_s), self._changed:  # in this task: wait_for would start another
                await self._changed.wait_for(lambda: not self._may_still_come(key))
        except TimeoutError:
            self.timed_out = True
        branch = self.branches.get(key)
        if branch is None or branch.position != self.position + accepted + 1:
            return None  # for another outcome, or stale: never used
        return branch

    def busy_so_far(self) -> float:
        """Draft forward time so far: the branches received, plus the one in progress.

        The branch in progress is taken to have kept the draft busy since the last
        arrival (true for one stream at a time; queueing behind others counts too).
        """
        if self.done:
            return self.arrived_forward_s
        return self.arrived_forward_s + time.monotonic() - self.last_event

    def stop(self) -> None:
        self.call.cancel()


def extra_branches(costs: RoundCosts, k: int, batch: BatchLoad) -> int:
    """Rejection branches that fit in the draft's idle time during a verification of k draft tokens.

    The all-accepted branch costs k + 2 draft steps (re-score, bonus, k tokens);
    each further branch k steps. Branches past the idle time would delay the
    next round instead of being free.
    """
    step_s, verify_s = costs.draft_forward.value, costs.target_step_s(k, batch)
    if step_s is None or verify_s is None or step_s <= 0:
        return 0
    idle = verify_s - (k + 2) * step_s
    return max(0, min(MAX_AUTO_EXTRA_BRANCHES, math.floor(idle / (k * step_s))))


class PipelinedGeneration(SpeculativeGeneration):
    """SpeculativeGeneration with drafting overlapped with verification."""

    offers_alternatives = False  # a pre-drafted branch is keyed by (accepted, next token): one token per outcome

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._ahead: Predraft | None = None  # the pre-draft for the next round
        self._outcome: tuple[int, int] = (0, 0)  # (accepted, next token) of the last verification
        self._agreed_floor: int | None = None  # set when an extra branch was used: see _take_branch

    def _draft_request(self, plan: RoundPlan) -> tuple[int, float]:
        """The plan's k exactly: a pre-draft runs the next round's k ahead while this one is verified, and
        a draft that stops on its own doubt would leave the branch short."""
        return plan.k, 0.0

    async def _proposal_for_round(self, k: int) -> draft_pb2.ProposeResponse | None:
        if self._agreed_floor is not None:
            self.draft_agreed = min(self.draft_agreed, self._agreed_floor)
            self._agreed_floor = None
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            proposal = await self._take_branch(ahead, k) if k > 0 else None
            ahead.stop()
            if proposal is not None:
                return proposal
            if ahead.timed_out:  # the draft was given its timeout already: a fresh Propose would wait another
                self._abandon_draft("no pre-drafted branch within the draft timeout")
                return None
        return await super()._proposal_for_round(k)

    async def _take_branch(self, ahead: Predraft, k: int) -> draft_pb2.ProposeResponse | None:
        started = time.monotonic()
        branch = await ahead.take(*self._outcome, wait_s=self._timeout(self.config.draft_timeout_s))
        self._clock.draft_call(time.monotonic() - started, max(0.0, ahead.arrived_forward_s - ahead.counted_s))
        position = len(self.sequence)
        proposal = None
        if branch is not None and self.draft is not None:
            proposal = draft_pb2.ProposeResponse(
                request_id=self.session_id, round=self._round, position=branch.position,
                token_ids=branch.token_ids[:k], distributions=branch.distributions[:k], forward_ns=branch.forward_ns)
            if not self._proposal_is_sound(proposal, position, k):
                proposal = None
        self._clock.predraft = HIT if proposal is not None else MISS
        if proposal is not None and branch.accepted_count < ahead.assumed_count:
            # The draft's own sequence still holds the all-accepted line past this point until a
            # commit adopts the branch, so later commits must start no later than here.
            self._agreed_floor = ahead.position + branch.accepted_count
        return proposal

    async def _verify_round(self, position: int, proposal: draft_pb2.ProposeResponse | None,
                            k: int, free: FreeProposal | None = None) -> target_pb2.VerifyResponse:
        if proposal is not None:
            self.costs.observe_draft_forward(proposal.forward_ns / 1e9, len(proposal.token_ids))
            if self.draft is not None and self._worth_predrafting(proposal):
                self._ahead = self._start_predraft(position, proposal, k)
        verified = await super()._verify_round(position, proposal, k, free)
        if self._ahead is not None:
            self._ahead.counted_s = self._ahead.busy_so_far()
            self._clock.draft_behind(self._ahead.counted_s)
        self._outcome = (verified.accepted_count, verified.next_token_id)
        return verified

    def _worth_predrafting(self, proposal: draft_pb2.ProposeResponse) -> bool:
        """No next round follows one that can only end the generation."""
        return self.generated + len(proposal.token_ids) + 1 < self.request.max_tokens

    def _start_predraft(self, position: int, proposal: draft_pb2.ProposeResponse, k: int) -> Predraft:
        commit = self._draft_commit()
        extra = self.config.extra_branches
        extra = extra_branches(self.costs, k, self._plan.batch) if extra is None else extra
        call = self.draft.predraft(self.session_id, self._round + 1, commit, position, list(proposal.token_ids), k,
                                   extra, timeout=self._timeout(self.config.target_timeout_s))
        return Predraft(call, self._round + 1, self.session_id, position, len(proposal.token_ids), extra)

    def _close_sessions(self) -> None:
        if self._ahead is not None:
            self._ahead.stop()
            self._ahead = None
        super()._close_sessions()


def separate_compute(target: common_pb2.ModelInfo, draft: common_pb2.ModelInfo) -> bool:
    """Whether draft and target compute on separate hardware, so that overlapping them pays.

    Separate: different hosts, different devices, or (both on CPU) disjoint CPU sets.
    """
    if target.host != draft.host or target.device != draft.device:
        return True
    if target.device.startswith("cpu") and target.cpu_affinity and draft.cpu_affinity:
        return not set(target.cpu_affinity) & set(draft.cpu_affinity)
    return False


def pipeline_enabled(mode: str, target: common_pb2.ModelInfo, draft: common_pb2.ModelInfo | None) -> bool:
    """LoopConfig.pipeline ("auto", "on" or "off") resolved against the two services."""
    if mode not in PIPELINE_MODES:
        raise ValueError(f"pipeline must be one of {PIPELINE_MODES}, not {mode!r}")
    if draft is None or mode == "off":
        return False
    return mode == "on" or separate_compute(target, draft)
