"""`specmesh serve`: pools of draft and target replicas and the orchestrator over them, in this process.

The start-up path is the same in both backends: `serve_deployment` builds the
`PoolsOptions` (what each role runs, how many replicas, where), then
`run_orchestrator` runs the orchestrator on this process's event loop, and the
orchestrator's `Pools` start the replicas: child processes under a supervisor
("local", the default) or Ray actors ("ray", chosen with --backend ray or
--address). The orchestrator stays in the serve process in both, so routing,
failover, supervision and the client-facing servers share one event loop and a
dead model service is only ever a replica to replace.

`ProcessGroup` / `start_stack` run that whole deployment as one child (`specmesh
bench` starts its own stack that way); `run_service` runs one model service as a
child (the pipelining benchmark).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing as mp
import queue
import sys
import time
from dataclasses import dataclass

from orchestrator.decoding.request import LoopConfig
from orchestrator.decoding.options import add_loop_arguments
from orchestrator.control.build import OrchestratorOptions
from orchestrator.serving.failover import MAX_REPLICA_FAILURES
from orchestrator.serving.pool import PoolSpec
from orchestrator.control.replicas import create_model_server
from orchestrator.control.draft_training import DraftTraining
from orchestrator.control.options import PoolsOptions, RestartPolicy
from orchestrator.serving.http_api import create_app, start_http_server, stop_http_server
from orchestrator.serving.options import FrontendOptions
from orchestrator.serving.server import serve_grpc
from orchestrator.control.build import create_servicer
from specmesh.server.connections import quiet_accept_errors, raise_file_limit
from specmesh.server.metrics import OrchestratorMetrics, serve_metrics
from specmesh.loading.models import load_tokenizer
from specmesh.roles import DRAFT, START_TIMEOUT_S, TARGET
from specmesh.server.security import TLSConfig
from specmesh.server.drain import drain_of
from specmesh.heap import freeze_start_up_heap
from specmesh.loading.cpu_linear import KERNEL_CHOICES, KERNEL_HELP
from specmesh.loading.precision import DTYPE_CHOICES, DTYPE_HELP
from specmesh.server.grpc_server import serve_until_signal
from specmesh.server.service import (ReplicaConfig, ServiceOptions, add_graph_steps_argument,
                                     add_trust_remote_code_argument, load_engine, parse_cpu_list, run_model_service)
from specmesh.server.telemetry import make_tracer_provider
from target_service.disagreements import disagreement_log_settings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Ready:
    name: str
    port: int | None
    metrics_port: int | None = None
    error: str | None = None
    http_port: int | None = None
    replica_metrics_ports: dict[str, int] | None = None  # local replicas' /metrics, by role or replica name
    replica_addresses: dict[str, str] | None = None  # local replicas' gRPC host:port, by role or replica name


TARGET_HELP = "target model: alias, directory, .gguf or hub id"


def add_model_arguments(parser: argparse.ArgumentParser, target_help: str = TARGET_HELP) -> None:
    """The model pair and where it runs: shared by `specmesh serve` and `specmesh bench`."""
    parser.add_argument("--target", default=TARGET.default_model, metavar="MODEL", help=target_help)
    parser.add_argument("--draft", default=DRAFT.default_model, metavar="MODEL",
                        help="draft model, or 'none' for target-only")
    add_loop_arguments(parser)
    parser.add_argument("--target-cpus", type=parse_cpu_list, default=None, metavar="LIST",
                        help="pin the target service to these CPU cores, e.g. 0 or 0-3")
    parser.add_argument("--draft-cpus", type=parse_cpu_list, default=None, metavar="LIST",
                        help="pin the draft service to these CPU cores, e.g. 4-5")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (both models)")
    parser.add_argument("--draft-device", default=None, help="device of the draft (default: --device)")
    parser.add_argument("--target-dtype", default="float32", choices=DTYPE_CHOICES,
                        help="precision of the target's weights and compute")
    parser.add_argument("--draft-dtype", default="auto", choices=DTYPE_CHOICES,
                        help=DTYPE_HELP + "; the draft's precision never changes the output, only acceptance and speed")
    parser.add_argument("--cpu-linear", default="auto", choices=KERNEL_CHOICES, help=KERNEL_HELP + " (both models)")
    add_trust_remote_code_argument(parser, "the target's and the draft's")
    add_graph_steps_argument(parser)


def add_supervision_arguments(parser: argparse.ArgumentParser) -> None:
    """How the local backend restarts dead replicas."""
    group = parser.add_argument_group("local replica supervision (--backend local)")
    group.add_argument("--max-restarts", type=int, default=RestartPolicy.max_restarts,
                       help="restarts of one replica within --restart-window before it is crash-looping: "
                            "retried with --crash-loop-backoff; a role with no replica up is failed (health "
                            "NOT_SERVING, specmesh_role_failed) until one starts again")
    group.add_argument("--restart-window", type=float, default=RestartPolicy.window_s, metavar="SECONDS",
                       help="seconds over which --max-restarts counts, and that a crash-looping replica must "
                            "run to leave its crash loop")
    group.add_argument("--crash-loop-backoff", type=float, default=RestartPolicy.crash_loop_backoff_s,
                       metavar="SECONDS", help="wait before a crash-looping replica's first retry; doubles with "
                                               "each retry up to --max-crash-loop-backoff")
    group.add_argument("--max-crash-loop-backoff", type=float, default=RestartPolicy.max_crash_loop_backoff_s,
                       metavar="SECONDS", help="longest wait between a crash-looping replica's retries")


def local_pools(target: ServiceOptions, draft: ServiceOptions | None, *, target_replicas: int = 1,
                draft_replicas: int = 1, greedy_draft: bool = False,
                disagreement_log: tuple[str, float, bool] | None = None, channel_tls: TLSConfig | None = None,
                max_replica_failures: int = MAX_REPLICA_FAILURES,
                restart_policy: RestartPolicy = RestartPolicy(),
                online_distill: DraftTraining | None = None) -> PoolsOptions:
    """Each role a pool of local child processes (draft None or no draft replicas: target-only)."""
    target_pool = PoolSpec(ReplicaConfig(TARGET.name, target, disagreement_log=disagreement_log),
                           replicas=target_replicas)
    draft_pool = None
    if draft is not None and draft_replicas > 0:
        draft_pool = PoolSpec(ReplicaConfig(DRAFT.name, draft, greedy_proposals=greedy_draft), replicas=draft_replicas)
    return PoolsOptions(backend="local", target=target_pool, draft=draft_pool, channel_tls=channel_tls,
                        max_replica_failures=max_replica_failures,
                        restart_policy=restart_policy, online_distill=online_distill)


def model_service_options(args: argparse.Namespace, role_name: str, **common) -> ServiceOptions:
    """One role's model service from the `add_model_arguments` settings (`specmesh serve` and `specmesh bench`)."""
    if role_name == TARGET.name:
        return ServiceOptions(model=args.target, device=args.device, dtype=args.target_dtype, cpus=args.target_cpus,
                              cpu_linear=args.cpu_linear, trust_remote_code=args.trust_remote_code,
                              graph_steps=args.graph_steps, **common)
    return ServiceOptions(model=args.draft, device=args.draft_device or args.device, dtype=args.draft_dtype,
                          cpus=args.draft_cpus, cpu_linear=args.cpu_linear, trust_remote_code=args.trust_remote_code,
                          graph_steps=args.graph_steps, **common)


