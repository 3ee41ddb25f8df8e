"""OpenAI-compatible HTTP API (FastAPI) over the same generation path as the gRPC service.

Routes: POST /v1/completions, POST /v1/chat/completions (the target tokenizer's
chat template), GET /v1/models, GET /health. `stream: true` answers with
server-sent events ending in `data: [DONE]`. Errors use OpenAI's shape,
`{"error": {"message", "type", "param", "code"}}` (orchestrator.frontend.http_front_door):
400 naming the parameter, 401 without the API key (when one is set; /health stays open),
404 for an unknown model or route, 413 for a body over the size limit, 503/504 when the
target service fails or times out. Types are strict, as OpenAI's are (no "3" for 3), and a
parameter this server does not know or implement is a 400 naming it, never ignored.
Responses carry `usage` and, as an extra field, the speculation `stats`. A client
that disconnects cancels its generation, which frees both services' sessions.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import time
import uuid
from typing import Annotated, Any, AsyncIterator, Literal

import jinja2
import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from pydantic_core import PydanticCustomError

from orchestrator.frontend.http_front_door import (OpenAIError, add_guarded_docs, api_key_check, docs_settings,
                                                   install_error_handlers, limit_body_size)
from orchestrator.frontend.request_limits import request_size_limit
from orchestrator.frontend.servicer import FINISH_REASON_NAMES, GenerationServicer
from specmesh.errors import InvalidArgument
from specmesh.models import chat_token_ids
from specmesh.security import TLSConfig
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
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Parameters shared by both endpoints."""

    model_config = STRICT
    model: Text | None = None
    max_tokens: Int32 | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: Int32 = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Text | list[Text] | None = None
    seed: UInt64 | None = None
    # specmesh extensions
    top_k: Int32 | None = None
    num_speculative_tokens: Int32 | None = None
    speculation: bool | None = None
    prompt_class: Text | None = None


class CompletionRequest(SamplingFields):
    prompt: Text | list[Int32] | list[Text]
    max_tokens: Int32 | None = 16  # OpenAI's default for completions


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


def generate_request(body: SamplingFields, **prompt: Any) -> generation_pb2.GenerateRequest:
    """The gRPC request for an OpenAI body; validation happens once, in the shared path."""
    if body.n != 1:
        raise OpenAIError(400, "only n=1 is supported", "n")
    request = generation_pb2.GenerateRequest(stop=[body.stop] if isinstance(body.stop, str) else body.stop or [],
                                             prompt_class=body.prompt_class or "", **prompt)
    max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens
    for field, value in (("max_tokens", max_tokens), ("temperature", body.temperature), ("top_p", body.top_p),
                         ("top_k", body.top_k), ("seed", body.seed), ("speculation", body.speculation),
                         ("num_speculative_tokens", body.num_speculative_tokens)):
        if value is not None:
            setattr(request, field, value)
    return request


def completion_prompt(body: CompletionRequest) -> dict[str, Any]:
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
        return {"prompt_token_ids": prompt}
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise OpenAIError(400, "exactly one prompt per request is supported", "prompt")
        prompt = prompt[0]
    return {"prompt": prompt}


class OpenAIFrontEnd:
    """Turns OpenAI requests into Generate streams and the stream back into OpenAI objects."""

    def __init__(self, servicer: GenerationServicer):
        self.servicer = servicer
        self.model = servicer.backends.model
        self.created = int(time.time())

    def check_model(self, model: str | None) -> None:
        if model and model != self.model:
            raise OpenAIError(404, f"The model `{model}` does not exist; this server serves `{self.model}`",
                              "model", "model_not_found")

    async def chat_prompt(self, body: ChatCompletionRequest) -> dict[str, Any]:
        """The chat template's prompt ids, rendered and tokenized off the event loop."""
        tokenizer = self.servicer.tokenizer
        if not body.messages:
            raise OpenAIError(400, "messages: must not be empty", "messages")
        if not getattr(tokenizer, "chat_template", None):
            raise OpenAIError(400, f"model `{self.model}` has no chat template; use /v1/completions", "messages")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            return {"prompt_token_ids": await asyncio.to_thread(chat_token_ids, tokenizer, messages)}
        except jinja2.TemplateError as error:  # the template's own raise_exception, e.g. on the roles' order
            raise OpenAIError(400, f"messages: {error}", "messages") from error

    async def open_stream(self, request: generation_pb2.GenerateRequest) -> AsyncIterator:
        """Start generating; bad parameters raise here, before any byte is sent."""
        stream = self.servicer.generate(request)
        try:
            first = await anext(stream)
        except InvalidArgument as error:
            raise OpenAIError(400, str(error), PARAMETER_NAMES.get(error.field, error.field)) from error
        return _prepend(first, stream)


async def _prepend(first, rest: AsyncIterator) -> AsyncIterator:
    async with contextlib.aclosing(rest):
        yield first
        async for item in rest:
            yield item


def usage(stats: generation_pb2.GenerationStats) -> dict[str, int]:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.completion_tokens,
            "total_tokens": stats.prompt_tokens + stats.completion_tokens}


def speculation_stats(stats: generation_pb2.GenerationStats) -> dict[str, Any]:
    return {field.name: getattr(stats, field.name) for field in stats.DESCRIPTOR.fields}


