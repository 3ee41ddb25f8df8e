"""`specmesh serve`: the draft service, the target service and the orchestrator as three processes.

Each child reports its bound port (or its start-up error) on a queue; the parent
prints one line with the client endpoint once all three are ready, and takes
them all down when one dies or on Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing as mp
import queue
import signal
import sys
import time
from dataclasses import dataclass

from orchestrator.decoding.loop import LoopConfig
from orchestrator.deployment.backends import OrchestratorOptions
from orchestrator.decoding.options import add_loop_arguments
from specmesh.security import TLSConfig
from specmesh.service import DTYPE_CHOICES, ServiceOptions, parse_cpu_list

log = logging.getLogger(__name__)
START_TIMEOUT_S = 1800.0  # first start assembles and converts the embedded models
DEFAULT_TARGET = "qwen2.5-coder-1.5b"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b"


@dataclass(frozen=True)
class Ready:
    name: str
    port: int | None
    metrics_port: int | None = None
    error: str | None = None
    http_port: int | None = None


@dataclass(frozen=True)
class DisagreementLogOptions:
    path: str
    max_per_second: float = 100.0


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The model pair and where it runs: shared by `specmesh serve` and `specmesh bench`."""
    parser.add_argument("--target", default=DEFAULT_TARGET, help="target model: alias, directory, .gguf or hub id")
    parser.add_argument("--draft", default=DEFAULT_DRAFT, help="draft model, or 'none' for target-only")
    add_loop_arguments(parser)
    parser.add_argument("--target-cpus", type=parse_cpu_list, default=None, metavar="LIST",
                        help="pin the target service to these CPU cores, e.g. 0 or 0-3")
    parser.add_argument("--draft-cpus", type=parse_cpu_list, default=None, metavar="LIST",
                        help="pin the draft service to these CPU cores, e.g. 4-5")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (both models)")
    parser.add_argument("--draft-device", default=None, help="device of the draft (default: --device)")
    parser.add_argument("--target-dtype", default="float32", choices=DTYPE_CHOICES)
    parser.add_argument("--draft-dtype", default="auto", choices=DTYPE_CHOICES,
                        help="auto: bfloat16 where the device computes it natively, else float32; "
                             "the draft's precision never changes the output, only acceptance and speed")


@dataclass(frozen=True)
class StackOptions:
    """Everything `start_stack` needs: both services, the loop, and where the orchestrator listens."""

    target: ServiceOptions
    draft: ServiceOptions | None  # None: target-only
    loop: LoopConfig
    address: str  # the orchestrator's client-facing host:port
    orchestrator: ServiceOptions  # its metrics and HTTP ports and tracing settings
    greedy_draft: bool = False
    disagreement_log: DisagreementLogOptions | None = None
    channel_tls: TLSConfig | None = None  # the orchestrator's channels to the draft and target


def dial_host(bind_host: str) -> str:
    """The address to reach a service bound to `bind_host` on this machine (a wildcard is not one)."""
    return "127.0.0.1" if bind_host in ("", "0.0.0.0", "::", "[::]") else bind_host


def start_stack(group: "ProcessGroup", options: StackOptions) -> dict[str, Ready]:
    """Start target and draft, then the orchestrator over them; readiness by name.

    Raises RuntimeError when a child fails to start (the caller stops the group).
    """
    group.start("target", run_target, options.target, options.disagreement_log)
    names = {"target"}
    if options.draft is not None:
        group.start("draft", run_draft, options.draft, options.greedy_draft)
        names.add("draft")
    ready = group.wait_ready(names, START_TIMEOUT_S)
    orchestrator = OrchestratorOptions(
        target_endpoint=f"{dial_host(options.target.host)}:{ready['target'].port}",
        draft_endpoint=f"{dial_host(options.draft.host)}:{ready['draft'].port}" if "draft" in ready else None,
        loop=options.loop, channel_tls=options.channel_tls, internal_token=options.target.internal_token)
    group.start("orchestrator", run_orchestrator, options.target.model, orchestrator, options.address,
                options.orchestrator)
    ready.update(group.wait_ready({"orchestrator"}, START_TIMEOUT_S))
    return ready


def run_draft(options: ServiceOptions, greedy_proposals: bool, ready: "mp.Queue[Ready]") -> None:
    from draft_service.server import create_server
    _run_service("draft", create_server, options, 1, ready, greedy_proposals=greedy_proposals)


