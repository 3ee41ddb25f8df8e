"""Thin async clients for the draft and target services, with a deadline on every call."""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import weakref
from typing import TYPE_CHECKING, Sequence

import grpc

from orchestrator.serving.round_batches import BatchedBranches, RoundBatches
from orchestrator.serving.round_streams import RoundStream
from specmesh.errors import SpecmeshError
from specmesh.engine.sampling_params import SamplingParams, sampling_to_pb
from specmesh.server.security import (StreamCallMetadata, TLSConfig, add_api_key_arguments, add_client_tls_arguments,
                                      api_key_from_args, bearer_metadata, client_tls_from_args)
from specmesh.server.telemetry import PROPOSE_BATCHES, PROPOSE_ROUNDS, VERIFY_BATCHES, VERIFY_ROUNDS
from specmesh.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

if TYPE_CHECKING:  # annotations only: the tracing SDK loads where tracing is on (start time)
    from opentelemetry.sdk.trace import TracerProvider

log = logging.getLogger(__name__)
CLOSE_TIMEOUT_S = 5.0
CLOSE_ATTEMPTS = 3
_MAX_MESSAGE = 64 * 1024 * 1024
# A channel's StreamCallMetadata (open_channel), sent by the clients with each bidirectional call they open.
_STREAM_METADATA: weakref.WeakKeyDictionary[grpc.aio.Channel, tuple] = weakref.WeakKeyDictionary()


class UpstreamError(SpecmeshError):
    """A service call failed; carries its status code through to the client."""

    def __init__(self, service: str, error: grpc.aio.AioRpcError):
        super().__init__(f"{service} service: {error.code().name}: {error.details()}")
        self.code = error.code()


def open_channel(endpoint: str, tls: TLSConfig | None = None,
                 interceptors: Sequence[grpc.aio.ClientInterceptor | StreamCallMetadata] = ()) -> grpc.aio.Channel:
    """A channel to `endpoint`: TLS (with a client certificate for mutual TLS) when `tls` is given.
    `interceptors` may hold StreamCallMetadata: the Draft/TargetClient over the channel sends it with the
    bidirectional calls it opens.

    The channel keeps its own connections (a local subchannel pool). With gRPC's global pool a channel
    shares its connection, and its reconnect backoff, with every other channel to the same address: a new
    channel to a service restarted on an address an old channel still watches would fail UNAVAILABLE at
    once ("connection refused", the old server's) until that backoff ran out."""
    options = [("grpc.max_receive_message_length", _MAX_MESSAGE),
               ("grpc.max_send_message_length", _MAX_MESSAGE),
               ("grpc.use_local_subchannel_pool", 1)]
    stream_metadata = tuple(pair for item in interceptors if isinstance(item, StreamCallMetadata)
                            for pair in item.metadata)
    interceptors = [item for item in interceptors if not isinstance(item, StreamCallMetadata)]
    if tls is not None:
        channel = grpc.aio.secure_channel(endpoint, tls.channel_credentials(),
                                          options=options + tls.channel_options(), interceptors=interceptors)
    else:
        channel = grpc.aio.insecure_channel(endpoint, options=options, interceptors=interceptors)
    if stream_metadata:
        _STREAM_METADATA[channel] = stream_metadata
    return channel


def _with_stream_metadata(channel: grpc.aio.Channel, open_call):
    """`open_call` (a stub's bidirectional method) sending the channel's StreamCallMetadata, if it has any."""
    metadata = _STREAM_METADATA.get(channel)
    return functools.partial(open_call, metadata=metadata) if metadata else open_call


