"""OpenAI-compatible HTTP API (FastAPI) over the same generation path as the gRPC service.

Routes: POST /v1/completions, POST /v1/chat/completions (the target tokenizer's
chat template), GET /v1/models, GET /health. `stream: true` answers with
server-sent events ending in `data: [DONE]`. Errors use OpenAI's shape,
`{"error": {"message", "type", "param", "code"}}` (orchestrator.serving.http_front_door):
400 naming the parameter, 401 without the API key (when one is set; /health stays open),
404 for an unknown model or route, 413 for a body over the size limit, 503/504 when the
target service fails or times out, 503 (code `server_shutting_down`) once the
server drains (specmesh.server.drain; /health turns 503 too); a stream still running when the shutdown
grace ends gets a last `data: {"error": ...}` event, which OpenAI's clients raise. Types are
strict, as OpenAI's are (no "3" for 3), and a parameter this server does not know or implement is a 400 naming it, never ignored.
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
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, AsyncIterator, Sequence

import jinja2
import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from orchestrator.serving.http_connections import ApiKeyFirst, uvicorn_settings
from orchestrator.serving.openai_logprobs import TokenTexts, chat_logprobs, completion_logprobs
from orchestrator.serving.http_front_door import (OpenAIError, add_guarded_docs, api_key_check, docs_settings,
                                                  install_error_handlers, limit_body_size, shutting_down)
from orchestrator.serving.openai_requests import (PARAMETER_NAMES, ChatCompletionRequest, CompletionRequest,
                                                  SamplingFields, completion_prompt, generate_request)
from orchestrator.serving.request_limits import request_size_limit
from orchestrator.serving.finish_reasons import FINISH_REASON_NAMES
from orchestrator.serving.servicer import GenerationServicer
from specmesh.server.connections import ConnectionLimits
from specmesh.server.drain import REFUSED_MESSAGE, Drain
from specmesh.errors import InvalidArgument, ShuttingDown
from specmesh.loading.models import chat_token_ids
from specmesh.server.security import TLSConfig
from specmesh.v1 import common_pb2, generation_pb2


def drain_check(drain: Drain):
    """A route dependency refusing new requests once the server drains."""
    async def check() -> None:
        if drain.draining:
            raise shutting_down(REFUSED_MESSAGE)
    return check


class OpenAIFrontEnd:
    """Turns OpenAI requests into Generate streams and the stream back into OpenAI objects."""

    def __init__(self, servicer: GenerationServicer, drain: Drain):
        self.servicer = servicer
        self.drain = drain  # in-flight requests are tracked on it; cut off when its grace ends
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
            async with self.drain.track():
                first = await anext(stream)
        except InvalidArgument as error:
            raise OpenAIError(400, str(error), PARAMETER_NAMES.get(error.field, error.field)) from error
        return _prepend(first, stream)


async def _prepend(first, rest: AsyncIterator) -> AsyncIterator:
    async with contextlib.aclosing(rest):
        yield first
        async for item in rest:
            yield item


def speculation_stats(stats: generation_pb2.GenerationStats) -> dict[str, Any]:
    return {field.name: getattr(stats, field.name) for field in stats.DESCRIPTOR.fields}


@dataclass
class Rendering:
    """How a request's choices are written: chat or completion, logprobs, echoed prompt."""

    chat: bool
    texts: TokenTexts | None = None  # None: the client did not ask for logprobs
    echo: str = ""  # the prompt's text, put before each choice's text (completions' echo)

    def logprobs(self, entries: Sequence[common_pb2.TokenLogprob], text_offset: int) -> dict[str, Any] | None:
        if self.texts is None:
            return None
        if self.chat:
            return chat_logprobs(self.texts, entries)
        return completion_logprobs(self.texts, entries, text_offset)

    def text_length(self, entries: Sequence[common_pb2.TokenLogprob]) -> int:
        """Characters of these tokens' own texts: how far a completion's text_offset moves."""
        return sum(len(self.texts(entry.token_id)) for entry in entries) if self.texts else 0


def choice(chat: bool, text: str, finish: str | None, delta: bool, first: bool = False, index: int = 0,
           logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    if not chat:
        return {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}
    if not delta:
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                "finish_reason": finish}
    content = {"role": "assistant", "content": text} if first else {"content": text}
    return {"index": index, "delta": content, "logprobs": logprobs, "finish_reason": finish}


def envelope(front: OpenAIFrontEnd, request_id: str, chat: bool, chunk: bool) -> dict[str, Any]:
    kind = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
    return {"id": request_id, "object": kind, "created": int(time.time()), "model": front.model}


def all_usage(lasts: dict[int, generation_pb2.GenerateResponse]) -> dict[str, int]:
    """Usage of all n choices: the prompt once, every choice's completion tokens."""
    prompt_tokens = lasts[0].stats.prompt_tokens
    completion_tokens = sum(last.stats.completion_tokens for last in lasts.values())
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


async def collect(front: OpenAIFrontEnd, stream: AsyncIterator, rendering: Rendering,
                  request_id: str) -> dict[str, Any]:
    texts, entries, lasts = defaultdict(list), defaultdict(list), {}
    async with front.drain.track():
        async for response in stream:
            texts[response.index].append(response.text)
            entries[response.index].extend(response.logprobs)
            if response.finish_reason:
                lasts[response.index] = response
    choices = [choice(rendering.chat, rendering.echo + "".join(texts[index]),
                      FINISH_REASON_NAMES.get(lasts[index].finish_reason), False, index=index,
                      logprobs=rendering.logprobs(entries[index], len(rendering.echo)))
               for index in sorted(lasts)]
    return {**envelope(front, request_id, rendering.chat, chunk=False), "choices": choices,
            "usage": all_usage(lasts), "stats": speculation_stats(lasts[0].stats)}


