"""Run the draft service alone: python -m draft_service --model M --port P."""

from __future__ import annotations

import argparse
import asyncio
import logging

from draft_service.server import create_server
from specmesh.service import add_service_arguments, announce, load_engine, options_from_args, run_model_service


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m draft_service", description=__doc__)
    add_service_arguments(parser, default_model="qwen2.5-coder-0.5b")
    parser.add_argument("--greedy-proposals", action="store_true",
                        help="propose argmax tokens (point masses) even when the request samples")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s draft %(levelname)s %(message)s")
    options = options_from_args(args)
    engine = load_engine(options, generator_salt=1)
    asyncio.run(run_model_service("draft", create_server, engine, options,
                                  lambda port, metrics_port: announce("draft", options.host, port, metrics_port),
                                  greedy_proposals=args.greedy_proposals))


if __name__ == "__main__":
    main()
