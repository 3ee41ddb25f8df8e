"""Run the target service alone: python -m target_service --model M --port P."""

from __future__ import annotations

import argparse
import asyncio
import logging

from specmesh.service import add_service_arguments, announce, load_engine, options_from_args, run_model_service
from target_service.disagreements import DisagreementLog
from target_service.server import create_server


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m target_service", description=__doc__)
    add_service_arguments(parser, default_model="qwen2.5-coder-1.5b")
    parser.add_argument("--disagreement-log", default=None, metavar="PATH",
                        help="append rejected draft tokens to this JSONL file")
    parser.add_argument("--disagreement-log-rate", type=float, default=100.0, help="records per second at most")
    parser.add_argument("--disagreement-log-context", action="store_true",
                        help="also log each rejection's context token ids (what `specmesh distill` trains on)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s target %(levelname)s %(message)s")
    options = options_from_args(args)
    engine = load_engine(options, generator_salt=0)
    disagreements = (DisagreementLog(args.disagreement_log, args.disagreement_log_rate,
                                     include_context=args.disagreement_log_context)
                     if args.disagreement_log else None)
    asyncio.run(run_model_service("target", create_server, engine, options,
                                  lambda port, metrics_port: announce("target", options.host, port, metrics_port),
                                  disagreements=disagreements))


if __name__ == "__main__":
    main()
