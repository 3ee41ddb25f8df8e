"""What every HTTP request meets around the routes: the body size limit, the API key, the docs
behind it, and OpenAI-shaped errors for every failure.

Every error is `{"error": {"message", "type", "param", "code"}}`, whatever raised it: our
own checks (OpenAIError), a body that is not valid JSON or does not fit the request model
(400 naming the parameter; `param` is null for a JSON syntax error), an unknown route (404),
a wrong method (405), a body over the size limit (413, before it is read), the services
upstream (503/504/429), and as a last resort anything unexpected (500, logged).
"""

from __future__ import annotations

import logging
import re
from typing import Any, Sequence

import grpc
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from orchestrator.serving.clients import UpstreamError
from specmesh.errors import ShuttingDown
from specmesh.server.security import AUTHORIZATION, UNAUTHENTICATED_MESSAGE, authorized

log = logging.getLogger(__name__)
UPSTREAM_STATUS = {grpc.StatusCode.DEADLINE_EXCEEDED: 504, grpc.StatusCode.INVALID_ARGUMENT: 400,
                   grpc.StatusCode.RESOURCE_EXHAUSTED: 429}
_FIELD_NAME = re.compile(r"[a-z_][a-z0-9_]*")
_TYPE_TAGS = {"str", "int", "float", "bool", "none", "list", "dict"}  # pydantic's names for union members


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(status_code=self.status, headers=headers, content=self.body())


class BodyTooLarge(HTTPException):
    def __init__(self):
        super().__init__(413)


class BodySizeLimit:
    """ASGI middleware: 413 for a body over `max_bytes`, before it is read when Content-Length says so,
    else as soon as a streamed body passes the limit. (Starlette's RequestBodyLimitMiddleware, which
    FastAPI's max_body_size installs, answers the first case in plain text, not OpenAI's shape.)"""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            return await too_large(self.max_bytes).response()(scope, receive, send)
        received = 0

        async def receive_within_limit():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge()  # FastAPI passes an HTTPException through; our handler shapes it
            return message
        await self.app(scope, receive_within_limit, send)


def too_large(max_bytes: int) -> OpenAIError:
    return OpenAIError(413, f"the request body is larger than this server's limit of {max_bytes} bytes "
                       "(set with --max-request-bytes)", code="request_too_large")


def limit_body_size(app: FastAPI, max_bytes: int) -> None:
    app.state.max_request_bytes = max_bytes
    app.add_middleware(BodySizeLimit, max_bytes=max_bytes)


def api_key_check(api_key: str | None):
    """A route dependency refusing requests without `Authorization: Bearer <api_key>` (None: open)."""
    async def check(request: Request) -> None:
        if api_key and not authorized(request.headers.get(AUTHORIZATION), api_key):
            raise OpenAIError(401, UNAUTHENTICATED_MESSAGE, code="invalid_api_key")
    return check


def docs_settings(api_key: str | None) -> dict[str, Any]:
    """FastAPI's own docs routes, open; none when a key guards the API (`add_guarded_docs` adds them)."""
    return {"docs_url": None, "redoc_url": None, "openapi_url": None} if api_key else {}


def add_guarded_docs(app: FastAPI, api_key: str | None) -> None:
    """/openapi.json, /docs and /redoc behind the API key (when one is set)."""
    if not api_key:
        return
    auth = [Depends(api_key_check(api_key))]

    @app.get("/openapi.json", dependencies=auth, include_in_schema=False)
    async def openapi():
        return JSONResponse(app.openapi())

    @app.get("/docs", dependencies=auth, include_in_schema=False)
    async def swagger():
        return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{app.title} - docs")

    @app.get("/redoc", dependencies=auth, include_in_schema=False)
    async def redoc():
        return get_redoc_html(openapi_url="/openapi.json", title=f"{app.title} - docs")


def parameter_path(location: Sequence[Any]) -> str | None:
    """OpenAI's name for where a validation error is: ("body", "messages", 0, "content") -> messages.[0].content.

    Pydantic's names for union members ("str", "list[int]", "ChatMessage") end the path.
    """
    parts: list[str] = []
    for part in location[1:] if location and location[0] == "body" else location:
        if isinstance(part, int):
            parts.append(f"[{part}]")
        elif isinstance(part, str) and _FIELD_NAME.fullmatch(part) and part not in _TYPE_TAGS:
            parts.append(part)
        else:
            break
    return ".".join(parts) or None


def validation_error(error: RequestValidationError) -> OpenAIError:
    # The deepest error: for a value no member of a union accepts, the member that got furthest.
    first = max(error.errors(), key=lambda e: len(e.get("loc", ())), default={})
    if first.get("type") == "json_invalid":
        position = first.get("loc", ("body", "?"))[-1]
        detail = (first.get("ctx") or {}).get("error", "invalid JSON")
        return OpenAIError(400, f"the body is not valid JSON: {detail} (at character {position})")
    location = first.get("loc", ())
    param = parameter_path(location)
    if first.get("type") == "extra_forbidden":  # its name is the client's, whatever it looks like
        param = ".".join(filter(None, (parameter_path(location[:-1]), str(location[-1])))) or None
        message = "unknown parameter, or one this server does not implement"
    else:
        message = first.get("msg", "invalid")  # never the input itself: it may be megabytes long
    return OpenAIError(400, f"{param or 'body'}: {message}", param)


def http_error(request: Request, error: HTTPException) -> OpenAIError:
    if error.status_code == 404:
        return OpenAIError(404, f"Invalid URL ({request.method} {request.url.path})", code="not_found")
    if error.status_code == 405:
        return OpenAIError(405, f"Method {request.method} is not allowed for {request.url.path}",
                           code="method_not_allowed")
    if error.status_code == 413:
        return too_large(request.app.state.max_request_bytes)
    return OpenAIError(error.status_code, str(error.detail))


def shutting_down(message: str) -> OpenAIError:
    """503 once the server drains (specmesh.server.drain)."""
    return OpenAIError(503, message, code="server_shutting_down", kind="server_error")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, error: OpenAIError):
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, error: RequestValidationError):
        return validation_error(error).response()

    @app.exception_handler(HTTPException)
    async def starlette_error(request: Request, error: HTTPException):
        return http_error(request, error).response()

    @app.exception_handler(ShuttingDown)
    async def shutdown_error(request: Request, error: ShuttingDown):
        return shutting_down(str(error)).response()

    @app.exception_handler(UpstreamError)
    async def upstream_error(request: Request, error: UpstreamError):
        return OpenAIError(UPSTREAM_STATUS.get(error.code, 503), str(error), kind="server_error").response()

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception):
        log.error("unexpected error answering %s %s", request.method, request.url.path, exc_info=error)
        return OpenAIError(500, f"internal error: {type(error).__name__}", kind="server_error").response()
