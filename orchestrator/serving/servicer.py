"""The client-facing Generation service: validate, run the loop, stream deltas, record."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import grpc
from opentelemetry import trace
from transformers import PreTrainedTokenizerBase

from orchestrator.serving.step_reports import StepReports
from orchestrator.serving.detokenizer import IncrementalDetokenizer
from orchestrator.decoding.costs import RoundCosts
from orchestrator.decoding.endpoints import DraftEndpoint, TargetEndpoint
from orchestrator.decoding.plan import DraftLengthPolicy, FixedLength
from orchestrator.decoding.policy import Speculation
from orchestrator.decoding.loop import SpeculativeGeneration
from orchestrator.decoding.request import GenerationRequest, LoopConfig, LoopStats, SpeculationSwitch
from orchestrator.decoding.pipelined import PipelinedGeneration
from orchestrator.serving.run_ahead import run_ahead
from orchestrator.decoding.suffix_index import SuffixIndex
from orchestrator.serving.choices import interleave
from orchestrator.serving.finish_reasons import FINISH_REASON_NAMES
from orchestrator.serving.validation import ModelLimits, choice_count, for_choice, validate_request
from specmesh.errors import NotManagedHere
from specmesh.server.metrics import OrchestratorMetrics, RequestRecorder
from specmesh.v1 import admin_pb2, admin_pb2_grpc, generation_pb2, generation_pb2_grpc



@dataclass
class Backends:
    target: TargetEndpoint  # a service's client or a pool's (orchestrator.serving.clients, .failover)
    draft: DraftEndpoint | None  # None: target-only serving
    eos_token_ids: set[int]
    limits: ModelLimits
    model: str  # the target model's name, for metrics and traces
    pipelined: bool = False  # draft the next round while the target verifies (orchestrator.decoding.pipelined)
    draft_model: str = ""  # the draft's model name at start-up (a pooled draft tells each session's own)
    # What a forward step costs the target and the draft, as last reported (kept current with pools).
    step_reports: StepReports = field(default_factory=StepReports)


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, tokenizer: PreTrainedTokenizerBase, backends: Backends, config: LoopConfig,
                 metrics: OrchestratorMetrics | None = None, tracer: trace.Tracer | None = None,
                 switch: SpeculationSwitch | None = None, *, pools=None,
                 on_served: Callable[[Sequence[int], int], None] | None = None):
        self.tokenizer = tokenizer
        self.backends = backends
        self.config = config
        self.metrics = metrics or OrchestratorMetrics()
        self.tracer = tracer
        self.switch = switch or SpeculationSwitch()
        self.adaptive = Speculation(costs=RoundCosts(backends.step_reports, config.decode_ahead))
        # Earlier and running requests' sequences, for suffix proposals (orchestrator.decoding.suffix_index).
        self.history = SuffixIndex(config.suffix_index_bytes) if config.suffix_index else None
        self.pools = pools  # orchestrator.control.pools.Pools when serving from replica pools, else None
        self.on_served = on_served  # (prompt token ids, completion tokens) of each finished completion, or None

    def encode(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt) if prompt else []

    async def Generate(self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        async for response in self.generate(request, context.time_remaining()):
            yield response

    async def generate(self, request: generation_pb2.GenerateRequest, time_remaining: float | None = None):
        """The Generate stream, for any front end (gRPC here, HTTP in orchestrator.serving.http_api).

        Raises InvalidArgument before the first response when the request is bad.
        With n > 1, the completions' responses interleave, each tagged with its index.
        """
        started = time.monotonic()
        # Off the event loop: tokenizing a long prompt takes up to a second, and the fast tokenizer lets
        # go of the GIL meanwhile, so other streams keep flowing (benchmarks/big_prompt.py measures it).
        checked = await asyncio.to_thread(validate_request, request, self.encode, self.backends.limits,
                                          time_remaining)
        n = choice_count(request)
        span = trace.get_current_span()  # the front end's server span: the root of this request's trace
        _describe_request(span, checked, self.backends.model, n)
        choices = [self._generate_choice(for_choice(checked, index), index, started, span) for index in range(n)]
        async with contextlib.aclosing(choices[0] if n == 1 else interleave(choices)) as responses:
            async for response in responses:
                yield response

    async def _generate_choice(self, checked: GenerationRequest, index: int, started: float, span: trace.Span):
        """One completion's responses, tagged with its index."""
        # The recorder asks for the draft's model only once rounds run, by then of `generation`, made below.
        recorder = RequestRecorder(self.metrics, self.backends.model, checked.prompt_class,
                                   draft_model=lambda: self._draft_model_of(generation.session_id))
        recorder.admitted()
        loop = PipelinedGeneration if self.backends.pipelined else SpeculativeGeneration
        generation = loop(checked, self.backends.target, self.backends.draft, self.backends.eos_token_ids,
                          self.config, on_round=recorder.round, tracer=self.tracer, switch=self.switch,
                          policy=self._draft_length_policy(checked), on_timing=recorder.round_time,
                          history=self.history, on_proposer=recorder.proposer)
        try:
            async for response in self._stream(checked, generation, recorder, started):
                response.index = index
                if response.finish_reason:
                    _describe_outcome(span, response, self.backends.model)
                yield response
        finally:
            recorder.abandoned()  # no-op once finished

    def _draft_model_of(self, session_id: str) -> str | None:
        """The model of the draft replica that holds the session (pools: it changes with a rollout)."""
        model_of = getattr(self.backends.draft, "model_of", None)
        return model_of(session_id) if model_of is not None else self.backends.draft_model or None

    def _draft_length_policy(self, checked: GenerationRequest) -> DraftLengthPolicy:
        """Adaptive k unless the client fixed k, or seeded sampling must stay reproducible."""
        seeded = checked.sampling.seed is not None and not checked.sampling.greedy
        if not self.config.adaptive_k or checked.fixed_k or seeded:
            # A fixed k measures its rounds over the same reports, apart from the rounds the policy plans.
            return FixedLength(RoundCosts(self.backends.step_reports, self.config.decode_ahead))
        return self.adaptive.for_request(checked.prompt_class, sampled=not checked.sampling.greedy)

    async def _stream(self, checked: GenerationRequest, generation: SpeculativeGeneration,
                      recorder: RequestRecorder, started: float):
        detokenizer = IncrementalDetokenizer(self.tokenizer, checked.prompt_token_ids, checked.stop)
        first_token_at, completion_tokens, generated = None, 0, 0
        async with contextlib.aclosing(run_ahead(generation.tokens())) as batches:
            async for batch in batches:
                now = time.monotonic()
                generated += len(batch)  # the rounds may have run on past this batch meanwhile
                text, consumed = detokenizer.add(batch)
                batch = batch[:consumed]
                completion_tokens += len(batch)
                if first_token_at is None:
                    first_token_at = now
                    recorder.first_token(now - started, now)
                else:
                    recorder.streamed(len(batch), now)
                response = generation_pb2.GenerateResponse(
                    request_id=checked.request_id, token_ids=batch, text=text,
                    logprobs=generation.logprobs[completion_tokens - len(batch):completion_tokens])
                finish = self._finish_reason(generation, detokenizer, batch, generated)
                if finish:
                    response.text += detokenizer.finish()
                    response.finish_reason = finish
                    response.stats.CopyFrom(_stats(generation.stats, started, first_token_at, completion_tokens,
                                                   len(checked.prompt_token_ids)))
                    _record_finish(recorder, response)
                    if self.on_served is not None:
                        self.on_served(checked.prompt_token_ids, completion_tokens)
                    yield response
                    return
                yield response

    def _finish_reason(self, generation: SpeculativeGeneration, detokenizer: IncrementalDetokenizer,
                       batch: list[int], generated: int) -> int:
        """generated: tokens the rounds committed up to and with `batch`."""
        if detokenizer.stopped or any(t in self.backends.eos_token_ids for t in batch):
            return generation_pb2.FINISH_REASON_STOP
        if generated >= generation.request.max_tokens:
            return generation_pb2.FINISH_REASON_LENGTH
        return generation_pb2.FINISH_REASON_UNSPECIFIED