async def events(front: OpenAIFrontEnd, stream: AsyncIterator, rendering: Rendering, request_id: str,
                 include_usage: bool) -> AsyncIterator[str]:
    """SSE lines; cancelled (and so the generation with it) when the client goes away; an error
    event instead of `[DONE]` when the shutdown grace ends first."""
    text_offsets, lasts = {}, {}  # per choice: where its next token's text starts; its last response
    try:
        async with front.drain.track():
            async for response in stream:
                index, finish = response.index, FINISH_REASON_NAMES.get(response.finish_reason)
                first = index not in text_offsets
                text_offset = text_offsets.setdefault(index, len(rendering.echo))
                if response.text or finish or first or response.logprobs:
                    text = (rendering.echo if first else "") + response.text
                    logprobs = rendering.logprobs(response.logprobs, text_offset)
                    data = {**envelope(front, request_id, rendering.chat, chunk=True),
                            "choices": [choice(rendering.chat, text, finish, True, first, index, logprobs)]}
                    if finish:
                        data["stats"] = speculation_stats(response.stats)
                        lasts[index] = response
                    text_offsets[index] += rendering.text_length(response.logprobs)
                    yield f"data: {json.dumps(data)}\n\n"
    except ShuttingDown as error:
        yield f"data: {json.dumps(shutting_down(str(error)).body())}\n\n"
        return
    if include_usage:  # OpenAI's last chunk: no choices, the usage of all of them
        usage_chunk = {**envelope(front, request_id, rendering.chat, chunk=True), "choices": [],
                       "usage": all_usage(lasts)}
        yield f"data: {json.dumps(usage_chunk)}\n\n"
    yield "data: [DONE]\n\n"


def rendering_for(front: OpenAIFrontEnd, body: SamplingFields, request: generation_pb2.GenerateRequest,
                  chat: bool) -> Rendering:
    texts = TokenTexts(front.servicer.tokenizer) if request.logprobs else None
    if chat or not body.echo:
        return Rendering(chat, texts)
    echo = request.prompt or front.servicer.tokenizer.decode(list(request.prompt_token_ids))
    return Rendering(chat, texts, echo)


async def answer(front: OpenAIFrontEnd, http_request: Request, body: SamplingFields,
                 request: generation_pb2.GenerateRequest, chat: bool):
    stream = await front.open_stream(request)
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    rendering = rendering_for(front, body, request, chat)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(events(front, stream, rendering, request_id, include_usage),
                                 media_type="text/event-stream")
    return JSONResponse(await _unless_disconnected(http_request, collect(front, stream, rendering, request_id)))


async def _unless_disconnected(http_request: Request, work):
    """Run `work`, cancelling it if the client disconnects first (frees the sessions)."""
    task = asyncio.ensure_future(work)
    while not task.done():
        if await http_request.is_disconnected():
            task.cancel()
        await asyncio.wait([task], timeout=0.1)
    return task.result()


def create_app(servicer: GenerationServicer, api_key: str | None = None, drain: Drain | None = None,
               max_body_bytes: int | None = None) -> FastAPI:
    """The app; with `api_key`, every /v1 route and the docs require it. `drain`: the gRPC server's
    (specmesh.server.drain.drain_of), so one SIGTERM drains both fronts; None = one of its own. Bodies over
    `max_body_bytes` (default: request_limits' default for the target's context window) get 413 unread."""
    front = OpenAIFrontEnd(servicer, drain or Drain())
    app = FastAPI(title="specmesh", description="OpenAI-compatible API over speculative decoding",
                  **docs_settings(api_key))
    limit_body_size(app, request_size_limit(servicer.backends.limits.context_window, max_body_bytes))

    @app.get("/health")
    async def health():
        if front.drain.draining:
            return JSONResponse(status_code=503, content={"status": "shutting down"})
        return {"status": "ok"}

    add_openai_routes(app, front, Depends(api_key_check(api_key)), Depends(drain_check(front.drain)))
    add_guarded_docs(app, api_key)
    install_error_handlers(app)
    if api_key:  # added last, so outermost: strangers meet nothing else (the routes' own check stays)
        app.add_middleware(ApiKeyFirst, api_key=api_key)
    return app


def add_openai_routes(app: FastAPI, front: OpenAIFrontEnd, auth, admitted) -> None:
    @app.get("/v1/models", dependencies=[auth])
    async def models():
        return {"object": "list", "data": [{"id": front.model, "object": "model", "created": front.created,
                                            "owned_by": "specmesh"}]}

    @app.post("/v1/completions", dependencies=[auth, admitted])
    async def completions(body: CompletionRequest, http_request: Request):
        front.check_model(body.model)
        return await answer(front, http_request, body, generate_request(body, **completion_prompt(body)), False)

    @app.post("/v1/chat/completions", dependencies=[auth, admitted])
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
                            limits: ConnectionLimits | None = None) -> tuple[_EmbeddedServer, int, asyncio.Task]:
    """Serve `app` on host:port (0 = any free port), HTTPS with `tls`, its connections bounded by `limits`
    (default: ConnectionLimits()); return (server, bound port, serving task)."""
    server = _EmbeddedServer(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off",
                                            **tls_settings(tls), **uvicorn_settings(limits or ConnectionLimits())))
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