def choice(chat: bool, text: str, finish: str | None, delta: bool, first: bool = False) -> dict[str, Any]:
    if not chat:
        return {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
    if not delta:
        return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
    content = {"role": "assistant", "content": text} if first else {"content": text}
    return {"index": 0, "delta": content, "finish_reason": finish}


def envelope(front: OpenAIFrontEnd, request_id: str, chat: bool, chunk: bool) -> dict[str, Any]:
    kind = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
    return {"id": request_id, "object": kind, "created": int(time.time()), "model": front.model}


async def collect(front: OpenAIFrontEnd, stream: AsyncIterator, chat: bool, request_id: str) -> dict[str, Any]:
    text, last = [], None
    async for response in stream:
        text.append(response.text)
        last = response
    finish = FINISH_REASON_NAMES.get(last.finish_reason)
    return {**envelope(front, request_id, chat, chunk=False), "choices": [choice(chat, "".join(text), finish, False)],
            "usage": usage(last.stats), "stats": speculation_stats(last.stats)}


async def events(front: OpenAIFrontEnd, stream: AsyncIterator, chat: bool, request_id: str,
                 include_usage: bool) -> AsyncIterator[str]:
    """SSE lines; cancelled (and so the generation with it) when the client goes away."""
    first = True
    async for response in stream:
        finish = FINISH_REASON_NAMES.get(response.finish_reason)
        if response.text or finish or first:
            data = {**envelope(front, request_id, chat, chunk=True),
                    "choices": [choice(chat, response.text, finish, True, first)]}
            if finish:
                data["stats"] = speculation_stats(response.stats)
                if include_usage:
                    data["usage"] = usage(response.stats)
            yield f"data: {json.dumps(data)}\n\n"
            first = False
    yield "data: [DONE]\n\n"


async def answer(front: OpenAIFrontEnd, http_request: Request, body: SamplingFields,
                 request: generation_pb2.GenerateRequest, chat: bool):
    stream = await front.open_stream(request)
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(events(front, stream, chat, request_id, include_usage),
                                 media_type="text/event-stream")
    return JSONResponse(await _unless_disconnected(http_request, collect(front, stream, chat, request_id)))


async def _unless_disconnected(http_request: Request, work):
    """Run `work`, cancelling it if the client disconnects first (frees the sessions)."""
    task = asyncio.ensure_future(work)
    while not task.done():
        if await http_request.is_disconnected():
            task.cancel()
        await asyncio.wait([task], timeout=0.1)
    return task.result()


def create_app(servicer: GenerationServicer, api_key: str | None = None,
               max_body_bytes: int | None = None) -> FastAPI:
    """The app; with `api_key`, every /v1 route and the docs require it. Bodies over `max_body_bytes`
    (default: request_limits' default for the target's context window) get 413 unread."""
    front = OpenAIFrontEnd(servicer)
    app = FastAPI(title="specmesh", description="OpenAI-compatible API over speculative decoding",
                  **docs_settings(api_key))
    limit_body_size(app, request_size_limit(servicer.backends.limits.context_window, max_body_bytes))

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    add_openai_routes(app, front, Depends(api_key_check(api_key)))
    add_guarded_docs(app, api_key)
    install_error_handlers(app)
    return app


def add_openai_routes(app: FastAPI, front: OpenAIFrontEnd, auth) -> None:
    @app.get("/v1/models", dependencies=[auth])
    async def models():
        return {"object": "list", "data": [{"id": front.model, "object": "model", "created": front.created,
                                            "owned_by": "specmesh"}]}

    @app.post("/v1/completions", dependencies=[auth])
    async def completions(body: CompletionRequest, http_request: Request):
        front.check_model(body.model)
        return await answer(front, http_request, body, generate_request(body, **completion_prompt(body)), False)

    @app.post("/v1/chat/completions", dependencies=[auth])
    async def chat_completions(body: ChatCompletionRequest, http_request: Request):
        front.check_model(body.model)
        return await answer(front, http_request, body, generate_request(body, **await front.chat_prompt(body)), True)


class _EmbeddedServer(uvicorn.Server):
    """uvicorn inside our event loop: the process's own signal handling stays in charge."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def tls_settings(tls: TLSConfig | None) -> dict[str, Any]:
    """uvicorn's HTTPS settings from the gRPC server's TLS files (a client CA = client certificates required)."""
    if tls is None:
        return {}
    settings: dict[str, Any] = {"ssl_certfile": tls.cert_file, "ssl_keyfile": tls.key_file}
    if tls.ca_file:
        settings.update(ssl_ca_certs=tls.ca_file, ssl_cert_reqs=ssl.CERT_REQUIRED)
    return settings


async def start_http_server(app: FastAPI, host: str, port: int, tls: TLSConfig | None = None,
                            ) -> tuple[_EmbeddedServer, int, asyncio.Task]:
    """Serve `app` on host:port (0 = any free port), HTTPS with `tls`; return (server, bound port, serving task)."""
    server = _EmbeddedServer(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off",
                                            **tls_settings(tls)))
    task = asyncio.ensure_future(server.serve())
    while not server.started:
        if task.done():
            task.result()  # raises the start-up error
            raise RuntimeError("HTTP server stopped during start-up")
        await asyncio.sleep(0.02)
    return server, server.servers[0].sockets[0].getsockname()[1], task


async def stop_http_server(server: _EmbeddedServer, task: asyncio.Task) -> None:
    server.should_exit = True
    await task