class AdminServicer(admin_pb2_grpc.AdminServicer):
    """The operator's kill switch for speculation, the replica pools' size, and the draft's model."""

    def __init__(self, switch: SpeculationSwitch, pools=None, history: SuffixIndex | None = None):
        self.switch = switch
        self.pools = pools  # orchestrator.control.pools.Pools, or None: no pools here
        self.history = history  # the Generation servicer's suffix index, or None: off

    async def SetSpeculation(self, request: admin_pb2.SetSpeculationRequest, context: grpc.aio.ServicerContext):
        self.switch.enabled = request.enabled
        return admin_pb2.SpeculationState(enabled=self.switch.enabled)

    async def GetSpeculation(self, request: admin_pb2.GetSpeculationRequest, context: grpc.aio.ServicerContext):
        return admin_pb2.SpeculationState(enabled=self.switch.enabled)

    async def ClearSuffixIndex(self, request: admin_pb2.ClearSuffixIndexRequest, context: grpc.aio.ServicerContext):
        if self.history is None:
            return admin_pb2.SuffixIndexState(enabled=False)
        cleared = len(self.history)
        self.history.clear()
        return admin_pb2.SuffixIndexState(enabled=True, documents=len(self.history), bytes=self.history.bytes_used,
                                          max_bytes=self.history.max_bytes, cleared_documents=cleared)

    async def ScalePool(self, request: admin_pb2.ScalePoolRequest, context: grpc.aio.ServicerContext):
        return self._require_pools().scale(request.pool, request.replicas)

    async def ReplaceModel(self, request: admin_pb2.ReplaceModelRequest, context: grpc.aio.ServicerContext):
        return await self._require_pools().replace_model(request.pool, request.model)

    async def ListReplicas(self, request: admin_pb2.ListReplicasRequest, context: grpc.aio.ServicerContext):
        return self._require_pools().list()

    def _require_pools(self):
        if self.pools is None:
            raise NotManagedHere("this orchestrator serves fixed endpoints, not replica pools "
                          "(start it with 'specmesh serve', which runs them)")
        return self.pools


