"""Create the target service's gRPC server over a loaded model.

With `internal_token` every TargetService call must carry it (`authorization: Bearer <token>`,
sent by the orchestrator); gRPC health and reflection stay open for probes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc
from grpc_health.v1.health import aio as health_aio

from specmesh.engine.model_engine import ModelEngine
from specmesh.server.metrics import ServiceMetrics
from specmesh.server.security import INTERNAL_UNAUTHENTICATED_MESSAGE, TLSConfig
from specmesh.server.drain import Drain
from specmesh.server.grpc_server import start_server
from specmesh.server.service import ReplicaConfig
from specmesh.v1 import target_pb2, target_pb2_grpc
from target_service.disagreements import DisagreementLog
from target_service.engine import TargetEngine
from target_service.servicer import TargetServicer

if TYPE_CHECKING:  # annotations only: the tracing SDK loads where tracing is on (start time)
    from opentelemetry.sdk.trace import TracerProvider

SERVICE_NAME = target_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name


async def create_server(engine: ModelEngine, address: str = "127.0.0.1:0", *,
                        max_concurrent_rpcs: int | None = None, tracer_provider: TracerProvider | None = None,
                        metrics: ServiceMetrics | None = None, disagreements: DisagreementLog | None = None,
                        tls: TLSConfig | None = None, internal_token: str | None = None,
                        ) -> tuple[grpc.aio.Server, int, health_aio.HealthServicer]:
    metrics = metrics or ServiceMetrics.for_engine("target", engine)
    servicer = TargetServicer(TargetEngine(engine, disagreements), metrics, tracer_provider)
    return await start_server(lambda s: target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, s),
                              [SERVICE_NAME], address, max_concurrent_rpcs=max_concurrent_rpcs,
                              tls=tls, tracer_provider=tracer_provider, api_key=internal_token,
                              unauthenticated_message=INTERNAL_UNAUTHENTICATED_MESSAGE,
                              # draining, new sessions are refused and open ones served until their orchestrator
                              # closes them (or the grace ends)
                              drain=Drain(open_sessions=lambda: len(engine.sessions),
                                          waits_for=(lambda: servicer.batches.in_flight,)))


async def create_replica_server(config: ReplicaConfig, engine: ModelEngine, *,
                                tracer_provider: TracerProvider | None = None, metrics: ServiceMetrics | None = None,
                                max_concurrent_rpcs: int | None = None,
                                ) -> tuple[grpc.aio.Server, int, health_aio.HealthServicer]:
    """The target server of a replica config (specmesh.server.service.ReplicaServerFactory), at its host and port."""
    options = config.service
    disagreements = DisagreementLog(*config.disagreement_log) if config.disagreement_log else None
    return await create_server(engine, f"{options.host}:{options.port}", tracer_provider=tracer_provider,
                               metrics=metrics, max_concurrent_rpcs=max_concurrent_rpcs, tls=options.tls,
                               internal_token=options.internal_token,
                               **{"disagreements": disagreements, **config.extra})
