"""Run the target service alone: python -m target_service --model M --port P."""

from __future__ import annotations

import argparse
import asyncio
import logging

from specmesh.roles import TARGET
from specmesh.server.service import (ReplicaConfig, add_service_arguments, announce, load_engine, options_from_args,
                                     run_model_service)
from target_service.disagreements import add_disagreement_log_arguments, disagreement_log_settings
from target_service.server import create_replica_server


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m target_service", description=__doc__)
    add_service_arguments(parser, default_model=TARGET.default_model)
    add_disagreement_log_arguments(parser)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s target %(levelname)s %(message)s")
    config = ReplicaConfig(TARGET.name, options_from_args(args), disagreement_log=disagreement_log_settings(args))
    engine = load_engine(config.service, config.role)
    asyncio.run(run_model_service(config, engine, create_replica_server, lambda port, metrics_port: announce(
        "target", config.service.host, port, metrics_port)))


if __name__ == "__main__":
    main()