def _stats(stats: LoopStats, started: float, first_token_at: float, completion_tokens: int,
           prompt_tokens: int) -> generation_pb2.GenerationStats:
    ttft_ms = (first_token_at - started) * 1e3
    e2e_ms = (time.monotonic() - started) * 1e3
    return generation_pb2.GenerationStats(
        draft_tokens=stats.draft_tokens,
        accepted_tokens=stats.accepted_tokens,
        acceptance_rate=stats.accepted_tokens / stats.draft_tokens if stats.draft_tokens else 0.0,
        rounds=stats.rounds,
        target_forward_passes=stats.target_forward_passes,
        ttft_ms=ttft_ms,
        tpot_ms=(e2e_ms - ttft_ms) / (completion_tokens - 1) if completion_tokens > 1 else 0.0,
        e2e_ms=e2e_ms,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        draft_fallback=stats.draft_fallback,
        tokens_per_round=stats.round_tokens / stats.rounds if stats.rounds else 0.0,
        lookup_tokens=stats.lookup_tokens,
        lookup_accepted_tokens=stats.lookup_accepted_tokens,
        suffix_tokens=stats.suffix_tokens,
        suffix_accepted_tokens=stats.suffix_accepted_tokens,
        alternative_tokens=stats.alternative_tokens,
        alternative_accepted_tokens=stats.alternative_accepted_tokens,
    )


def _record_finish(recorder: RequestRecorder, response: generation_pb2.GenerateResponse) -> None:
    stats = response.stats
    recorder.finished(
        FINISH_REASON_NAMES[response.finish_reason], stats.prompt_tokens, stats.completion_tokens,
        stats.target_forward_passes, stats.draft_fallback,
        stats.acceptance_rate if stats.draft_tokens else None,
        stats.tpot_ms / 1e3 if stats.completion_tokens > 1 else None, stats.e2e_ms / 1e3)
    recorder.looked_up(stats.lookup_tokens, stats.lookup_accepted_tokens)


def _describe_request(span: trace.Span, request: GenerationRequest, model: str, n: int) -> None:
    """GenAI semantic-convention attributes of the request on the root span."""
    if not span.is_recording():
        return
    span.set_attributes({
        "gen_ai.operation.name": "text_completion", "gen_ai.provider.name": "specmesh",
        "gen_ai.request.model": model, "gen_ai.request.max_tokens": request.max_tokens,
        "gen_ai.request.temperature": request.sampling.temperature, "gen_ai.request.top_p": request.sampling.top_p,
        "gen_ai.request.top_k": request.sampling.top_k, "gen_ai.response.id": request.request_id,
        "gen_ai.usage.input_tokens": len(request.prompt_token_ids),
        "specmesh.num_speculative_tokens": request.num_speculative_tokens,
        "specmesh.prompt_class": request.prompt_class, "gen_ai.request.choice.count": n,
        "gen_ai.request.presence_penalty": request.sampling.presence_penalty,
        "gen_ai.request.frequency_penalty": request.sampling.frequency_penalty,
    })
    if request.user:
        span.set_attribute("user.id", request.user)  # OpenAI's `user`: recorded, no effect


def _describe_outcome(span: trace.Span, response: generation_pb2.GenerateResponse, model: str) -> None:
    if not span.is_recording():
        return
    stats = response.stats
    span.set_attributes({
        "gen_ai.response.model": model,
        "gen_ai.response.finish_reasons": [FINISH_REASON_NAMES[response.finish_reason]],
        "gen_ai.usage.output_tokens": stats.completion_tokens,
        "specmesh.draft_tokens": stats.draft_tokens, "specmesh.accepted_tokens": stats.accepted_tokens,
        "specmesh.rounds": stats.rounds, "specmesh.target_forward_passes": stats.target_forward_passes,
        "specmesh.draft_fallback": stats.draft_fallback, "specmesh.ttft_ms": stats.ttft_ms,
    })
