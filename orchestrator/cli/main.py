"""The `specmesh` command: serve the three services, or generate against a running server."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from typing import TYPE_CHECKING

from orchestrator.cli import client_commands, stats_view
from orchestrator.control.config_error import ConfigError
from orchestrator.cli.config_file import ConfigurableParser
from orchestrator.serving.options import FrontendOptions
from specmesh.server.connections import connection_limits_from_args
from specmesh.server.security import Security, SecurityConfigError, new_internal_token, security_from_args

if TYPE_CHECKING:  # the launch module loads the serving path: client commands must not
    from orchestrator.control.launch import Ready

# Commands that call a running server: their flags need neither torch nor the serving code.
CLIENT_COMMANDS = ("generate", "speculation", "stats", "scale", "replicas", "rollout")


def build_parser(client_only: bool = False) -> argparse.ArgumentParser:
    """Every command; `client_only`: only CLIENT_COMMANDS, without importing what the others' flags need."""
    parser = argparse.ArgumentParser(prog="specmesh", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=ConfigurableParser)
    if not client_only:
        from orchestrator.bench import args as bench_args
        from orchestrator.distill import args as distill_args
        from orchestrator.cli.serve_args import add_serve_parser

        add_serve_parser(commands)
        bench_args.add_parser(commands)
        distill_args.add_parser(commands)
    client_commands.add_parsers(commands)
    stats_view.add_parser(commands)
    return parser


def serve(args: argparse.Namespace) -> int:
    """Both backends: build the pools' options, then run the orchestrator (and through it the pools) here."""
    from orchestrator.decoding.options import loop_config
    from orchestrator.control import ray_cli as pools_cli
    from orchestrator.control.build import OrchestratorOptions
    from orchestrator.control.launch import run_orchestrator

    security = security_from_args(args)  # before anything starts: a bad TLS file fails here, naming its flag
    metrics_ports = metrics_ports_of(args.metrics_port)
    backend = pools_cli.backend_of(args)
    pools, internal_token = serve_pools_options(args, security, metrics_ports)
    # Attached roles are no Ray actors: with both attached there is nothing for Ray to run.
    uses_ray = backend == "ray" and (pools.target or pools.draft) is not None
    if uses_ray:
        pools_cli.init_ray(args.address, args.ray_namespace, pools)
    orchestrator = OrchestratorOptions("", None, loop_config(args), pools=pools, internal_token=internal_token)
    frontend = frontend_options(args, security, metrics_ports["orchestrator"])
    ready = _ReadyLine(args.host, pools_description(backend, pools))
    try:
        run_orchestrator(args.target, orchestrator, f"{args.host}:{args.port}", frontend, ready)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    finally:
        if uses_ray:
            import ray  # only with --backend ray: plain serving never loads Ray
            ray.shutdown()  # the replica actors belong to this driver and go with it
    return 0


def serve_pools_options(args: argparse.Namespace, security: Security, metrics_ports: dict[str, int | None]):
    """(PoolsOptions, the internal token this orchestrator's own replicas require) of `specmesh serve`."""
    from orchestrator.control import ray_cli as pools_cli
    from orchestrator.control.attached import attach_endpoints
    from orchestrator.control.launch import local_pools_options
    from orchestrator.distill.online import online_distill_options

    if pools_cli.backend_of(args) == "ray":
        # The API key where one is configured: orchestrators that join these pools hold it too.
        internal_token = security.api_key or new_internal_token()
        pools = pools_cli.pools_options(args, security, internal_token)
    else:
        internal_token = new_internal_token()  # only this deployment's orchestrator may call its replicas
        pools = local_pools_options(args, security, metrics_ports, internal_token)
    # Online distillation is a tool: handed to the pools from here, so control never imports it.
    pools = replace(pools, online_distill=online_distill_options(args))
    # A role given by address is not started (attached services get their own token); the backend runs the rest.
    return attach_endpoints(pools, args), internal_token


def frontend_options(args: argparse.Namespace, security: Security, metrics_port: int | None) -> FrontendOptions:
    """The orchestrator's client-facing servers under `specmesh serve`."""
    return FrontendOptions(host=args.host, http_port=args.http_port, metrics_port=metrics_port,
                           trace_exporter=args.trace_exporter, trace_sample_ratio=args.trace_sample_ratio,
                           tls=security.server_tls, api_key=security.api_key, shutdown_grace_s=args.shutdown_grace,
                           max_request_bytes=args.max_request_bytes,
                           connection_limits=connection_limits_from_args(args))


def pools_description(backend: str, pools) -> str:
    """What serves the roles, for the ready line: replicas serve starts (of `backend`), attached services, or both."""
    started = "Ray replica pools" if backend == "ray" else "local replica processes"
    if not pools.attached:
        return started
    return f"{started} and attached services" if (pools.target or pools.draft) is not None else "attached services"


class _ReadyLine:
    """Receives the orchestrator's readiness report and prints the ready line (or the error)."""

    def __init__(self, host: str, pools: str):
        self.host, self.pools = host, pools

    def put(self, ready: Ready) -> None:
        if ready.error:
            print(f"specmesh serve: {ready.error}", file=sys.stderr, flush=True)
            return
        from orchestrator.control.launch import ready_message

        print(ready_message(self.host, ready) + f" ({self.pools}; 'specmesh replicas' lists them)", flush=True)
        if ready.replica_addresses:
            print("internal services (the orchestrator's token required): " + ", ".join(
                f"{name} {address}" for name, address in sorted(ready.replica_addresses.items())), flush=True)
        ports = dict(ready.replica_metrics_ports or {})
        if ready.metrics_port is not None:
            ports["orchestrator"] = ready.metrics_port
        if ports:
            print("metrics: " + ", ".join(f"{name} http://{self.host}:{port}/metrics"
                                          for name, port in sorted(ports.items())), flush=True)


def metrics_ports_of(base: int | None) -> dict[str, int | None]:
    """The orchestrator on `base`, the target and the draft on the next two (0: any free ports)."""
    if base is None or base < 0:
        return dict.fromkeys(("orchestrator", "target", "draft"))
    offsets = {"orchestrator": 0, "target": 1, "draft": 2}
    return {name: base + offset if base else 0 for name, offset in offsets.items()}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = build_parser(client_only=bool(argv) and argv[0] in CLIENT_COMMANDS).parse_args(argv)
    except ConfigError as error:  # before anything starts; one line, argparse's exit status
        print(f"specmesh serve: error: {error}", file=sys.stderr)  # only serve reads a config file
        return 2
    try:
        if args.command == "serve":
            return serve(args)
        if args.command in CLIENT_COMMANDS:
            return args.handler(args)
        if args.command == "bench":
            from orchestrator.bench.app import run as run_bench  # matplotlib and torch only when benchmarking
            return run_bench(args)
        if args.command == "distill":
            from orchestrator.distill.app import run as run_distill  # torch, peft and matplotlib only when distilling
            return run_distill(args)
        raise AssertionError(f"unhandled command {args.command}")  # argparse admits only the commands above
    except SecurityConfigError as error:
        print(f"specmesh {args.command}: {error}", file=sys.stderr)
        return 2
    except ConfigError as error:  # settings that contradict each other, found once they are combined
        print(f"specmesh {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
