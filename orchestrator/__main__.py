"""Run the orchestrator alone against running services:
python -m orchestrator --target HOST:PORT [--draft HOST:PORT] --port 50051, or against the
replica pools that `specmesh serve --backend ray` runs on a Ray cluster:
python -m orchestrator --ray-address HEAD:6379 --tokenizer MODEL --port 50052.

The --tls-cert/--tls-key/--tls-ca flags secure the client-facing port; --tls-root-ca and
--tls-client-cert/--tls-client-key the channels to the draft and target services, which get
the internal token from --internal-token-file or SPECMESH_INTERNAL_TOKEN (default: the API
key, which is the token of the pools `specmesh serve --api-key` runs on Ray)."""

from __future__ import annotations

import argparse
import logging
import sys

from orchestrator.control.launch import Ready, run_orchestrator
from orchestrator.control.build import OrchestratorOptions
from orchestrator.control.ray_cli import init_ray
from orchestrator.control.options import PoolsOptions
from orchestrator.decoding.options import add_loop_arguments, loop_config
from specmesh.server.security import (SecurityConfigError, add_api_key_arguments, add_client_tls_arguments,
                                      add_internal_token_arguments, add_server_tls_arguments, api_key_from_args,
                                      client_tls_from_args, internal_token_from_args, server_tls_from_args)
from specmesh.server.drain import add_shutdown_arguments
from orchestrator.serving.options import FrontendOptions
from specmesh.server.service import add_request_limit_argument, add_telemetry_arguments, announce


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m orchestrator", description=__doc__)
    parser.add_argument("--target", default=None, help="target service endpoint host:port")
    parser.add_argument("--draft", default=None, help="draft service endpoint host:port (omit: target-only)")
    parser.add_argument("--tokenizer", default="qwen2.5-coder-1.5b", help="the target model's spec")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=50051)
    parser.add_argument("--http-port", type=int, default=None, help="OpenAI-compatible HTTP API port")
    add_request_limit_argument(parser)
    add_loop_arguments(parser)
    parser.add_argument("--ray-address", default=None,
                        help="join the Ray replica pools on this cluster instead of --target/--draft")
    parser.add_argument("--ray-namespace", default="specmesh")
    add_telemetry_arguments(parser, default_metrics_port=None)
    add_server_tls_arguments(parser)
    add_client_tls_arguments(parser)
    add_api_key_arguments(parser, serving=True)
    add_internal_token_arguments(parser, serving=False)
    add_shutdown_arguments(parser)
    args = parser.parse_args()
    if (args.target is None) == (args.ray_address is None):
        parser.error("give exactly one of --target and --ray-address")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s orchestrator %(levelname)s %(message)s")
    try:
        tls, channel_tls, api_key = server_tls_from_args(args), client_tls_from_args(args), api_key_from_args(args)
        internal_token = internal_token_from_args(args) or api_key
    except SecurityConfigError as error:
        parser.error(str(error))
    options = OrchestratorOptions(args.target or "", args.draft, loop_config(args), channel_tls,
                                  pools=_join_pools(args.ray_address, args.ray_namespace) if args.ray_address else None,
                                  internal_token=internal_token)
    frontend = FrontendOptions(host=args.host, http_port=args.http_port, metrics_port=args.metrics_port,
                               trace_exporter=args.trace_exporter, trace_sample_ratio=args.trace_sample_ratio,
                               tls=tls, api_key=api_key, shutdown_grace_s=args.shutdown_grace,
                               max_request_bytes=args.max_request_bytes)
    run_orchestrator(args.tokenizer, options, f"{args.host}:{args.port}", frontend, _Announce(args.host))


def _join_pools(address: str, namespace: str):
    init_ray(address, namespace)
    return PoolsOptions(backend="ray", namespace=namespace)  # no pool specs: discover the replicas, own none


class _Announce:
    """Receives the launcher's readiness report and prints it."""

    def __init__(self, host: str):
        self.host = host

    def put(self, ready: Ready) -> None:
        if ready.error:
            print(f"orchestrator failed to start: {ready.error}", file=sys.stderr, flush=True)
        else:
            announce("orchestrator", self.host, ready.port, ready.metrics_port)


if __name__ == "__main__":
    main()
