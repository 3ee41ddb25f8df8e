"""Serve the orchestrator's client-facing gRPC API (Generation and Admin) over its backends."""

from __future__ import annotations

import grpc
from grpc_health.v1.health import aio as health_aio
from opentelemetry.sdk.trace import TracerProvider

from orchestrator.decoding.background import pending_clean_ups
from orchestrator.serving.request_limits import request_size_limit
from orchestrator.serving.servicer import AdminServicer, GenerationServicer
from specmesh.server.connections import ConnectionLimits
from specmesh.server.security import TLSConfig
from specmesh.server.drain import Drain
from specmesh.server.grpc_server import start_server
from specmesh.v1 import admin_pb2, admin_pb2_grpc, generation_pb2, generation_pb2_grpc

SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
ADMIN_SERVICE_NAME = admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name


async def serve_grpc(servicer: GenerationServicer, address: str = "127.0.0.1:0", *,
                     max_concurrent_rpcs: int | None = None, tracer_provider: TracerProvider | None = None,
                     tls: TLSConfig | None = None, api_key: str | None = None,
                     max_request_bytes: int | None = None, connection_limits: ConnectionLimits | None = None,
                     ) -> tuple[grpc.aio.Server, int, health_aio.HealthServicer]:
    """Serve Generation and Admin (both behind `api_key` when set; the kill switch is an admin act).

    Requests over `max_request_bytes` (default: request_limits' default for the target's context
    window) get RESOURCE_EXHAUSTED unread. Its connections are bounded by `connection_limits`
    (default: ConnectionLimits(); specmesh.server.connections), as a public port's must be."""
    def register(server: grpc.aio.Server) -> None:
        generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
        admin_pb2_grpc.add_AdminServicer_to_server(AdminServicer(servicer.switch, servicer.pools, servicer.history), server)
    server, port, health = await start_server(
        register, [SERVICE_NAME, ADMIN_SERVICE_NAME], address, max_concurrent_rpcs=max_concurrent_rpcs, tls=tls,
        api_key=api_key, tracer_provider=tracer_provider,
        max_request_bytes=request_size_limit(servicer.backends.limits.context_window, max_request_bytes),
        connection_limits=connection_limits or ConnectionLimits(),
        drain=Drain(waits_for=(pending_clean_ups,)))  # a drained stream's sessions are closed before exit
    if servicer.pools is not None:  # the pools' roles on this server's health service, a target down turning it off
        servicer.pools.attach_health(health, (SERVICE_NAME,))
    return server, port, health
