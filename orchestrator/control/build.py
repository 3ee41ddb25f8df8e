"""Build the orchestrator: the Generation servicer over two service endpoints, or over replica pools.

Everything the front doors serve comes from here (`create_servicer`), whoever starts it: `specmesh serve`
and `python -m orchestrator` (through launch.run_orchestrator), `specmesh bench`'s stack, the tests. It
lives in control because pools are built with their controllers; the serving path it assembles knows
nothing of how it was built.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc
from grpc_health.v1.health import aio as health_aio
from opentelemetry.sdk.trace import TracerProvider
from transformers import PreTrainedTokenizerBase

from orchestrator.control.options import PoolsOptions
from orchestrator.control.pools import Pools
from orchestrator.decoding.request import LoopConfig
from orchestrator.serving.backends import STARTUP_TIMEOUT_S, backends_for
from orchestrator.serving.clients import DraftClient, TargetClient, client_options, open_channel
from orchestrator.serving.failover import PooledDraftClient, PooledTargetClient
from orchestrator.serving.server import serve_grpc
from orchestrator.serving.servicer import Backends, GenerationServicer
from specmesh.server.metrics import OrchestratorMetrics
from specmesh.server.security import TLSConfig, token_interceptors
from specmesh.server.telemetry import client_interceptors, tracer


@dataclass(frozen=True)
class OrchestratorOptions:
    target_endpoint: str  # unused with pools
    draft_endpoint: str | None  # None: serve target-only
    loop: LoopConfig = LoopConfig()
    channel_tls: TLSConfig | None = None  # the channels to the draft and target (client side); None = plaintext
    pools: PoolsOptions | None = None  # Ray replica pools instead of the two endpoints
    # Sent on every call to the draft and target; None = send none. Kept out of reprs and logs.
    internal_token: str | None = field(default=None, repr=False)


async def connect_backends(tokenizer: PreTrainedTokenizerBase, options: OrchestratorOptions,
                           tracer_provider: TracerProvider | None = None) -> Backends:
    interceptors = [*client_interceptors(tracer_provider), *token_interceptors(options.internal_token)]
    streams = client_options(options.loop.round_calls, tracer_provider)
    target = TargetClient(open_channel(options.target_endpoint, options.channel_tls, interceptors), **streams)
    draft, draft_info = None, None
    if options.draft_endpoint:
        draft = DraftClient(open_channel(options.draft_endpoint, options.channel_tls, interceptors), **streams)
        draft_info = await draft.model_info(timeout=STARTUP_TIMEOUT_S)
    return await backends_for(tokenizer, target, draft, draft_info, options.loop)


async def create_servicer(tokenizer: PreTrainedTokenizerBase, options: OrchestratorOptions, *,
                          tracer_provider: TracerProvider | None = None,
                          metrics: OrchestratorMetrics | None = None) -> GenerationServicer:
    """Connect to the services and check them; the result serves gRPC and HTTP alike."""
    if options.pools is not None:
        return await create_pooled_servicer(tokenizer, options, tracer_provider=tracer_provider, metrics=metrics)
    backends = await connect_backends(tokenizer, options, tracer_provider)
    return GenerationServicer(tokenizer, backends, options.loop, metrics, tracer(tracer_provider))


async def create_server(
    tokenizer: PreTrainedTokenizerBase, options: OrchestratorOptions, address: str = "127.0.0.1:0",
    *, max_concurrent_rpcs: int | None = None, tracer_provider: TracerProvider | None = None,
    metrics: OrchestratorMetrics | None = None, tls: TLSConfig | None = None, api_key: str | None = None,
    max_request_bytes: int | None = None,
) -> tuple[grpc.aio.Server, int, health_aio.HealthServicer]:
    servicer = await create_servicer(tokenizer, options, tracer_provider=tracer_provider, metrics=metrics)
    return await serve_grpc(servicer, address, max_concurrent_rpcs=max_concurrent_rpcs,
                            tracer_provider=tracer_provider, tls=tls, api_key=api_key,
                            max_request_bytes=max_request_bytes)


async def create_pooled_servicer(tokenizer: PreTrainedTokenizerBase, options, *,
                                 tracer_provider: TracerProvider | None = None, metrics=None):
    """The Generation servicer over pools; `options` is an OrchestratorOptions with `pools` set."""
    tracing = client_interceptors(tracer_provider)
    pools = Pools.from_options(options.pools, [*tracing, *token_interceptors(options.internal_token)], tracing,
                               client_options(options.loop.round_calls, tracer_provider), metrics)
    return await servicer_over_pools(tokenizer, pools, options.loop, tracer_provider=tracer_provider)


async def servicer_over_pools(tokenizer: PreTrainedTokenizerBase, pools: Pools, loop, *,
                              tracer_provider: TracerProvider | None = None) -> GenerationServicer:
    """Start `pools` and serve over them; the servicer counts its requests in the pools' metrics. With online
    distillation, the pools' trainer is fed every finished request and started last."""
    await pools.start()
    failures = pools.options.max_replica_failures
    target = PooledTargetClient(pools.pools["target"], max_replica_failures=failures,
                                acquire_timeout_s=pools.options.acquire_timeout_s)
    draft = None
    if "draft" in pools.pools:
        draft = PooledDraftClient(pools.pools["draft"], max_replica_failures=failures,
                                  acquire_timeout_s=pools.options.draft_acquire_timeout_s)
    draft_info = None
    if draft is not None and draft.pool.routable():
        draft_info = await draft.model_info(STARTUP_TIMEOUT_S)
    backends = await backends_for(tokenizer, target, draft, draft_info, loop, pools.step_reports)
    trainer = pools.online
    servicer = GenerationServicer(tokenizer, backends, loop, pools.metrics, tracer(tracer_provider), pools=pools,
                                  on_served=trainer.served if trainer is not None else None)
    if trainer is not None:
        trainer.start()
    return servicer
