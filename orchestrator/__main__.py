"""Run the orchestrator alone against running services:
python -m orchestrator --target HOST:PORT [--draft HOST:PORT] --port 50051."""

from __future__ import annotations

import argparse
import asyncio
import logging

from orchestrator.loop import LoopConfig
from orchestrator.server import OrchestratorOptions, create_server
from specmesh.models import load_tokenizer
from specmesh.server import serve_until_signal


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m orchestrator", description=__doc__)
    parser.add_argument("--target", required=True, help="target service endpoint host:port")
    parser.add_argument("--draft", default=None, help="draft service endpoint host:port (omit: target-only)")
    parser.add_argument("--tokenizer", default="qwen2.5-coder-1.5b", help="the target model's spec")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=50051)
    parser.add_argument("--num-speculative-tokens", type=int, default=LoopConfig.num_speculative_tokens)
    parser.add_argument("--draft-timeout", type=float, default=LoopConfig.draft_timeout_s)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s orchestrator %(levelname)s %(message)s")
    options = OrchestratorOptions(args.target, args.draft, LoopConfig(
        num_speculative_tokens=args.num_speculative_tokens, draft_timeout_s=args.draft_timeout))
    asyncio.run(_serve(args.tokenizer, options, f"{args.host}:{args.port}"))


async def _serve(tokenizer_spec: str, options: OrchestratorOptions, address: str) -> None:
    server, port, health = await create_server(load_tokenizer(tokenizer_spec), options, address)
    print(f"orchestrator listening on {address.rsplit(':', 1)[0]}:{port}", flush=True)
    await serve_until_signal(server, health)


if __name__ == "__main__":
    main()