def local_pools_options(args: argparse.Namespace, security, metrics_ports, internal_token: str) -> PoolsOptions:
    """`specmesh serve --backend local`: the first replica of each role serves its role's metrics port;
    the replicas accept only callers holding `internal_token`."""
    # Only this deployment's orchestrator may call its draft and target: the token reaches the children
    # with their start-up arguments (pickled over a pipe), never on a command line or in the environment.
    common = dict(host=args.host, trace_exporter=args.trace_exporter, trace_sample_ratio=args.trace_sample_ratio,
                  tls=security.server_tls, internal_token=internal_token, shutdown_grace_s=args.shutdown_grace,
                  kv_cache_memory=args.kv_cache_memory, max_waiting_sessions=args.max_waiting_sessions,
                  max_step_tokens=args.max_step_tokens, prefill_slowdown=args.prefill_slowdown)
    draft = None
    if args.draft.lower() != "none":
        draft = model_service_options(args, DRAFT.name, metrics_port=metrics_ports["draft"], **common)
    return local_pools(
        model_service_options(args, TARGET.name, metrics_port=metrics_ports["target"], **common),
        draft, target_replicas=1 if args.target_replicas is None else args.target_replicas,
        draft_replicas=1 if args.draft_replicas is None else args.draft_replicas, greedy_draft=args.greedy_draft,
        disagreement_log=disagreement_log_settings(args),
        channel_tls=security.channel_tls, max_replica_failures=args.max_replica_failures,
        restart_policy=RestartPolicy(max_restarts=args.max_restarts, window_s=args.restart_window,
                                     crash_loop_backoff_s=args.crash_loop_backoff,
                                     max_crash_loop_backoff_s=args.max_crash_loop_backoff))


