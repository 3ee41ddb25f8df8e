"""TargetService servicer: parse the request, call the engine, build the response."""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from specmesh.errors import InvalidArgument
from specmesh.server.metrics import ServiceMetrics
from specmesh.engine.sampling_params import sampling_from_pb
from specmesh.server.security import caller_of
from specmesh.server.grpc_server import answer_in_order
from specmesh.server.batches import BatchAnswers
from specmesh.server.telemetry import VERIFY_BATCHES, VERIFY_ROUNDS, annotate_current_span
from specmesh.v1 import common_pb2, target_pb2, target_pb2_grpc
from target_service.engine import TargetEngine, Verification

if TYPE_CHECKING:  # annotations only: the tracing SDK loads where tracing is on (start time)
    from opentelemetry.sdk.trace import TracerProvider

KIND = {True: target_pb2.NEXT_TOKEN_KIND_BONUS, False: target_pb2.NEXT_TOKEN_KIND_RECOVERED}


class TargetServicer(target_pb2_grpc.TargetServiceServicer):
    def __init__(self, engine: TargetEngine, metrics: ServiceMetrics, tracer_provider: TracerProvider | None = None):
        self.engine = engine
        self.metrics = metrics
        self.tracer_provider = tracer_provider
        self.batches = BatchAnswers(VERIFY_BATCHES, self._verification, engine.engine.submit_all,
                                    self._verify_response, target_pb2.VerifyBatchResult, target_pb2.VerifyPart,
                                    tracer_provider)

    async def OpenSession(self, request: target_pb2.TargetOpenRequest, context: grpc.aio.ServicerContext):
        open_ = self.engine.resume if request.resume else self.engine.open
        opened = await open_(request.request_id, list(request.prompt_token_ids), sampling_from_pb(request.sampling),
                             caller_of(context), request.max_new_tokens, context.time_remaining())
        self.metrics.observe_forward("prefill", opened.forward_ns)
        annotate_current_span(forward_ns=opened.forward_ns)
        response = target_pb2.TargetOpenResponse(request_id=request.request_id,
                                                  committed_length=opened.committed_length,
                                                  forward_ns=opened.forward_ns)
        if not request.resume:
            response.token_id = opened.token_id
        if opened.logprob is not None:
            response.logprob.CopyFrom(opened.logprob)
        return response

    async def Verify(self, request: target_pb2.VerifyRequest, context: grpc.aio.ServicerContext):
        return await self._verify(request)

    async def VerifyRounds(self, requests, context: grpc.aio.ServicerContext):
        async for response in answer_in_order(requests, self._verify, self.tracer_provider, VERIFY_ROUNDS):
            yield response

    async def VerifyBatches(self, requests, context: grpc.aio.ServicerContext):
        async for result in self.batches.answer(requests):
            yield result

    async def _verify(self, request: target_pb2.VerifyRequest) -> target_pb2.VerifyResponse:
        return self._verify_response(request, await self.engine.engine.submit(*self._verification(request)))

    def _verification(self, request: target_pb2.VerifyRequest):
        """(session, job) of a checked Verify (TargetEngine.verification)."""
        _check_draft_source(request.draft_source)
        return self.engine.verification(request.request_id, request.round, request.position,
                                        list(request.draft_token_ids), list(request.draft_distributions),
                                        alternatives=list(request.alternatives), decode_ahead=request.decode_ahead)

    def _verify_response(self, request: target_pb2.VerifyRequest, result: Verification) -> target_pb2.VerifyResponse:
        self.metrics.observe_forward("verify", result.forward_ns)
        annotate_current_span(forward_ns=result.forward_ns, accepted=result.verdict.accepted_count,
                              next_token="bonus" if result.verdict.bonus else "recovered")
        return target_pb2.VerifyResponse(
            request_id=request.request_id, round=request.round,
            accepted_count=result.verdict.accepted_count, next_token_id=result.verdict.next_token_id,
            next_token_kind=KIND[result.verdict.bonus], committed_length=result.committed_length,
            forward_ns=result.forward_ns, logprobs=result.logprobs, after_token_ids=result.after)

    async def CloseSession(self, request: common_pb2.CloseSessionRequest, context: grpc.aio.ServicerContext):
        return common_pb2.CloseSessionResponse(closed=self.engine.engine.close(request.request_id))

    async def GetModelInfo(self, request: common_pb2.ModelInfoRequest, context: grpc.aio.ServicerContext):
        return self.engine.engine.describe()


def _check_draft_source(source: int) -> None:
    """VerifyRequest.draft_source names where the tokens came from; the target steps them alike, but an
    unknown source is a caller's mistake, refused like any other bad field."""
    if source not in target_pb2.DraftSource.values():
        raise InvalidArgument("draft_source", f"unknown draft source {source}")
