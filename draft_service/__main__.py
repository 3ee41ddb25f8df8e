"""Run the draft service alone: python -m draft_service --model M --port P."""

from __future__ import annotations

import argparse
import asyncio
import logging

from specmesh.loading import openmp
from specmesh.roles import DRAFT

openmp.set_spin_count(DRAFT)  # before torch loads OpenMP (specmesh.server.service imports it)

from draft_service.server import create_replica_server  # noqa: E402
from specmesh.server.service import (ReplicaConfig, add_service_arguments, announce, load_engine, options_from_args,
                                     run_model_service)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m draft_service", description=__doc__)
    add_service_arguments(parser, default_model=DRAFT.default_model)
    parser.add_argument("--greedy-proposals", action="store_true",
                        help="propose argmax tokens (point masses) even when the request samples")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s draft %(levelname)s %(message)s")
    config = ReplicaConfig(DRAFT.name, options_from_args(args), greedy_proposals=args.greedy_proposals)
    engine = load_engine(config.service, config.role)
    asyncio.run(run_model_service(config, engine, create_replica_server, lambda port, metrics_port: announce(
        "draft", config.service.host, port, metrics_port)))


if __name__ == "__main__":
    main()