@dataclass(frozen=True)
class StackOptions:
    """A local deployment with one replica per role, run as one child by `start_stack` (`specmesh bench`)."""

    target: ServiceOptions
    draft: ServiceOptions | None  # None: target-only
    loop: LoopConfig
    address: str  # the orchestrator's client-facing host:port
    orchestrator: FrontendOptions  # its metrics and HTTP ports and tracing settings
    greedy_draft: bool = False
    disagreement_log: tuple[str, float, bool] | None = None  # DisagreementLog(path, records per second, context)
    channel_tls: TLSConfig | None = None  # the orchestrator's channels to the draft and target

    def pools(self) -> PoolsOptions:
        return local_pools(self.target, self.draft, greedy_draft=self.greedy_draft,
                           disagreement_log=self.disagreement_log, channel_tls=self.channel_tls)


def run_orchestrator(tokenizer_spec: str, options: OrchestratorOptions, address: str,
                     frontend: FrontendOptions, ready) -> None:
    """Serve until SIGINT/SIGTERM; `ready.put(Ready)` once listening, or with the start-up error."""
    _configure_logging()
    # Before the connection caps are sized from it; and a flood's accept failures log once per interval.
    raise_file_limit()
    quiet_accept_errors()
    try:
        asyncio.run(_serve_orchestrator(tokenizer_spec, options, address, frontend, ready))
    except Exception as error:  # noqa: BLE001
        ready.put(Ready("orchestrator", None, error=f"{type(error).__name__}: {error}"))
        sys.exit(1)


async def _serve_orchestrator(tokenizer_spec, options, address, frontend: FrontendOptions, ready) -> None:
    provider = make_tracer_provider("specmesh-orchestrator", frontend.trace_exporter, frontend.trace_sample_ratio)
    metrics = OrchestratorMetrics()
    metrics_port = serve_metrics(metrics.registry, frontend.host, frontend.metrics_port)
    try:
        tokenizer = load_tokenizer(tokenizer_spec)  # the target's: a bad target fails here, before any child starts
    except Exception as error:
        raise RuntimeError(f"target failed to start: {type(error).__name__}: {error}") from error
    servicer = await create_servicer(tokenizer, options, tracer_provider=provider, metrics=metrics)
    http = None
    try:
        server, port, health = await serve_grpc(servicer, address, tracer_provider=provider, tls=frontend.tls,
                                                api_key=frontend.api_key,
                                                max_request_bytes=frontend.max_request_bytes,
                                                connection_limits=frontend.connection_limits)
        if frontend.http_port is not None and frontend.http_port >= 0:
            app = create_app(servicer, frontend.api_key, drain_of(server), frontend.max_request_bytes)
            http = await start_http_server(app, frontend.host, frontend.http_port, frontend.tls,
                                           frontend.connection_limits)
        pools = servicer.pools
        freeze_start_up_heap("orchestrator")
        ready.put(Ready("orchestrator", port, metrics_port, http_port=http[1] if http else None,
                        replica_metrics_ports=pools.metrics_ports() if pools is not None else {},
                        replica_addresses=pools.local_addresses() if pools is not None else {}))
        # Returns after the drain on SIGTERM/SIGINT (specmesh.server.drain; HTTP shares it), while the replicas
        # still serve: they are stopped below, last.
        await serve_until_signal(server, health, frontend.shutdown_grace_s)
    finally:
        if http is not None:
            await stop_http_server(http[0], http[2])
        if servicer.pools is not None:
            await servicer.pools.stop()  # the local replicas are this process's children
        if provider is not None:
            provider.shutdown()


