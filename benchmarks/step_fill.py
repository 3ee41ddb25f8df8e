"""How full the services' steps are under concurrent load: sessions and rows a step, steps a second, busy share.

    python -m benchmarks.step_fill --endpoint 127.0.0.1:PORT --target-metrics URL --draft-metrics URL \\
        --concurrency 8 --modes off on k=3 k=4 --seconds 15

Against a running stack (`python -m benchmarks.regime_stack` prints its endpoint; the services' metrics
addresses are in their logs under its work folder): for each mode in turn, `concurrency` clients each send
greedy requests of `max_tokens` tokens, one after another, for `seconds`; each request has a prompt of its
own (numbered, twelve words drawn at random; the same prompts in every mode). The services' step counters
(`specmesh_step_rows`, `specmesh_step_sessions`, `specmesh_step_busy_seconds_total`) are read before and
after. Modes, as `specmesh bench` names them: `off` (speculation off), `on` (the server's policy), `k=N` (N draft
tokens every round).

The bound of the regime benchmark assumes that every session in flight boards each of the target's steps;
this says how many do.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

from benchmarks.regime_report import SERVICE_BUSY, SERVICE_SESSIONS, SERVICE_STEPS, scrape, total
from orchestrator.bench.modes import DEFAULT, OFF, fixed_k, request_speculation
from orchestrator.serving.clients import open_channel
from specmesh.v1 import generation_pb2, generation_pb2_grpc

WORDS = ("river stone maple quick silver lantern orbit basil copper thunder velvet prism harbor cedar falcon "
         "meadow ember quartz willow signal").split()
COUNTERS = {"steps": SERVICE_STEPS, "rows": "specmesh_step_rows_sum", "sessions": SERVICE_SESSIONS,
            "busy_s": SERVICE_BUSY}


def prompts(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [f"Note {i}: " + " ".join(rng.choice(WORDS) for _ in range(12)) for i in range(count)]


def step_counters(url: str) -> dict[str, float]:
    samples = scrape(url)
    return {key: total(samples, name) for key, name in COUNTERS.items()}


def fill(before: dict[str, float], after: dict[str, float], seconds: float) -> dict[str, float]:
    """A service's steps over the stretch between two reads of its counters."""
    delta = {key: after[key] - before[key] for key in COUNTERS}
    steps = max(delta["steps"], 1.0)
    return {"steps_per_s": delta["steps"] / seconds, "sessions_per_step": delta["sessions"] / steps,
            "rows_per_step": delta["rows"] / steps, "busy": delta["busy_s"] / seconds}


async def load(endpoint: str, mode: str, concurrency: int, max_tokens: int, seconds: float) -> dict[str, float]:
    """Closed-loop clients for `seconds`: (requests, committed tokens, wall seconds)."""
    speculation, k = request_speculation(mode, None)
    stub = generation_pb2_grpc.GenerationStub(open_channel(endpoint))
    texts = prompts(4096)
    end, counted = time.monotonic() + seconds, {"requests": 0, "tokens": 0}

    async def client(index: int) -> None:
        for prompt in texts[index::concurrency]:
            if time.monotonic() >= end:
                return
            request = generation_pb2.GenerateRequest(prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                                                     speculation=speculation)
            if k:
                request.num_speculative_tokens = k
            async for response in stub.Generate(request, timeout=60.0):
                counted["tokens"] += len(response.token_ids)
            counted["requests"] += 1

    started = time.monotonic()
    await asyncio.gather(*(client(i) for i in range(concurrency)))
    return {**counted, "seconds": time.monotonic() - started}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.step_fill", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--endpoint", required=True, help="the orchestrator's gRPC HOST:PORT")
    parser.add_argument("--target-metrics", required=True, help="the target service's /metrics URL")
    parser.add_argument("--draft-metrics", required=True, help="the draft service's /metrics URL")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--modes", nargs="+", default=[OFF, DEFAULT, fixed_k(4)])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--out", default=None, help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    rows = []
    print("| mode | tok/s | target steps/s | target sessions/step | target rows/step | target busy "
          "| draft steps/s | draft sessions/step | draft rows/step | draft busy |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    services = {"target": args.target_metrics, "draft": args.draft_metrics}
    for mode in args.modes:
        before = {role: step_counters(url) for role, url in services.items()}
        served = asyncio.run(load(args.endpoint, mode, args.concurrency, args.max_tokens, args.seconds))
        after = {role: step_counters(url) for role, url in services.items()}
        row = {"mode": mode, "concurrency": args.concurrency, **served,
               **{f"{role}_{key}": value for role in before
                  for key, value in fill(before[role], after[role], served["seconds"]).items()}}
        rows.append(row)
        print(f"| {mode} | {row['tokens'] / row['seconds']:.3g} | "
              + " | ".join(f"{row[f'{role}_steps_per_s']:.3g} | {row[f'{role}_sessions_per_step']:.2f} | "
                           f"{row[f'{role}_rows_per_step']:.1f} | {row[f'{role}_busy']:.2f}"
                           for role in services) + " |", flush=True)
    if args.out:
        with open(args.out, "w") as out:
            json.dump(rows, out, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
