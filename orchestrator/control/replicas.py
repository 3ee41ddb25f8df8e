"""A model replica's gRPC server, whichever its role: the one place that knows both services.

Every way of running either role goes through here (`specmesh serve`'s child processes,
the Ray replica actors, tests); `python -m draft_service|target_service` call their own
role's `create_replica_server`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc
from grpc_health.v1.health import aio as health_aio

from draft_service.server import create_replica_server as create_draft_replica_server
from specmesh.engine.model_engine import ModelEngine
from specmesh.server.metrics import ServiceMetrics
from specmesh.roles import DRAFT, role
from specmesh.server.service import ReplicaConfig
from target_service.server import create_replica_server as create_target_replica_server

if TYPE_CHECKING:  # annotations only: the tracing SDK loads where tracing is on (start time)
    from opentelemetry.sdk.trace import TracerProvider


async def create_model_server(config: ReplicaConfig, engine: ModelEngine, *,
                              tracer_provider: TracerProvider | None = None, metrics: ServiceMetrics | None = None,
                              max_concurrent_rpcs: int | None = None,
                              ) -> tuple[grpc.aio.Server, int, health_aio.HealthServicer]:
    """The role's gRPC server over a loaded engine (a specmesh.server.service.ReplicaServerFactory)."""
    create = create_draft_replica_server if role(config.role) is DRAFT else create_target_replica_server
    return await create(config, engine, tracer_provider=tracer_provider, metrics=metrics,
                        max_concurrent_rpcs=max_concurrent_rpcs)
