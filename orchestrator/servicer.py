"""The client-facing Generation service: validate, run the loop, stream deltas."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import grpc
from transformers import PreTrainedTokenizerBase

from orchestrator.clients import DraftClient, TargetClient
from orchestrator.detokenizer import IncrementalDetokenizer
from orchestrator.loop import LoopConfig, LoopStats, SpeculativeGeneration
from orchestrator.validation import ModelLimits, validate_request
from specmesh.v1 import generation_pb2, generation_pb2_grpc


@dataclass
class Backends:
    target: TargetClient
    draft: DraftClient | None  # None: target-only serving
    eos_token_ids: set[int]
    limits: ModelLimits


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, tokenizer: PreTrainedTokenizerBase, backends: Backends, config: LoopConfig):
        self.tokenizer = tokenizer
        self.backends = backends
        self.config = config

    def encode(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt) if prompt else []

    async def Generate(self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        checked = validate_request(request, self.encode, self.backends.limits, context.time_remaining())
        generation = SpeculativeGeneration(checked, self.backends.target, self.backends.draft,
                                           self.backends.eos_token_ids, self.config)
        detokenizer = IncrementalDetokenizer(self.tokenizer, checked.prompt_token_ids, checked.stop)
        first_token_at = None
        completion_tokens = 0
        async with contextlib.aclosing(generation.tokens()) as batches:
            async for batch in batches:
                first_token_at = first_token_at or time.monotonic()
                text, consumed = detokenizer.add(batch)
                batch = batch[:consumed]
                completion_tokens += len(batch)
                finish = self._finish_reason(generation, detokenizer, batch)
                response = generation_pb2.GenerateResponse(request_id=checked.request_id, token_ids=batch)
                if finish:
                    response.text = text + detokenizer.finish()
                    response.finish_reason = finish
                    response.stats.CopyFrom(_stats(generation.stats, first_token_at, completion_tokens,
                                                   len(checked.prompt_token_ids)))
                    yield response
                    return
                response.text = text
                yield response

    def _finish_reason(self, generation: SpeculativeGeneration, detokenizer: IncrementalDetokenizer,
                       batch: list[int]) -> int:
        if detokenizer.stopped or any(t in self.backends.eos_token_ids for t in batch):
            return generation_pb2.FINISH_REASON_STOP
        if generation.generated >= generation.request.max_tokens:
            return generation_pb2.FINISH_REASON_LENGTH
        return generation_pb2.FINISH_REASON_UNSPECIFIED


def _stats(stats: LoopStats, first_token_at: float, completion_tokens: int,
           prompt_tokens: int) -> generation_pb2.GenerationStats:
    now = time.monotonic()
    ttft_ms = (first_token_at - stats.started) * 1e3
    e2e_ms = (now - stats.started) * 1e3
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
    )
