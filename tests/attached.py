"""Model services `specmesh serve` did not start, attached by address: started here in this process as
`python -m target_service` / `draft_service` starts one (with an internal token), and the orchestrator
`specmesh serve` builds over them."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace

import grpc
from grpc_health.v1.health import aio as health_aio

from harness import WORK_TIMEOUT_S, load, make_engine, serve_config
from orchestrator.decoding.options import loop_config
from orchestrator.control.build import OrchestratorOptions
from orchestrator.control.options import PoolsOptions
from orchestrator.serving.pool import ReplicaPool
from orchestrator.control.replicas import create_model_server
from orchestrator.cli.main import build_parser, metrics_ports_of, serve_pools_options
from orchestrator.serving.server import serve_grpc
from orchestrator.control.build import create_servicer
from pools import MAX_TOKENS
from specmesh.engine.model_engine import ModelEngine
from specmesh.server.security import Security
from specmesh.server.service import ReplicaConfig, ServiceOptions
from specmesh.v1 import admin_pb2, admin_pb2_grpc, generation_pb2, generation_pb2_grpc

TOKEN = "attached-t0ken"
ACQUIRE_TIMEOUT_S = 2.0  # no routable target: how long a request waits before UNAVAILABLE


@dataclass
class Service:
    """A model service started elsewhere (here: in this process), as `python -m target_service` starts one."""

    engine: ModelEngine
    server: grpc.aio.Server
    port: int
    health: health_aio.HealthServicer

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def stop(self) -> None:
        await self.server.stop(None)  # a second stop (of one stopped already) does nothing


async def start_service(role: str, model_dir, token: str | None = TOKEN) -> Service:
    engine = make_engine(model_dir, role_name=role)
    options = ServiceOptions(model=str(model_dir), internal_token=token)
    server, port, health = await create_model_server(ReplicaConfig(role, options), engine)
    return Service(engine, server, port, health)


def serve_args(directory, **settings) -> argparse.Namespace:
    """`specmesh serve --config FILE` as parsed, the file holding `settings` (keys as dests)."""
    return build_parser().parse_args(["serve", *serve_config(directory, **settings)])


def pools_of(args: argparse.Namespace) -> PoolsOptions:
    """The pools `specmesh serve` runs for `args`, checked every 0.1 s (tests wait on what checks find)."""
    pools, _ = serve_pools_options(args, Security(), metrics_ports_of(-1))
    return replace(pools, check_interval_s=0.1, acquire_timeout_s=ACQUIRE_TIMEOUT_S)


def token_file_in(directory, token: str = TOKEN):
    path = directory / "internal-token"
    path.write_text(token + "\n")
    return path


class Orchestrator:
    """The Generation and Admin servers over attached pools, built as `specmesh serve` builds them."""

    def __init__(self, servicer, server: grpc.aio.Server, port: int):
        self.servicer, self.server = servicer, server
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        self.admin = admin_pb2_grpc.AdminStub(self.channel)

    @classmethod
    async def start(cls, tokenizer_dir, args: argparse.Namespace) -> "Orchestrator":
        _, tokenizer = load(str(tokenizer_dir), "cpu")
        options = OrchestratorOptions("", None, loop_config(args), pools=pools_of(args), internal_token="own-token")
        servicer = await create_servicer(tokenizer, options)
        server, port, _ = await serve_grpc(servicer)
        return cls(servicer, server, port)

    def pool(self, role: str) -> ReplicaPool:
        return self.servicer.pools.pools[role]

    async def generate(self, prompt: str, max_tokens: int = MAX_TOKENS) -> list[int]:
        stub = generation_pb2_grpc.GenerationStub(self.channel)
        request = generation_pb2.GenerateRequest(prompt=prompt, max_tokens=max_tokens, temperature=0.0)
        return [t async for response in stub.Generate(request, timeout=WORK_TIMEOUT_S) for t in response.token_ids]

    async def replicas(self) -> dict[str, admin_pb2.ReplicaState]:
        listed = await self.admin.ListReplicas(admin_pb2.ListReplicasRequest(), timeout=WORK_TIMEOUT_S)
        return {replica.name: replica for pool in listed.pools for replica in pool.replicas}

    async def stop(self) -> None:
        await self.channel.close()
        await self.server.stop(None)
        await self.servicer.pools.stop()


async def stop_all(*services: Service) -> None:
    for service in services:
        await service.stop()
