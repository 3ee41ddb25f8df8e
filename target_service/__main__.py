"""Run the target service alone: python -m target_service --model M --port P."""

from __future__ import annotations

import argparse
import asyncio
import logging

from specmesh.service import add_service_arguments, load_engine, options_from_args, run_model_service
from target_service.server import create_server


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m target_service", description=__doc__)
    add_service_arguments(parser, default_model="qwen2.5-coder-1.5b")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s target %(levelname)s %(message)s")
    options = options_from_args(args)
    engine = load_engine(options, generator_salt=0)
    asyncio.run(run_model_service(create_server, engine, options,
                                  lambda port: print(f"target service listening on {options.host}:{port}",
                                                     flush=True)))


if __name__ == "__main__":
    main()
