"""Run the target service alone: python -m target_service --model M --port P."""

from __future__ import annotations

import argparse
import asyncio
import logging

from specmesh.roles import TARGET
from specmesh.service import (ReplicaConfig, add_service_arguments, announce, load_engine, options_from_args,
                              run_model_service)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m target_service", description=__doc__)
    add_service_arguments(parser, default_model=TARGET.default_model)
    parser.add_argument("--disagreement-log", default=None, metavar="PATH",
                        help="append rejected draft tokens to this JSONL file")
    parser.add_argument("--disagreement-log-rate", type=float, default=100.0, help="records per second at most")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s target %(levelname)s %(message)s")
    log = (args.disagreement_log, args.disagreement_log_rate) if args.disagreement_log else None
    config = ReplicaConfig(TARGET.name, options_from_args(args), disagreement_log=log)
    engine = load_engine(config.service, config.role)
    asyncio.run(run_model_service(config, engine, lambda port, metrics_port: announce(
        "target", config.service.host, port, metrics_port)))


if __name__ == "__main__":
    main()
