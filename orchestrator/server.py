"""Start the orchestrator: connect to the services, check the tokenizers, serve Generation."""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1.health import aio as health_aio
from opentelemetry.sdk.trace import TracerProvider
from transformers import PreTrainedTokenizerBase

from orchestrator.clients import DraftClient, TargetClient, open_channel
from orchestrator.loop import LoopConfig
from orchestrator.pipelined import PIPELINE_MODES, pipeline_enabled
from orchestrator.servicer import AdminServicer, Backends, GenerationServicer
from orchestrator.validation import ModelLimits

from specmesh import models
from specmesh.metrics import OrchestratorMetrics
from specmesh.security import TLSConfig
from specmesh.server import start_server
from specmesh.telemetry import client_interceptors, tracer
from specmesh.v1 import admin_pb2, admin_pb2_grpc, common_pb2, generation_pb2, generation_pb2_grpc

if TYPE_CHECKING:
    from orchestrator.pools.serving import PoolsOptions

log = logging.getLogger(__name__)
SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
ADMIN_SERVICE_NAME = admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name
STARTUP_TIMEOUT_S = 30.0


def add_loop_arguments(parser: argparse.ArgumentParser) -> None:
    """The speculative loop's flags, shared by `specmesh serve` and `python -m orchestrator`."""
    parser.add_argument("--num-speculative-tokens", type=int, default=LoopConfig.num_speculative_tokens,
                        help="draft tokens per round; with the adaptive policy, the most per round")
    parser.add_argument("--speculation-policy", choices=("adaptive", "fixed"), default="adaptive",
                        help="adaptive: choose k per round from measured acceptance and costs, 0 when "
                             "speculation does not pay; fixed: always --num-speculative-tokens")
    parser.add_argument("--draft-timeout", type=float, default=LoopConfig.draft_timeout_s,
                        help="seconds a draft round may take before the request goes target-only")
    parser.add_argument("--pipeline", choices=PIPELINE_MODES, default=LoopConfig.pipeline,
                        help="draft the next round while the target verifies; auto: when draft and target "
                             "compute on separate hardware (hosts, devices or disjoint --*-cpus)")
    parser.add_argument("--extra-branches", type=int, default=None, metavar="N",
                        help="pipelined: also pre-draft N likely rejection outcomes (default: as many as "
                             "the measured draft and target costs leave time for)")


def loop_config(args: argparse.Namespace) -> LoopConfig:
    return LoopConfig(num_speculative_tokens=args.num_speculative_tokens, draft_timeout_s=args.draft_timeout,
                      adaptive_k=args.speculation_policy == "adaptive", pipeline=args.pipeline,
                      extra_branches=args.extra_branches)


class TokenizerMismatch(RuntimeError):
    """Draft and target (or the orchestrator's tokenizer) disagree on the vocabulary."""


@dataclass(frozen=True)
class OrchestratorOptions:
    target_endpoint: str  # unused with pools
    draft_endpoint: str | None  # None: serve target-only
    loop: LoopConfig = LoopConfig()
    channel_tls: TLSConfig | None = None  # the channels to the draft and target (client side); None = plaintext
    pools: "PoolsOptions | None" = None  # Ray replica pools instead of the two endpoints


def check_vocabularies(tokenizer_fingerprint: str, target: common_pb2.ModelInfo,
                       draft: common_pb2.ModelInfo | None) -> None:
    """Refuse to start when draft and target would mean different things by a token id."""
    if draft is not None and draft.vocab_fingerprint != target.vocab_fingerprint:
        raise TokenizerMismatch(
            f"draft model {draft.model!r} and target model {target.model!r} have different tokenizer "
            f"vocabularies (fingerprints {draft.vocab_fingerprint[:12]} vs {target.vocab_fingerprint[:12]}); "
            "speculative decoding needs a draft that shares the target's tokenizer")
    if tokenizer_fingerprint != target.vocab_fingerprint:
        raise TokenizerMismatch(
            f"the orchestrator's tokenizer differs from the target model {target.model!r}'s")


