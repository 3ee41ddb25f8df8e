"""Run a model service (draft or target): load, serve, reap idle sessions; the one way to start one."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Protocol

import grpc
import torch

from grpc_health.v1.health import aio as health_aio
from specmesh.server.drain import DEFAULT_SHUTDOWN_GRACE_S, add_shutdown_arguments
from specmesh.heap import freeze_start_up_heap
from specmesh.engine.model_engine import EngineConfig, ModelEngine
from specmesh.engine.graph_steps import GRAPH_STEPS_CHOICES
from specmesh.engine.kv_budget import (DEFAULT_MAX_WAITING_SESSIONS, KV_CACHE_MEMORY_HELP, KVCacheMemory,
                                       parse_kv_cache_memory)
from specmesh.server.metrics import ServiceMetrics, serve_metrics
from specmesh.loading.cpu_linear import KERNEL_CHOICES, KERNEL_HELP
from specmesh.loading.precision import DTYPE_CHOICES, DTYPE_HELP, load_model_in
from specmesh.roles import DRAFT, TARGET, role
from specmesh.server.security import (SecurityConfigError, TLSConfig, add_internal_token_arguments,
                                      add_server_tls_arguments, internal_token_from_args, server_tls_from_args)
from specmesh.server.grpc_server import serve_until_signal, stop_server
from specmesh.engine.step_log import StepLog
from specmesh.server.telemetry import make_tracer_provider

if TYPE_CHECKING:  # annotations only: the tracing SDK loads where tracing is on (start time)
    from opentelemetry.sdk.trace import TracerProvider

log = logging.getLogger(__name__)
CALIBRATION_LOCK = "specmesh-calibration.lock"  # in the temporary directory: see calibration_turn


@dataclass(frozen=True)
class ServiceOptions:
    """One model service's (a draft's or a target's) settings; the orchestrator's are its FrontendOptions."""

    model: str
    host: str = "127.0.0.1"
    port: int = 0
    device: str = "cpu"
    max_sessions: int = 256
    max_sessions_per_caller: int | None = None  # None = three quarters of max_sessions (EngineConfig)
    session_idle_timeout_s: float = 600.0
    num_threads: int | None = None  # torch intra-op threads; None = torch's default
    dtype: str = "float32"  # or "auto"; the draft may be faster in bf16: its precision never changes the output
    cpu_linear: str = "auto"  # kernel of float32 Linear layers on a CPU (specmesh.loading.cpu_linear)
    metrics_port: int | None = None  # Prometheus /metrics on host:port (0 = any free port); None = off
    trace_exporter: str | None = None  # otlp, console or none; None = from OTEL_* environment variables
    trace_sample_ratio: float | None = None  # None = from OTEL_TRACES_SAMPLER[_ARG], else every trace
    tls: TLSConfig | None = None  # serve TLS (mutual TLS with a client CA); None = plaintext
    cpus: tuple[int, ...] | None = None  # pin the process to these CPU cores (and as many torch threads)
    # draft/target: calls must carry it (from the orchestrator); None = open. Kept out of reprs and logs.
    internal_token: str | None = field(default=None, repr=False)
    shutdown_grace_s: float = DEFAULT_SHUTDOWN_GRACE_S  # on SIGTERM: how long in-flight work may run on
    max_step_tokens: int = EngineConfig.max_step_tokens  # rows one batched step may feed
    prefill_slowdown: float | None = None  # a prefill chunk's step costs <= this x decode alone; None: the role's
    kv_cache_memory: KVCacheMemory | None = None  # draft/target KV budget (engine.kv_budget); None: device default
    max_waiting_sessions: int = DEFAULT_MAX_WAITING_SESSIONS  # opens that may queue for KV room
    trust_remote_code: bool = False  # run the checkpoint's own modeling code (specmesh.loading.models.load_model)
    graph_steps: str = EngineConfig.graph_steps  # decode steps as CUDA graphs over preallocated KV (engine.graph_steps)


@dataclass(frozen=True)
class ReplicaConfig:
    """What one model service (a replica of a role) serves, however it is run."""

    role: str  # "draft" or "target"
    service: ServiceOptions  # model, device, dtype, host, session limits, tracing
    greedy_proposals: bool = False  # draft only
    disagreement_log: tuple[str, float, bool] | None = None  # target only: DisagreementLog(path, rate, context)
    extra: dict = field(default_factory=dict)  # more create_server keyword arguments


def add_service_arguments(parser: argparse.ArgumentParser, default_model: str) -> None:
    parser.add_argument("--model", default=default_model, help="embedded alias, directory, .gguf file or hub id")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N, or auto (sharded over every visible GPU)")
    parser.add_argument("--max-sessions", type=int, default=256)
    parser.add_argument("--max-sessions-per-caller", type=int, default=None, metavar="N",
                        help="sessions one caller (one orchestrator connection) may hold; "
                             "default: three quarters of --max-sessions")
    parser.add_argument("--session-idle-timeout", type=float, default=600.0,
                        help="seconds after which an untouched session is freed")
    parser.add_argument("--dtype", default="float32", choices=DTYPE_CHOICES, help=DTYPE_HELP)
    parser.add_argument("--cpu-linear", default="auto", choices=KERNEL_CHOICES, help=KERNEL_HELP)
    parser.add_argument("--cpus", type=parse_cpu_list, default=None, metavar="LIST",
                        help="pin the service to these CPU cores, e.g. 0 or 0-3,6 (and use as many torch threads)")
    add_trust_remote_code_argument(parser, "the model's")
    add_graph_steps_argument(parser)
    add_batching_arguments(parser)
    add_kv_cache_arguments(parser)
    add_telemetry_arguments(parser, default_metrics_port=None)
    add_server_tls_arguments(parser)
    add_internal_token_arguments(parser, serving=True)
    add_shutdown_arguments(parser)


def add_trust_remote_code_argument(parser: argparse.ArgumentParser, whose: str) -> None:
    parser.add_argument("--trust-remote-code", action="store_true",
                        help=f"run {whose} own modeling code, where a checkpoint ships it (its config.json's "
                             "auto_map): only for checkpoints you trust; without it such a model does not load")


def add_graph_steps_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--graph-steps", default=EngineConfig.graph_steps, choices=GRAPH_STEPS_CHOICES,
                        help="decode and verification steps over preallocated KV slots, replayed as CUDA graphs: "
                             "auto (on CUDA), on, off (the KV grows per session, steps run eagerly)")


def add_batching_arguments(parser: argparse.ArgumentParser) -> None:
    batching = parser.add_argument_group("continuous batching")
    batching.add_argument("--max-step-tokens", type=positive_int, default=EngineConfig.max_step_tokens,
                          metavar="ROWS", help="token rows one batched forward step may feed (decode rows of every "
                                               "session first, then prefill chunks)")
    batching.add_argument("--prefill-slowdown", type=float, default=None, metavar="X",
                          help="while streams decode, a step with a prefill chunk may cost at most X times the "
                               "decode rows alone (from costs measured at start-up; default: "
                               f"{TARGET.prefill_slowdown:g} on a target, {DRAFT.prefill_slowdown:g} on a draft)")


def add_kv_cache_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kv-cache-memory", type=parse_kv_cache_memory, default=None, metavar="SIZE",
                        help=KV_CACHE_MEMORY_HELP)
    parser.add_argument("--max-waiting-sessions", type=positive_int, default=DEFAULT_MAX_WAITING_SESSIONS,
                        metavar="N", help="sessions that may wait for KV room; past them an open gets "
                                          "RESOURCE_EXHAUSTED at once (default: %(default)s)")


def add_request_limit_argument(parser: argparse.ArgumentParser) -> None:
    """The orchestrator's cap on a client's request (`specmesh serve`, `python -m orchestrator`)."""
    parser.add_argument("--max-request-bytes", type=positive_int, default=None, metavar="BYTES",
                        help="largest gRPC message or HTTP body a client may send; larger ones get "
                             "RESOURCE_EXHAUSTED / HTTP 413 unread (default: 64 KiB + 32 bytes per token of "
                             "the target's context window)")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"not a positive whole number: {text!r}")
    return value


def add_telemetry_arguments(parser: argparse.ArgumentParser, default_metrics_port: int | None) -> None:
    parser.add_argument("--metrics-port", type=int, default=default_metrics_port, metavar="PORT",
                        help="serve Prometheus metrics at http://HOST:PORT/metrics (0 = any free port, "
                             "-1 = off)")
    parser.add_argument("--trace-exporter", choices=["otlp", "console", "none"], default=None,
                        help="default: OTEL_TRACES_EXPORTER, or otlp when OTEL_EXPORTER_OTLP_ENDPOINT is set")
    parser.add_argument("--trace-sample-ratio", type=float, default=None,
                        help="fraction of requests traced (parent-based); default: OTEL_TRACES_SAMPLER_ARG or 1")


def options_from_args(args: argparse.Namespace) -> ServiceOptions:
    """The options; an unusable TLS or token setting exits with a message naming its flag."""
    try:
        tls, token = server_tls_from_args(args), internal_token_from_args(args)
    except SecurityConfigError as error:
        raise SystemExit(f"error: {error}") from error
    if token is None and not (tls and tls.mutual):
        log.warning("no internal token (--internal-token-file) and no mutual TLS: anyone who reaches "
                    "%s can call this service", args.host)
    return ServiceOptions(model=args.model, host=args.host, port=args.port, device=args.device,
                          max_sessions=args.max_sessions, max_sessions_per_caller=args.max_sessions_per_caller,
                          session_idle_timeout_s=args.session_idle_timeout, dtype=args.dtype, cpu_linear=args.cpu_linear,
                          metrics_port=args.metrics_port, trace_exporter=args.trace_exporter,
                          trace_sample_ratio=args.trace_sample_ratio, tls=tls, cpus=args.cpus, internal_token=token,
                          shutdown_grace_s=args.shutdown_grace, max_step_tokens=args.max_step_tokens,
                          prefill_slowdown=args.prefill_slowdown, kv_cache_memory=args.kv_cache_memory,
                          max_waiting_sessions=args.max_waiting_sessions, trust_remote_code=args.trust_remote_code,
                          graph_steps=args.graph_steps)


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """"0,2-3" -> (0, 2, 3), as taskset and cgroups write CPU lists."""
    cpus: set[int] = set()
    try:
        for part in filter(None, (p.strip() for p in text.split(","))):
            low, _, high = part.partition("-")
            cpus.update(range(int(low), int(high or low) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a CPU list: {text!r} (e.g. 0 or 0-3,6)") from None
    if not cpus or min(cpus) < 0:
        raise argparse.ArgumentTypeError(f"not a CPU list: {text!r} (e.g. 0 or 0-3,6)")
    return tuple(sorted(cpus))


def pin_cpus(cpus: tuple[int, ...]) -> None:
    """Run this process (every thread it has, and those it starts) on `cpus` only."""
    for task in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(task), cpus)
    torch.set_num_threads(len(cpus))  # one intra-op thread per core: more would only contend


def load_engine(options: ServiceOptions, role_name: str) -> ModelEngine:
    if options.cpus:
        pin_cpus(options.cpus)
    if options.num_threads:
        torch.set_num_threads(options.num_threads)
    config = EngineConfig(model_name=options.model, max_sessions=options.max_sessions,
                          max_sessions_per_caller=options.max_sessions_per_caller,
                          generator_salt=role(role_name).generator_salt,
                          max_step_tokens=options.max_step_tokens,
                          prefill_slowdown=options.prefill_slowdown or role(role_name).prefill_slowdown,
                          kv_cache_memory=options.kv_cache_memory, max_waiting_sessions=options.max_waiting_sessions,
                          graph_steps=options.graph_steps)
    with calibration_turn():  # loading too: converting a draft to int8 takes seconds of both cores
        # Kernels chosen before the engine sizes its KV budget from free memory: a tied output
        # projection gets its own copy.
        model, tokenizer = load_model_in(options.model, options.device, options.dtype, options.cpu_linear,
                                         options.trust_remote_code)
        engine = ModelEngine(model, tokenizer, config)
        engine.warm_up()
        costs = engine.calibrate()  # row padding and prefill chunks from this machine's own step costs
    log.info("%s: GOMP_SPINCOUNT %s (specmesh.loading.openmp)", role_name, os.environ.get("GOMP_SPINCOUNT", "unset"))
    step_log = StepLog.from_environment(role_name)
    if step_log is not None:
        engine.scheduler.observers.append(step_log.observe)
    log.info("%s step costs (ms by rows): %s", role_name,
             {rows: round(seconds * 1e3, 1) for rows, seconds in costs.seconds.items()})
    return engine


@contextlib.contextmanager
def calibration_turn():
    """One service at a time loads its model and measures its kernels and step costs on this machine.

    Services started together (the draft and the target of one deployment) would otherwise time
    their forwards while the other computes on the same cores, and each table would price the
    other's load, and each kernel choice too (figures: docs/design/tuning.md).
    """
    with open(Path(tempfile.gettempdir()) / CALIBRATION_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def announce(service: str, host: str, port: int, metrics_port: int | None) -> None:
    metrics = f", metrics http://{host}:{metrics_port}/metrics" if metrics_port is not None else ""
    print(f"{service} listening on {host}:{port}{metrics}", flush=True)


async def reap_idle_sessions(engine: ModelEngine, idle_timeout_s: float) -> None:
    """Free sessions whose orchestrator disappeared without closing them."""
    while True:
        await asyncio.sleep(max(1.0, idle_timeout_s / 4))
        for request_id in engine.reap_idle(idle_timeout_s):
            log.info("freed idle session %s", request_id)


class ReplicaServerFactory(Protocol):
    """Creates a role's gRPC server over a loaded engine, bound to config.service's host and port.

    The runtime starts, drains and stops a model service without knowing which one it is: the
    role's own package makes its server (draft_service.server, target_service.server), and a
    deployment that runs either picks by role (orchestrator.control.replicas).
    """

    async def __call__(self, config: ReplicaConfig, engine: ModelEngine, *,
                       tracer_provider: TracerProvider | None = None, metrics: ServiceMetrics | None = None,
                       max_concurrent_rpcs: int | None = None,
                       ) -> tuple[grpc.aio.Server, int, health_aio.HealthServicer]: ...


@dataclass
class RunningService:
    """A model service started by `start_model_service`; `stop()` ends it."""

    server: grpc.aio.Server
    port: int
    metrics_port: int | None
    health: health_aio.HealthServicer
    reaper: asyncio.Task
    provider: TracerProvider | None

    async def stop(self, grace_s: float = 5.0) -> None:
        self.reaper.cancel()
        await stop_server(self.server, self.health, grace_s)
        if self.provider is not None:
            self.provider.shutdown()  # flush the spans still batched


async def start_model_service(config: ReplicaConfig, engine: ModelEngine,
                              create_server: ReplicaServerFactory) -> RunningService:
    """Tracing, metrics, the gRPC server and the idle-session reaper of one model service."""
    options = config.service
    provider = make_tracer_provider(f"specmesh-{config.role}", options.trace_exporter, options.trace_sample_ratio)
    metrics = ServiceMetrics.for_engine(config.role, engine)
    metrics_port = serve_metrics(metrics.registry, options.host, options.metrics_port)
    server, port, health = await create_server(config, engine, tracer_provider=provider, metrics=metrics)
    reaper = asyncio.ensure_future(reap_idle_sessions(engine, options.session_idle_timeout_s))
    freeze_start_up_heap(config.role)  # start-up is over: the process's long-lived objects are all here
    return RunningService(server, port, metrics_port, health, reaper, provider)


async def run_model_service(config: ReplicaConfig, engine: ModelEngine, create_server: ReplicaServerFactory,
                            on_ready: Callable[[int, int | None], None]) -> None:
    """Serve until SIGINT/SIGTERM; on_ready(grpc port, metrics port or None) once listening."""
    service = await start_model_service(config, engine, create_server)
    on_ready(service.port, service.metrics_port)
    try:
        await serve_until_signal(service.server, service.health, config.service.shutdown_grace_s)
    finally:
        service.reaper.cancel()
        if service.provider is not None:
            service.provider.shutdown()  # flush the spans still batched
