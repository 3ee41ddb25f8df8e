"""The OpenAI request bodies (strict pydantic models, as OpenAI's own API is strict) and their
mapping onto a specmesh.v1 GenerateRequest: unknown parameters are a 400 naming them, and the
OpenAI parameters this server does not implement are refused by name (UNIMPLEMENTED)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from pydantic_core import PydanticCustomError

from orchestrator.serving.http_front_door import OpenAIError
from specmesh.v1 import generation_pb2

PARAMETER_NAMES = {"prompt_token_ids": "prompt"}  # our field -> the OpenAI parameter a client sent


def _valid_unicode(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:  # JSON's "\ud800" decodes to a lone surrogate: no text at all
        raise PydanticCustomError("invalid_unicode", "not valid Unicode (a lone surrogate at character {at})",
                                  {"at": error.start}) from None
    return text


# The request models' field types: strict (OpenAI does not coerce "3" to 3), every string valid
# Unicode, every integer within its gRPC field's range, so a body that validates always becomes a
# GenerateRequest. New fields use these types.
Text = Annotated[str, AfterValidator(_valid_unicode)]
Int32 = Annotated[int, Field(ge=-2**31, le=2**31 - 1)]
UInt64 = Annotated[int, Field(ge=0, le=2**64 - 1)]
STRICT = ConfigDict(extra="forbid", strict=True)  # unknown or unimplemented parameters: 400 naming them


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False  # a last chunk with empty choices carries the usage


class SamplingFields(BaseModel):
    """Parameters shared by both endpoints."""

    model_config = STRICT
    model: Text | None = None
    max_tokens: Int32 | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: Int32 | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Text | list[Text] | None = None
    seed: UInt64 | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[Text, float] | None = None  # token id (as a string) -> bias
    user: Text | None = None
    # specmesh extensions
    top_k: Int32 | None = None
    repetition_penalty: float | None = None
    num_speculative_tokens: Int32 | None = None
    speculation: bool | None = None
    prompt_class: Text | None = None


class CompletionRequest(SamplingFields):
    prompt: Text | list[Int32] | list[Text]
    max_tokens: Int32 | None = 16  # OpenAI's default for completions
    echo: bool = False
    logprobs: Int32 | None = None  # 0-5: each token's logprob and this many alternatives
    # Not implemented: refused by name unless given a value that changes nothing (UNIMPLEMENTED).
    best_of: Int32 | None = None
    suffix: Text | None = None


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Text | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: Int32 | None = None
    logprobs: bool = False
    top_logprobs: Int32 | None = None
    # Not implemented: refused by name unless given a value that changes nothing (UNIMPLEMENTED).
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    store: Any = None


# OpenAI parameter -> whether a value changes nothing here; any other value is a 400 naming it.
UNIMPLEMENTED = {
    "best_of": lambda value, body: value is None or value == (body.n or 1),  # best of n among n: all n
    "suffix": lambda value, body: not value,
    "tools": lambda value, body: not value,
    "functions": lambda value, body: not value,
    "tool_choice": lambda value, body: value in (None, "none"),
    "function_call": lambda value, body: value in (None, "none"),
    "parallel_tool_calls": lambda value, body: not body.tools,
    "response_format": lambda value, body: value is None or (isinstance(value, dict)
                                                             and value.get("type") == "text"),
    "modalities": lambda value, body: value in (None, ["text"]),
    "audio": lambda value, body: value is None,
    "prediction": lambda value, body: value is None,
    "web_search_options": lambda value, body: value is None,
    "reasoning_effort": lambda value, body: value is None,
    "store": lambda value, body: not value,  # nothing is stored for later retrieval
}
MAX_COMPLETION_LOGPROBS = 5  # the legacy completions API's limit


def generate_request(body: SamplingFields, **prompt: Any) -> generation_pb2.GenerateRequest:
    """The gRPC request for an OpenAI body; validation happens once, in the shared path."""
    refuse_unimplemented(body)
    request = generation_pb2.GenerateRequest(stop=[body.stop] if isinstance(body.stop, str) else body.stop or [],
                                             prompt_class=body.prompt_class or "", **prompt)
    max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens
    for field, value in (("max_tokens", max_tokens), ("temperature", body.temperature), ("top_p", body.top_p),
                         ("top_k", body.top_k), ("seed", body.seed), ("speculation", body.speculation),
                         ("num_speculative_tokens", body.num_speculative_tokens)):
        if value is not None:
            setattr(request, field, value)
    map_openai_parameters(body, request)
    return request


def refuse_unimplemented(body: SamplingFields) -> None:
    for param, changes_nothing in UNIMPLEMENTED.items():
        if param in body.model_fields_set and not changes_nothing(getattr(body, param), body):
            raise OpenAIError(400, f"{param}: not supported by this server", param, "unsupported_parameter")


def map_openai_parameters(body: SamplingFields, request: generation_pb2.GenerateRequest) -> None:
    """n, penalties, logit_bias, user and logprobs onto the gRPC request (checked in the shared path)."""
    for field in ("n", "presence_penalty", "frequency_penalty", "repetition_penalty", "user"):
        if getattr(body, field) is not None:
            _set(request, field, getattr(body, field))
    for token_id, bias in (body.logit_bias or {}).items():
        if not (token_id.isascii() and token_id.isdigit()) or int(token_id) >= 2**31:
            raise OpenAIError(400, f"logit_bias: {token_id!r} is not a token id", "logit_bias")
        request.logit_bias[int(token_id)] = bias
    if isinstance(body, ChatCompletionRequest):
        request.logprobs = body.logprobs
        if body.top_logprobs is not None:
            _set(request, "top_logprobs", body.top_logprobs)
    elif body.logprobs is not None:
        if not 0 <= body.logprobs <= MAX_COMPLETION_LOGPROBS:
            raise OpenAIError(400, f"logprobs: must be in [0, {MAX_COMPLETION_LOGPROBS}]", "logprobs")
        if body.echo:
            raise OpenAIError(400, "echo: not supported together with logprobs (no prompt logprobs)", "echo")
        request.logprobs, request.top_logprobs = True, body.logprobs


def _set(request: generation_pb2.GenerateRequest, field: str, value: Any) -> None:
    """Set a field; a value its wire type cannot hold is a 400 naming it."""
    try:
        setattr(request, field, value)
    except (ValueError, TypeError) as error:
        raise OpenAIError(400, f"{field}: {value!r} is out of range", field) from error


def completion_prompt(body: CompletionRequest) -> dict[str, Any]:
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
        return {"prompt_token_ids": prompt}
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise OpenAIError(400, "exactly one prompt per request is supported", "prompt")
        prompt = prompt[0]
    return {"prompt": prompt}
