"""Turn a client's GenerateRequest into a checked GenerationRequest.

Every rule names the field it is about, so the client gets INVALID_ARGUMENT
with a google.rpc BadRequest pointing at that field.
"""

from __future__ import annotations

import math
import re
import time
import uuid
from dataclasses import dataclass, replace
from typing import Callable

from google.protobuf.unknown_fields import UnknownFieldSet

from orchestrator.decoding.request import GenerationRequest
from specmesh.errors import InvalidArgument
from specmesh.roles import MAX_DRAFT_TOKENS
from specmesh.engine.sampling_params import SamplingParams
from specmesh.v1 import generation_pb2

DEFAULT_MAX_TOKENS = 256
MAX_REQUEST_ID_LENGTH = 128
MAX_USER_LENGTH = 256
MAX_CHOICES = 16
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS_ENTRIES = 1024
PROMPT_CLASS = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # a metrics label: bounded, no free text


@dataclass(frozen=True)
class ModelLimits:
    vocab_size: int  # valid token ids are [0, vocab_size)
    context_window: int
    default_num_speculative_tokens: int


def validate_request(request: generation_pb2.GenerateRequest, encode: Callable[[str], list[int]],
                     limits: ModelLimits, time_remaining: float | None = None) -> GenerationRequest:
    _known_fields_only(request)
    prompt_ids = _prompt_token_ids(request, encode, limits)
    k = _num_speculative_tokens(request, limits)
    return GenerationRequest(
        request_id=_request_id(request),
        prompt_class=_prompt_class(request),
        user=_user(request),
        prompt_token_ids=prompt_ids,
        max_tokens=_max_tokens(request, len(prompt_ids), limits),
        sampling=_sampling(request, len(prompt_ids), limits),
        stop=_stop(request),
        num_speculative_tokens=k,
        fixed_k=request.HasField("num_speculative_tokens") and request.num_speculative_tokens > 0,
        deadline=None if time_remaining is None else time.monotonic() + time_remaining,
    )


def _request_id(request: generation_pb2.GenerateRequest) -> str:
    if len(request.request_id) > MAX_REQUEST_ID_LENGTH:
        raise InvalidArgument("request_id", f"at most {MAX_REQUEST_ID_LENGTH} characters")
    return request.request_id or uuid.uuid4().hex


def _prompt_class(request: generation_pb2.GenerateRequest) -> str:
    if request.prompt_class and not PROMPT_CLASS.fullmatch(request.prompt_class):
        raise InvalidArgument("prompt_class", "1-64 characters from [A-Za-z0-9_.-]")
    return request.prompt_class


def _prompt_token_ids(request: generation_pb2.GenerateRequest, encode: Callable[[str], list[int]],
                      limits: ModelLimits) -> list[int]:
    if request.prompt and request.prompt_token_ids:
        raise InvalidArgument("prompt", "set prompt or prompt_token_ids, not both")
    token_ids = list(request.prompt_token_ids) if request.prompt_token_ids else encode(request.prompt)
    if not token_ids:
        raise InvalidArgument("prompt", "must not be empty")
    bad = [t for t in token_ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise InvalidArgument("prompt_token_ids", f"token id {bad[0]} outside [0, {limits.vocab_size})")
    if len(token_ids) >= limits.context_window:
        raise InvalidArgument("prompt", f"{len(token_ids)} tokens leave no room in the "
                              f"{limits.context_window}-token context window")
    return token_ids


def _max_tokens(request: generation_pb2.GenerateRequest, prompt_length: int, limits: ModelLimits) -> int:
    room = limits.context_window - prompt_length
    if not request.HasField("max_tokens"):
        return min(DEFAULT_MAX_TOKENS, room)
    if request.max_tokens <= 0:
        raise InvalidArgument("max_tokens", "must be at least 1")
    if request.max_tokens > room:
        raise InvalidArgument("max_tokens", f"prompt ({prompt_length} tokens) + max_tokens "
                              f"({request.max_tokens}) exceeds the {limits.context_window}-token context window")
    return request.max_tokens


def choice_count(request: generation_pb2.GenerateRequest) -> int:
    """How many independent completions the request asks for (its n)."""
    n = request.n if request.HasField("n") else 1
    if not 1 <= n <= MAX_CHOICES:
        raise InvalidArgument("n", f"must be in [1, {MAX_CHOICES}]")
    return n


def for_choice(checked: GenerationRequest, index: int) -> GenerationRequest:
    """Completion `index` of n: a seeded request's seed becomes seed + index (mod 2**64)."""
    seed = checked.sampling.seed
    if index == 0 or seed is None:
        return checked
    return replace(checked, sampling=replace(checked.sampling, seed=(seed + index) % 2**64))


def _user(request: generation_pb2.GenerateRequest) -> str:
    if len(request.user) > MAX_USER_LENGTH:
        raise InvalidArgument("user", f"at most {MAX_USER_LENGTH} characters")
    return request.user


def _sampling(request: generation_pb2.GenerateRequest, prompt_length: int, limits: ModelLimits) -> SamplingParams:
    temperature = request.temperature if request.HasField("temperature") else 1.0
    if not math.isfinite(temperature) or temperature < 0:
        raise InvalidArgument("temperature", "must be a finite number >= 0")
    top_p = request.top_p if request.HasField("top_p") else 1.0
    if not (math.isfinite(top_p) and 0 < top_p <= 1):
        raise InvalidArgument("top_p", "must be in (0, 1]")
    top_k = request.top_k if request.HasField("top_k") else 0
    if top_k < 0:
        raise InvalidArgument("top_k", "must be >= 0 (0 disables top-k)")
    seed = request.seed if request.HasField("seed") else None
    return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                          presence_penalty=_bounded(request, "presence_penalty", -2.0, 2.0, 0.0),
                          frequency_penalty=_bounded(request, "frequency_penalty", -2.0, 2.0, 0.0),
                          repetition_penalty=_repetition_penalty(request),
                          logit_bias=_logit_bias(request, limits), output_start=prompt_length,
                          logprobs=_logprobs(request))