def run_target(options: ServiceOptions, disagreement_log: DisagreementLogOptions | None,
               ready: "mp.Queue[Ready]") -> None:
    from target_service.disagreements import DisagreementLog
    from target_service.server import create_server
    log_ = DisagreementLog(disagreement_log.path, disagreement_log.max_per_second) if disagreement_log else None
    _run_service("target", create_server, options, 0, ready, disagreements=log_)


def _run_service(name, create_server, options, salt, ready, **server_kwargs) -> None:
    from specmesh.service import load_engine, run_model_service
    _configure_child_logging()
    try:
        engine = load_engine(options, generator_salt=salt)
        asyncio.run(run_model_service(name, create_server, engine, options,
                                      lambda port, metrics_port: ready.put(Ready(name, port, metrics_port)),
                                      **server_kwargs))
    except Exception as error:  # noqa: BLE001 - reported to the parent, then exit
        ready.put(Ready(name, None, error=f"{type(error).__name__}: {error}"))
        sys.exit(1)


def run_orchestrator(tokenizer_spec: str, options: OrchestratorOptions, address: str,
                     telemetry: ServiceOptions, ready: "mp.Queue[Ready]") -> None:
    """`telemetry` carries the orchestrator's metrics port, tracing settings, TLS and API key."""
    _configure_child_logging()
    try:
        asyncio.run(_serve_orchestrator(tokenizer_spec, options, address, telemetry, ready))
    except Exception as error:  # noqa: BLE001
        ready.put(Ready("orchestrator", None, error=f"{type(error).__name__}: {error}"))
        sys.exit(1)


async def _serve_orchestrator(tokenizer_spec, options, address, telemetry: ServiceOptions, ready) -> None:
    from orchestrator.frontend.http_api import create_app, start_http_server, stop_http_server
    from orchestrator.frontend.server import create_servicer, serve_grpc
    from specmesh.metrics import OrchestratorMetrics, serve_metrics
    from specmesh.models import load_tokenizer
    from specmesh.drain import drain_of
    from specmesh.server import serve_until_signal
    from specmesh.telemetry import make_tracer_provider
    provider = make_tracer_provider("specmesh-orchestrator", telemetry.trace_exporter, telemetry.trace_sample_ratio)
    metrics = OrchestratorMetrics()
    metrics_port = serve_metrics(metrics.registry, telemetry.host, telemetry.metrics_port)
    servicer = await create_servicer(load_tokenizer(tokenizer_spec), options, tracer_provider=provider,
                                     metrics=metrics)
    server, port, health = await serve_grpc(servicer, address, tracer_provider=provider, tls=telemetry.tls,
                                            api_key=telemetry.api_key, max_request_bytes=telemetry.max_request_bytes)
    http = None
    if telemetry.http_port is not None and telemetry.http_port >= 0:
        app = create_app(servicer, telemetry.api_key, drain_of(server), telemetry.max_request_bytes)
        http = await start_http_server(app, telemetry.host, telemetry.http_port, telemetry.tls)
    ready.put(Ready("orchestrator", port, metrics_port, http_port=http[1] if http else None))
    try:
        await serve_until_signal(server, health, telemetry.shutdown_grace_s)  # drains HTTP too: one drain
    finally:
        if http is not None:
            await stop_http_server(http[0], http[2])
        if provider is not None:
            provider.shutdown()


def ready_message(host: str, orchestrator: Ready) -> str:
    http = f", OpenAI API http://{host}:{orchestrator.http_port}/v1" if orchestrator.http_port else ""
    return f"specmesh ready: client endpoint {host}:{orchestrator.port}{http}"


def _configure_child_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(processName)s %(levelname)s %(message)s")


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

    def wait_any_exit(self, stop_requested) -> None:
        while not stop_requested() and all(p.is_alive() for p in self.processes):
            time.sleep(0.5)

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the orchestrator and wait up to grace_s for its drain, then the model services: they
        serve its in-flight streams to the end."""
        orchestrator = [p for p in self.processes if p.name == "orchestrator"]
        for group in (orchestrator, [p for p in self.processes if p not in orchestrator]):
            for process in group:
                if process.is_alive():
                    process.terminate()  # SIGTERM: each server drains (specmesh.drain)
            deadline = time.monotonic() + grace_s
            for process in group:
                process.join(max(0.1, deadline - time.monotonic()))
                if process.is_alive():
                    process.kill()


def install_stop_flag() -> list[bool]:
    flag = [False]

    def request_stop(signum, frame):
        flag[0] = True
    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    return flag