class _RoundCalls:
    """How a session's rounds travel (LoopConfig.round_calls): a unary call each; a message on a stream of
    the session's own (orchestrator.serving.round_streams); or a part of a batch that carries every
    session's round to the replica in one message (orchestrator.serving.round_batches)."""

    def __init__(self, channel: grpc.aio.Channel, open_stream, stream_method: str, open_batches, batch_type,
                 batch_method: str, round_calls: str, tracer_provider: TracerProvider | None,
                 streamed_fields: tuple[str, str] | None = None):
        open_stream, open_batches = (_with_stream_metadata(channel, open_stream),
                                     _with_stream_metadata(channel, open_batches))
        self._open_stream, self._stream_method = open_stream, stream_method
        self.round_calls, self.tracer_provider = round_calls, tracer_provider
        self._streams: dict[str, RoundStream] = {}
        self.batches = RoundBatches(open_batches, batch_type, batch_method, tracer_provider, streamed_fields)

    async def _round(self, unary, request_id: str, request, timeout: float):
        if self.round_calls == "batch":
            return await self.batches.send(request, timeout)
        if self.round_calls == "unary":
            return await unary(request, timeout=timeout)
        stream = self._streams.get(request_id)
        if stream is None:
            stream = self._streams[request_id] = RoundStream(self._open_stream, self._stream_method,
                                                             self.tracer_provider)
        try:
            return await stream.send(request, timeout)
        except BaseException:
            self._streams.pop(request_id, None)  # ended; after a failover the session's rounds go elsewhere
            raise

    def _end_rounds(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.end()


def client_options(round_calls: str, tracer_provider: TracerProvider | None) -> dict:
    """The Draft/TargetClient settings of a deployment whose LoopConfig.round_calls is `round_calls`."""
    return dict(round_calls=round_calls, tracer_provider=tracer_provider)


class DraftClient(_RoundCalls):
    def __init__(self, channel: grpc.aio.Channel, round_calls: str = "unary",
                 tracer_provider: TracerProvider | None = None):
        self.stub = draft_pb2_grpc.DraftServiceStub(channel)
        super().__init__(channel, self.stub.ProposeRounds, PROPOSE_ROUNDS, self.stub.ProposeBatches,
                         draft_pb2.ProposeBatch, PROPOSE_BATCHES, round_calls, tracer_provider,
                         streamed_fields=("predrafts", "branches"))

    async def model_info(self, timeout: float) -> common_pb2.ModelInfo:
        return await self.stub.GetModelInfo(common_pb2.ModelInfoRequest(), timeout=timeout)

    async def open(self, request_id: str, prompt: Sequence[int], sampling: SamplingParams,
                   timeout: float, max_new_tokens: int = 0) -> draft_pb2.DraftOpenResponse:
        """max_new_tokens: what the session may add to the prompt, its KV reservation (0: the context window)."""
        return await self.stub.OpenSession(draft_pb2.DraftOpenRequest(
            request_id=request_id, prompt_token_ids=prompt, sampling=sampling_to_pb(sampling),
            max_new_tokens=max_new_tokens), timeout=timeout)

    async def propose(self, request_id: str, round_number: int, commit: draft_pb2.Commit | None,
                      position: int, num_tokens: int, timeout: float,
                      stop_below: float = 0.0) -> draft_pb2.ProposeResponse:
        request = draft_pb2.ProposeRequest(request_id=request_id, round=round_number, position=position,
                                           num_tokens=num_tokens, commit=commit, stop_below=stop_below)
        return await self._round(self.stub.Propose, request_id, request, timeout)

    def predraft(self, request_id: str, round_number: int, commit: draft_pb2.Commit | None, position: int,
                 assumed_token_ids: Sequence[int], num_tokens: int, extra_branches: int,
                 timeout: float) -> grpc.aio.UnaryStreamCall | BatchedBranches:
        """The pre-draft's branches: iterate them, cancel to stop listening. With round batches a part of the
        next batch (no call of its own), else a PreDraft call."""
        request = draft_pb2.PreDraftRequest(request_id=request_id, round=round_number, commit=commit,
                                            position=position, assumed_token_ids=assumed_token_ids,
                                            num_tokens=num_tokens, extra_branches=extra_branches)
        if self.round_calls == "batch":
            return self.batches.stream(request, timeout)
        return self.stub.PreDraft(request, timeout=timeout)

    async def close(self, request_id: str) -> None:
        self._end_rounds(request_id)
        await _close_quietly("draft", self.stub.CloseSession, request_id)


class TargetClient(_RoundCalls):
    def __init__(self, channel: grpc.aio.Channel, round_calls: str = "unary",
                 tracer_provider: TracerProvider | None = None):
        self.stub = target_pb2_grpc.TargetServiceStub(channel)
        super().__init__(channel, self.stub.VerifyRounds, VERIFY_ROUNDS, self.stub.VerifyBatches,
                         target_pb2.VerifyBatch, VERIFY_BATCHES, round_calls, tracer_provider)

    async def model_info(self, timeout: float) -> common_pb2.ModelInfo:
        return await self.stub.GetModelInfo(common_pb2.ModelInfoRequest(), timeout=timeout)

    async def open(self, request_id: str, prompt: Sequence[int], sampling: SamplingParams,
                   timeout: float, max_new_tokens: int = 0) -> target_pb2.TargetOpenResponse:
        """max_new_tokens: what the session may add to the prompt, its KV reservation (0: the context window)."""
        request = target_pb2.TargetOpenRequest(request_id=request_id, prompt_token_ids=prompt,
                                               sampling=sampling_to_pb(sampling), max_new_tokens=max_new_tokens)
        return await _call_target(self.stub.OpenSession, request, timeout)

    async def resume(self, request_id: str, committed: Sequence[int], sampling: SamplingParams,
                     timeout: float, max_new_tokens: int = 0) -> target_pb2.TargetOpenResponse:
        """Re-open a session another replica lost, prefilled with its committed sequence."""
        request = target_pb2.TargetOpenRequest(request_id=request_id, prompt_token_ids=committed,
                                               sampling=sampling_to_pb(sampling), resume=True,
                                               max_new_tokens=max_new_tokens)
        return await _call_target(self.stub.OpenSession, request, timeout)

    async def verify(self, request_id: str, round_number: int, position: int, draft_token_ids: Sequence[int],
                     distributions: Sequence[common_pb2.TokenDistribution], timeout: float,
                     draft_source: int = target_pb2.DRAFT_SOURCE_DRAFT_MODEL,
                     alternatives: Sequence[target_pb2.DraftAlternative] = (),
                     decode_ahead: int = 0) -> target_pb2.VerifyResponse:
        request = target_pb2.VerifyRequest(request_id=request_id, round=round_number, position=position,
                                           draft_token_ids=draft_token_ids, draft_distributions=distributions,
                                           draft_source=draft_source, alternatives=alternatives,
                                           decode_ahead=decode_ahead)
        return await _call_target(functools.partial(self._round, self.stub.Verify, request_id), request, timeout)

    async def close(self, request_id: str) -> None:
        self._end_rounds(request_id)
        await _close_quietly("target", self.stub.CloseSession, request_id)


async def _call_target(method, request, timeout: float):
    try:
        return await method(request, timeout=timeout)
    except grpc.aio.AioRpcError as error:
        raise UpstreamError("target", error) from error


async def _close_quietly(service: str, method, request_id: str) -> None:
    """Closing is best effort: a dead service has already lost the session. A close that timed out is
    sent again: a service busy with many streams ending at once may answer late, and a close lost so
    would leave the session to the idle reaper (minutes)."""
    for attempt in range(1, CLOSE_ATTEMPTS + 1):
        try:
            await method(common_pb2.CloseSessionRequest(request_id=request_id), timeout=CLOSE_TIMEOUT_S)
            return
        except (grpc.aio.AioRpcError, asyncio.TimeoutError) as error:
            timed_out = not isinstance(error, grpc.aio.AioRpcError) or error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            log.debug("closing %s session %s failed (attempt %d): %s", service, request_id, attempt, error)
            if not timed_out:
                return


def add_client_arguments(parser: argparse.ArgumentParser) -> None:
    """Endpoint, TLS and API-key flags of the command-line clients (generate, speculation, scale, ...)."""
    parser.add_argument("--endpoint", default="127.0.0.1:50051", help="the orchestrator's gRPC host:port")
    add_client_tls_arguments(parser)
    add_api_key_arguments(parser, serving=False)


def client_channel(args: argparse.Namespace) -> tuple[grpc.aio.Channel, tuple[tuple[str, str], ...]]:
    """(channel to --endpoint, call metadata carrying the API key)."""
    return open_channel(args.endpoint, client_tls_from_args(args)), bearer_metadata(api_key_from_args(args))