def _bounded(request: generation_pb2.GenerateRequest, field: str, low: float, high: float, default: float) -> float:
    value = getattr(request, field) if request.HasField(field) else default
    if not (math.isfinite(value) and low <= value <= high):
        raise InvalidArgument(field, f"must be in [{low:g}, {high:g}]")
    return value


def _repetition_penalty(request: generation_pb2.GenerateRequest) -> float:
    penalty = request.repetition_penalty if request.HasField("repetition_penalty") else 1.0
    if not (math.isfinite(penalty) and 0 < penalty <= 10):
        raise InvalidArgument("repetition_penalty", "must be in (0, 10] (1 disables it)")
    return penalty


def _logit_bias(request: generation_pb2.GenerateRequest, limits: ModelLimits) -> tuple[tuple[int, float], ...]:
    if len(request.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidArgument("logit_bias", f"at most {MAX_LOGIT_BIAS_ENTRIES} entries")
    for token_id, bias in request.logit_bias.items():
        if not 0 <= token_id < limits.vocab_size:
            raise InvalidArgument("logit_bias", f"token id {token_id} outside [0, {limits.vocab_size})")
        if not (math.isfinite(bias) and -100 <= bias <= 100):
            raise InvalidArgument("logit_bias", f"bias of token {token_id} must be in [-100, 100]")
    return tuple(sorted(request.logit_bias.items()))


def _logprobs(request: generation_pb2.GenerateRequest) -> int | None:
    """None: no logprobs; else how many alternatives to return with each token."""
    top = request.top_logprobs if request.HasField("top_logprobs") else 0
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise InvalidArgument("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}]")
    if top and not request.logprobs:
        raise InvalidArgument("top_logprobs", "needs logprobs")
    return top if request.logprobs else None


def _num_speculative_tokens(request: generation_pb2.GenerateRequest, limits: ModelLimits) -> int:
    if request.HasField("speculation") and not request.speculation:
        return 0
    k = request.num_speculative_tokens if request.HasField("num_speculative_tokens") else 0
    if not 0 <= k <= MAX_DRAFT_TOKENS:
        raise InvalidArgument("num_speculative_tokens", f"must be in [0, {MAX_DRAFT_TOKENS}]")
    return k or limits.default_num_speculative_tokens


def _stop(request: generation_pb2.GenerateRequest) -> list[str]:
    if any(not s for s in request.stop):
        raise InvalidArgument("stop", "stop strings must not be empty")
    return list(request.stop)


def _known_fields_only(request: generation_pb2.GenerateRequest) -> None:
    """A field this server does not know (a client built from a newer proto) is refused, not ignored:
    ignoring it would answer as if the client had not asked for it."""
    unknown = sorted({field.field_number for field in UnknownFieldSet(request)})
    if unknown:
        raise InvalidArgument("", f"unknown field number {unknown[0]} in {request.DESCRIPTOR.full_name}: "
                              "this server does not implement it")
