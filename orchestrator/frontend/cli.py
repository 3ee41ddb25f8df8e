"""The `specmesh` command: serve the three services, or generate against a running server."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

import grpc

from orchestrator.frontend import stats_view
from orchestrator.bench import args as bench_args
from orchestrator.distill import args as distill_args
from orchestrator.deployment.clients import add_client_arguments, client_channel
from orchestrator.deployment import ray_cli as pools_cli
from orchestrator.deployment.backends import OrchestratorOptions
from orchestrator.deployment.launch import Ready, local_pools_options, ready_message, run_orchestrator
from orchestrator.decoding.options import loop_config
from orchestrator.frontend.config_file import ConfigError, ConfigurableParser
from orchestrator.frontend.options import FrontendOptions
from orchestrator.frontend.serve_args import add_serve_parser
from orchestrator.frontend.servicer import FINISH_REASON_NAMES
from specmesh.connections import connection_limits_from_args
from specmesh.security import Security, SecurityConfigError, new_internal_token, security_from_args
from specmesh.v1 import admin_pb2, admin_pb2_grpc, generation_pb2, generation_pb2_grpc


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specmesh", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=ConfigurableParser)
    add_serve_parser(commands)
    generate = commands.add_parser("generate", help="stream a completion from a running server")
    generate.add_argument("prompt")
    generate.add_argument("--max-tokens", type=int, default=128)
    generate.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default here)")
    generate.add_argument("--top-k", type=int, default=None)
    generate.add_argument("--top-p", type=float, default=None)
    generate.add_argument("--seed", type=int, default=None)
    generate.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    generate.add_argument("--num-speculative-tokens", type=int, default=None)
    generate.add_argument("--no-speculation", action="store_true", help="target-only decoding")
    generate.add_argument("--timeout", type=float, default=600.0, help="deadline in seconds")
    generate.add_argument("--json", action="store_true", help="print one JSON object at the end")
    add_client_arguments(generate)
    stats_view.add_parser(commands)
    bench_args.add_parser(commands)
    distill_args.add_parser(commands)
    speculation = commands.add_parser("speculation", help="turn speculative decoding on or off server-wide")
    speculation.add_argument("state", choices=["on", "off", "status"])
    add_client_arguments(speculation)
    pools_cli.add_parsers(commands)
    return parser


def serve(args: argparse.Namespace) -> int:
    """Both backends: build the pools' options, then run the orchestrator (and through it the pools) here."""
    security = security_from_args(args)  # before anything starts: a bad TLS file fails here, naming its flag
    metrics_ports = metrics_ports_of(args.metrics_port)
    backend = pools_cli.backend_of(args)
    if backend == "ray":
        # The API key where one is configured: orchestrators that join these pools hold it too.
        internal_token = security.api_key or new_internal_token()
        pools = pools_cli.pools_options(args, security, internal_token)
        pools_cli.init_ray(args.address, args.ray_namespace, pools)
    else:
        internal_token = new_internal_token()  # only this deployment's orchestrator may call its replicas
        pools = local_pools_options(args, security, metrics_ports, internal_token)
    orchestrator = OrchestratorOptions("", None, loop_config(args), pools=pools, internal_token=internal_token)
    frontend = frontend_options(args, security, metrics_ports["orchestrator"])
    ready = _ReadyLine(args.host, backend)
    try:
        run_orchestrator(args.target, orchestrator, f"{args.host}:{args.port}", frontend, ready)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    finally:
        if backend == "ray":
            import ray  # only with --backend ray: plain serving never loads Ray
            ray.shutdown()  # the replica actors belong to this driver and go with it
    return 0


def frontend_options(args: argparse.Namespace, security: Security, metrics_port: int | None) -> FrontendOptions:
    """The orchestrator's client-facing servers under `specmesh serve`."""
    return FrontendOptions(host=args.host, http_port=args.http_port, metrics_port=metrics_port,
                           trace_exporter=args.trace_exporter, trace_sample_ratio=args.trace_sample_ratio,
                           tls=security.server_tls, api_key=security.api_key, shutdown_grace_s=args.shutdown_grace,
                           max_request_bytes=args.max_request_bytes,
                           connection_limits=connection_limits_from_args(args))


class _ReadyLine:
    """Receives the orchestrator's readiness report and prints the ready line (or the error)."""

    def __init__(self, host: str, backend: str):
        self.host, self.backend = host, backend

    def put(self, ready: Ready) -> None:
        if ready.error:
            print(f"specmesh serve: {ready.error}", file=sys.stderr, flush=True)
            return
        pools = "Ray replica pools" if self.backend == "ray" else "local replica processes"
        print(ready_message(self.host, ready) + f" ({pools}; 'specmesh replicas' lists them)", flush=True)
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


def generate_request(args: argparse.Namespace) -> generation_pb2.GenerateRequest:
    request = generation_pb2.GenerateRequest(prompt=args.prompt, max_tokens=args.max_tokens,
                                             temperature=args.temperature, stop=args.stop)
    for field in ("top_k", "top_p", "seed", "num_speculative_tokens"):
        if getattr(args, field) is not None:
            setattr(request, field, getattr(args, field))
    if args.no_speculation:
        request.speculation = False
    return request


async def generate(args: argparse.Namespace) -> int:
    text, token_ids, last = [], [], None
    channel, metadata = client_channel(args)
    async with channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        try:
            async for response in stub.Generate(generate_request(args), timeout=args.timeout, metadata=metadata):
                text.append(response.text)
                token_ids.extend(response.token_ids)
                last = response
                if not args.json:
                    print(response.text, end="", flush=True)
        except grpc.aio.AioRpcError as error:
            print(f"\nspecmesh generate: {error.code().name}: {error.details()}", file=sys.stderr)
            return 2
    if args.json:
        stats = {f.name: getattr(last.stats, f.name) for f in last.stats.DESCRIPTOR.fields}
        print(json.dumps({"text": "".join(text), "token_ids": token_ids,
                          "finish_reason": FINISH_REASON_NAMES.get(last.finish_reason, ""), "stats": stats}))
    else:
        print()
    return 0


async def set_speculation(args: argparse.Namespace) -> int:
    channel, metadata = client_channel(args)
    async with channel:
        stub = admin_pb2_grpc.AdminStub(channel)
        try:
            if args.state == "status":
                state = await stub.GetSpeculation(admin_pb2.GetSpeculationRequest(), timeout=10, metadata=metadata)
            else:
                state = await stub.SetSpeculation(admin_pb2.SetSpeculationRequest(enabled=args.state == "on"),
                                                  timeout=10, metadata=metadata)
        except grpc.aio.AioRpcError as error:
            print(f"specmesh speculation: {error.code().name}: {error.details()}", file=sys.stderr)
            return 2
    print(f"speculation {'on' if state.enabled else 'off'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except ConfigError as error:  # before anything starts; one line, argparse's exit status
        print(f"specmesh serve: error: {error}", file=sys.stderr)  # only serve reads a config file
        return 2
    try:
        if args.command == "serve":
            return serve(args)
        if args.command in ("stats", "scale", "replicas", "rollout"):
            return args.handler(args)
        if args.command == "bench":
            from orchestrator.bench.app import run as run_bench  # matplotlib and torch only when benchmarking
            return run_bench(args)
        if args.command == "distill":
            from orchestrator.distill.app import run as run_distill  # torch, peft and matplotlib only when distilling
            return run_distill(args)
        if args.command == "speculation":
            return asyncio.run(set_speculation(args))
        return asyncio.run(generate(args))
    except SecurityConfigError as error:
        print(f"specmesh {args.command}: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
