"""An orchestrator's two front doors (gRPC and HTTP) over one servicer, and checks of what they answer."""

from __future__ import annotations

from dataclasses import dataclass

import grpc
import httpx
import pytest
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from benchmarks.tiny_models import TINY_PROMPTS
from harness import WORK_TIMEOUT_S, Stack, load, start_stack
from orchestrator.control.build import OrchestratorOptions
from orchestrator.serving.clients import open_channel
from orchestrator.serving.http_api import create_app, start_http_server, stop_http_server
from orchestrator.control.build import create_servicer
from orchestrator.serving.server import serve_grpc
from orchestrator.serving.servicer import GenerationServicer
from specmesh.server.security import bearer_metadata
from specmesh.v1 import generation_pb2, generation_pb2_grpc

OPENAI_ERROR_KEYS = {"message", "type", "param", "code"}
GENERATE = "/specmesh.v1.Generation/Generate"


@dataclass
class FrontDoor:
    servicer: GenerationServicer
    channel: grpc.aio.Channel
    http: httpx.AsyncClient
    api_key: str | None
    _servers: tuple

    @property
    def stub(self) -> generation_pb2_grpc.GenerationStub:
        return generation_pb2_grpc.GenerationStub(self.channel)

    def raw_generate(self, data: bytes, timeout: float = 60):
        """A Generate call whose request is `data` as it is, valid message or not."""
        call = self.channel.unary_stream(GENERATE, request_serializer=lambda raw: raw,
                                         response_deserializer=generation_pb2.GenerateResponse.FromString)
        return call(data, timeout=timeout, metadata=bearer_metadata(self.api_key))

    async def generate(self, request: generation_pb2.GenerateRequest, timeout: float = 60) -> tuple[list[int], int]:
        token_ids, finish = [], 0
        async for response in self.stub.Generate(request, timeout=timeout, metadata=bearer_metadata(self.api_key)):
            token_ids.extend(response.token_ids)
            finish = response.finish_reason or finish
        return token_ids, finish

    async def close(self) -> None:
        grpc_server, http_server, http_task = self._servers
        await self.http.aclose()
        await self.channel.close()
        await stop_http_server(http_server, http_task)
        await grpc_server.stop(None)


async def open_front_door(stack: Stack, target_dir, device: str = "cpu", api_key: str | None = None,
                          max_request_bytes: int | None = None) -> FrontDoor:
    _, tokenizer = load(str(target_dir), device)
    draft = f"127.0.0.1:{stack.draft_port}" if stack.draft_port else None
    servicer = await create_servicer(tokenizer, OrchestratorOptions(f"127.0.0.1:{stack.target_port}", draft))
    grpc_server, port, _ = await serve_grpc(servicer, api_key=api_key, max_request_bytes=max_request_bytes)
    http_server, http_port, http_task = await start_http_server(create_app(servicer, api_key, max_body_bytes=max_request_bytes),
                                                                "127.0.0.1", 0)
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{http_port}", headers=headers, timeout=60)
    return FrontDoor(servicer, open_channel(f"127.0.0.1:{port}"), http, api_key, (grpc_server, http_server, http_task))


def assert_openai_error(response: httpx.Response, status: int | None = None, param: str | None = "any") -> dict:
    """The body is OpenAI's error shape (and the status and param those given); returns the error."""
    assert status is None or response.status_code == status, (response.status_code, response.text)
    assert response.headers["content-type"].startswith("application/json"), response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == OPENAI_ERROR_KEYS, body
    error = body["error"]
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
    assert error["param"] is None or isinstance(error["param"], str)
    assert param == "any" or error["param"] == param, error
    return error


def bad_request_fields(error: grpc.aio.AioRpcError) -> list[str] | None:
    """The fields a google.rpc BadRequest in the status names; None when there is none."""
    status = rpc_status.from_call(error)
    for detail in status.details if status else ():
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad_request = error_details_pb2.BadRequest()
            detail.Unpack(bad_request)
            return [violation.field for violation in bad_request.field_violations]
    return None


def bad_request_field(error: grpc.aio.AioRpcError) -> str:
    """The field named by the google.rpc.BadRequest detail of a rich error status."""
    for key, value in error.trailing_metadata() or ():
        if key == rpc_status.GRPC_DETAILS_METADATA_KEY:
            bad_request = error_details_pb2.BadRequest()
            status_pb2.Status.FromString(value).details[0].Unpack(bad_request)
            return bad_request.field_violations[0].field
    raise AssertionError("no google.rpc.BadRequest in the error")


async def generate_with(channel: grpc.aio.Channel, metadata=(), max_tokens: int = 16) -> list[int]:
    """The first tiny prompt's greedy tokens through the Generation service behind `channel`."""
    stub = generation_pb2_grpc.GenerationStub(channel)
    request = generation_pb2.GenerateRequest(prompt=TINY_PROMPTS[0], max_tokens=max_tokens, temperature=0.0)
    token_ids = []
    async for response in stub.Generate(request, timeout=WORK_TIMEOUT_S, metadata=metadata):
        token_ids.extend(response.token_ids)
    return token_ids


@pytest.fixture(scope="module", name="door")
async def fuzz_door(tiny_llama_dir, tiny_llama_perturbed_dir):
    """One stack and front door shared by a fuzz module's examples (hypothesis runs many per test)."""
    stack = await start_stack(tiny_llama_dir, tiny_llama_perturbed_dir, k=2)
    door = await open_front_door(stack, tiny_llama_dir)
    yield door
    await door.close()
    await stack.stop()
