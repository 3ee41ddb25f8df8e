"""DraftService servicer: parse the request, call the engine, build the response."""

from __future__ import annotations

from typing import TYPE_CHECKING, AsyncIterator, Awaitable

import grpc

from draft_service.engine import BranchProposal, CommitSpec, DraftEngine, Proposal
from specmesh.server.metrics import ServiceMetrics
from specmesh.engine.sampling_params import sampling_from_pb
from specmesh.server.security import caller_of
from specmesh.server.grpc_server import answer_in_order
from specmesh.server.batches import BatchAnswers, StreamedParts
from specmesh.server.telemetry import PROPOSE_BATCHES, PROPOSE_ROUNDS, annotate_current_span
from specmesh.v1 import common_pb2, draft_pb2, draft_pb2_grpc

if TYPE_CHECKING:  # annotations only: the tracing SDK loads where tracing is on (start time)
    from opentelemetry.sdk.trace import TracerProvider


def commit_from_pb(commit: draft_pb2.Commit) -> CommitSpec:
    return CommitSpec(position=commit.position, token_ids=tuple(commit.token_ids))


class DraftServicer(draft_pb2_grpc.DraftServiceServicer):
    def __init__(self, engine: DraftEngine, metrics: ServiceMetrics, tracer_provider: TracerProvider | None = None):
        self.engine = engine
        self.metrics = metrics
        self.tracer_provider = tracer_provider
        predrafts = StreamedParts("predrafts", "branches", draft_pb2.BranchPart, "branch", self._predraft_start)
        self.batches = BatchAnswers(PROPOSE_BATCHES, self._proposal, engine.engine.submit_all,
                                    self._propose_response, draft_pb2.ProposeBatchResult, draft_pb2.ProposePart,
                                    tracer_provider, predrafts)

    async def OpenSession(self, request: draft_pb2.DraftOpenRequest, context: grpc.aio.ServicerContext):
        forward_ns = await self.engine.open(request.request_id, list(request.prompt_token_ids),
                                            sampling_from_pb(request.sampling), caller_of(context),
                                            request.max_new_tokens, context.time_remaining())
        self.metrics.observe_forward("prefill", forward_ns)
        annotate_current_span(forward_ns=forward_ns)
        return draft_pb2.DraftOpenResponse(request_id=request.request_id,
                                           length=len(request.prompt_token_ids), forward_ns=forward_ns)

    async def Propose(self, request: draft_pb2.ProposeRequest, context: grpc.aio.ServicerContext):
        return await self._propose(request)

    async def ProposeRounds(self, requests, context: grpc.aio.ServicerContext):
        async for response in answer_in_order(requests, self._propose, self.tracer_provider, PROPOSE_ROUNDS):
            yield response

    async def ProposeBatches(self, requests, context: grpc.aio.ServicerContext):
        async for result in self.batches.answer(requests):
            yield result

    async def _propose(self, request: draft_pb2.ProposeRequest) -> draft_pb2.ProposeResponse:
        return self._propose_response(request, await self.engine.engine.submit(*self._proposal(request)))

    def _proposal(self, request: draft_pb2.ProposeRequest):
        """(session, job) of a checked Propose (DraftEngine.proposal)."""
        commit = commit_from_pb(request.commit) if request.HasField("commit") else None
        return self.engine.proposal(request.request_id, request.round, commit, request.position, request.num_tokens,
                                    request.stop_below)

    def _propose_response(self, request: draft_pb2.ProposeRequest, proposal: Proposal) -> draft_pb2.ProposeResponse:
        self.metrics.observe_forward("propose", proposal.forward_ns)
        annotate_current_span(forward_ns=proposal.forward_ns, proposed=len(proposal.token_ids))
        return draft_pb2.ProposeResponse(
            request_id=request.request_id, round=request.round, position=proposal.position,
            token_ids=proposal.token_ids, distributions=proposal.distributions,
            forward_ns=proposal.forward_ns, probabilities=proposal.probabilities,
            alternative_token_ids=proposal.alternative_token_ids,
            alternative_probabilities=proposal.alternative_probabilities)

    async def PreDraft(self, request: draft_pb2.PreDraftRequest, context: grpc.aio.ServicerContext):
        commit = commit_from_pb(request.commit) if request.HasField("commit") else None
        branches = self.engine.predraft(request.request_id, request.round, commit, request.position,
                                        list(request.assumed_token_ids), request.num_tokens, request.extra_branches)
        async for branch in self._branch_messages(request, branches):
            yield branch

    def _predraft_start(self, request: draft_pb2.PreDraftRequest):
        """A batch's pre-draft checked -> (its first job, follow(that job's future) -> its DraftBranches)."""
        commit = commit_from_pb(request.commit) if request.HasField("commit") else None
        started = self.engine.predraft_start(request.request_id, request.round, commit, request.position,
                                             list(request.assumed_token_ids), request.num_tokens,
                                             request.extra_branches)

        def follow(main: Awaitable[BranchProposal]) -> AsyncIterator[draft_pb2.DraftBranch]:
            return self._branch_messages(request, self.engine.predraft_branches(started, main))
        return started.main, follow

    async def _branch_messages(self, request: draft_pb2.PreDraftRequest,
                               branches: AsyncIterator[BranchProposal]) -> AsyncIterator[draft_pb2.DraftBranch]:
        count, forward_ns = 0, 0
        async for branch in branches:
            proposal = branch.proposal
            self.metrics.observe_forward("predraft", proposal.forward_ns)
            count, forward_ns = count + 1, forward_ns + proposal.forward_ns
            yield draft_pb2.DraftBranch(
                request_id=request.request_id, round=request.round, accepted_count=branch.accepted_count,
                next_token_id=branch.next_token_id, position=proposal.position, token_ids=proposal.token_ids,
                distributions=proposal.distributions, forward_ns=proposal.forward_ns,
                planned_accepted_counts=[accepted for accepted, _ in branch.planned],
                planned_next_token_ids=[token for _, token in branch.planned])
        annotate_current_span(forward_ns=forward_ns, branches=count)

    async def CloseSession(self, request: common_pb2.CloseSessionRequest, context: grpc.aio.ServicerContext):
        return common_pb2.CloseSessionResponse(closed=self.engine.close(request.request_id))

    async def GetModelInfo(self, request: common_pb2.ModelInfoRequest, context: grpc.aio.ServicerContext):
        return self.engine.engine.describe()