async def connect_backends(tokenizer: PreTrainedTokenizerBase, options: OrchestratorOptions,
                           tracer_provider: TracerProvider | None = None) -> Backends:
    interceptors = client_interceptors(tracer_provider)
    target = TargetClient(open_channel(options.target_endpoint, options.channel_tls, interceptors))
    draft, draft_info = None, None
    if options.draft_endpoint:
        draft = DraftClient(open_channel(options.draft_endpoint, options.channel_tls, interceptors))
        draft_info = await draft.model_info(timeout=STARTUP_TIMEOUT_S)
    return await backends_for(tokenizer, target, draft, draft_info, options.loop)


async def backends_for(tokenizer: PreTrainedTokenizerBase, target, draft, draft_info: common_pb2.ModelInfo | None,
                       loop: LoopConfig) -> Backends:
    """Check the target (and the draft's info, when known) against the tokenizer; return the backends."""
    target_info = await target.model_info(timeout=STARTUP_TIMEOUT_S)
    check_vocabularies(models.vocab_fingerprint(tokenizer), target_info, draft_info)
    pipelined = pipeline_enabled(loop.pipeline, target_info, draft_info)
    if draft is not None:
        log.info("speculation %s: target on %s %s, draft on %s %s", "pipelined" if pipelined else "sequential",
                 target_info.host, target_info.device, draft_info.host, draft_info.device)
    limits = ModelLimits(vocab_size=target_info.vocab_size, context_window=target_info.context_window,
                         default_num_speculative_tokens=loop.num_speculative_tokens)
    return Backends(target=target, draft=draft, eos_token_ids=set(target_info.eos_token_ids), limits=limits,
                    model=target_info.model, pipelined=pipelined)


async def create_servicer(tokenizer: PreTrainedTokenizerBase, options: OrchestratorOptions, *,
                          tracer_provider: TracerProvider | None = None,
                          metrics: OrchestratorMetrics | None = None) -> GenerationServicer:
    """Connect to the services and check them; the result serves gRPC and HTTP alike."""
    if options.pools is not None:
        from orchestrator.pools.serving import create_pooled_servicer
        return await create_pooled_servicer(tokenizer, options, tracer_provider=tracer_provider, metrics=metrics)
    backends = await connect_backends(tokenizer, options, tracer_provider)
    return GenerationServicer(tokenizer, backends, options.loop, metrics, tracer(tracer_provider))


async def serve_grpc(servicer: GenerationServicer, address: str = "127.0.0.1:0", *,
                     max_concurrent_rpcs: int | None = None, tracer_provider: TracerProvider | None = None,
                     tls: TLSConfig | None = None, api_key: str | None = None,
                     ) -> tuple[grpc.aio.Server, int, health_aio.HealthServicer]:
    """Serve Generation and Admin (both behind `api_key` when set; the kill switch is an admin act)."""
    def register(server: grpc.aio.Server) -> None:
        generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
        admin_pb2_grpc.add_AdminServicer_to_server(AdminServicer(servicer.switch, servicer.pools), server)
    return await start_server(register, [SERVICE_NAME, ADMIN_SERVICE_NAME], address,
                              max_concurrent_rpcs=max_concurrent_rpcs, tls=tls, api_key=api_key,
                              tracer_provider=tracer_provider)


async def create_server(
    tokenizer: PreTrainedTokenizerBase, options: OrchestratorOptions, address: str = "127.0.0.1:0",
    *, max_concurrent_rpcs: int | None = None, tracer_provider: TracerProvider | None = None,
    metrics: OrchestratorMetrics | None = None, tls: TLSConfig | None = None, api_key: str | None = None,
) -> tuple[grpc.aio.Server, int, health_aio.HealthServicer]:
    servicer = await create_servicer(tokenizer, options, tracer_provider=tracer_provider, metrics=metrics)
    return await serve_grpc(servicer, address, max_concurrent_rpcs=max_concurrent_rpcs,
                            tracer_provider=tracer_provider, tls=tls, api_key=api_key)