def ready_message(host: str, orchestrator: Ready) -> str:
    http = f", OpenAI API http://{host}:{orchestrator.http_port}/v1" if orchestrator.http_port else ""
    return f"specmesh ready: client endpoint {host}:{orchestrator.port}{http}"


def _configure_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(processName)s %(levelname)s %(message)s")


def run_service(config: ReplicaConfig, ready: "mp.Queue[Ready]") -> None:
    """Child process: one model service at config.service's port (a benchmark's fixed pair)."""
    _configure_logging()
    try:
        engine = load_engine(config.service, config.role)
        asyncio.run(run_model_service(config, engine, create_model_server, lambda port, metrics_port: ready.put(
            Ready(config.role, port, metrics_port))))
    except Exception as error:  # noqa: BLE001 - reported to the parent, then exit
        ready.put(Ready(config.role, None, error=f"{type(error).__name__}: {error}"))
        sys.exit(1)


def start_stack(group: "ProcessGroup", options: StackOptions) -> dict[str, Ready]:
    """The whole local deployment as one child; raises RuntimeError when it fails to start."""
    orchestrator = OrchestratorOptions("", None, options.loop, pools=options.pools(),
                                       internal_token=options.target.internal_token)
    group.start("orchestrator", run_orchestrator, options.target.model, orchestrator, options.address,
                options.orchestrator)
    return group.wait_ready({"orchestrator"}, START_TIMEOUT_S)


class ProcessGroup:
    """Children started with the spawn method, stopped together."""

    def __init__(self):
        self.context = mp.get_context("spawn")
        self.ready: mp.Queue = self.context.Queue()
        self.processes: list[mp.Process] = []

    def start(self, name: str, target, *args) -> None:
        process = self.context.Process(target=target, args=(*args, self.ready), name=name, daemon=False)
        process.start()
        self.processes.append(process)

    def wait_ready(self, names: set[str], timeout_s: float) -> dict[str, Ready]:
        """Readiness of the named children; raises RuntimeError when one fails or exits first."""
        ports: dict[str, Ready] = {}
        deadline = time.monotonic() + timeout_s
        while set(ports) != names:
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out waiting for {sorted(names - set(ports))} to start")
            try:
                ready = self.ready.get(timeout=0.5)
            except queue.Empty:
                self._check_alive()
                continue
            if ready.error:
                raise RuntimeError(f"{ready.name} failed to start: {ready.error}")
            ports[ready.name] = ready
        return ports

    def _check_alive(self) -> None:
        for process in self.processes:
            if process.exitcode is not None:
                raise RuntimeError(f"{process.name} exited with code {process.exitcode} during start-up")

    def stop(self, grace_s: float = 10.0) -> None:
        for process in self.processes:
            if process.is_alive():
                process.terminate()  # SIGTERM: each server shuts down gracefully
        deadline = time.monotonic() + grace_s
        for process in self.processes:
            process.join(max(0.1, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
