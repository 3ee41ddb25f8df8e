"""Run the orchestrator alone against running services:
python -m orchestrator --target HOST:PORT [--draft HOST:PORT] --port 50051."""

from __future__ import annotations

import argparse
import logging
import sys

from orchestrator.cli import add_pipeline_arguments, loop_config
from orchestrator.launcher import Ready, run_orchestrator
from orchestrator.loop import LoopConfig
from orchestrator.server import OrchestratorOptions
from specmesh.service import ServiceOptions, add_telemetry_arguments, announce


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m orchestrator", description=__doc__)
    parser.add_argument("--target", required=True, help="target service endpoint host:port")
    parser.add_argument("--draft", default=None, help="draft service endpoint host:port (omit: target-only)")
    parser.add_argument("--tokenizer", default="qwen2.5-coder-1.5b", help="the target model's spec")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=50051)
    parser.add_argument("--http-port", type=int, default=None, help="OpenAI-compatible HTTP API port")
    parser.add_argument("--num-speculative-tokens", type=int, default=LoopConfig.num_speculative_tokens)
    parser.add_argument("--draft-timeout", type=float, default=LoopConfig.draft_timeout_s)
    add_pipeline_arguments(parser)
    add_telemetry_arguments(parser, default_metrics_port=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s orchestrator %(levelname)s %(message)s")
    options = OrchestratorOptions(args.target, args.draft, loop_config(args))
    telemetry = ServiceOptions(model=args.tokenizer, host=args.host, metrics_port=args.metrics_port,
                               trace_exporter=args.trace_exporter, trace_sample_ratio=args.trace_sample_ratio,
                               http_port=args.http_port)
    run_orchestrator(args.tokenizer, options, f"{args.host}:{args.port}", telemetry, _Announce(args.host))


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
