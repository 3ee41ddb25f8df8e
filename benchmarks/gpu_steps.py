"""What one engine step costs with graph steps on and off: the measurement behind `graph-steps: auto`.

    python -m benchmarks.gpu_steps --model DIR --trust-remote-code --json steps.json

Loads the model once, then for each mode (specmesh.engine.graph_steps "on": static steps over preallocated
KV, replayed as CUDA graphs on CUDA; "off": the eager ragged step over growing caches) opens
`sessions` sessions of CONTEXT_TOKENS cached tokens and times the engine's step of `rows` rows for
each of them (a decode is 1 row, a verification of k drafts k + 1), rolled back after each step so
every step sees the same lengths. Prints and writes median ms per (sessions, rows).
`benchmarks/gpu_speculation.py` runs it on the set-acceptance target.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from specmesh.engine.batching import Part
from specmesh.engine.model_engine import EngineConfig, ModelEngine
from specmesh.engine.kv_budget import KVCacheMemory
from specmesh.loading.precision import load_model_in
from specmesh.engine.sampling_params import SamplingParams

CONTEXT_TOKENS = 128
SHAPES = [(1, 1), (1, 5), (1, 8), (16, 1), (16, 5), (64, 1)]  # (sessions, rows)
KV_BYTES = 8 * 2**30  # enough for 64 sessions of a 7B-class model's short contexts; the rest stays free


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per shape")
    parser.add_argument("--shapes", default=",".join(f"{s}x{r}" for s, r in SHAPES), help="sessions x rows, ...")
    parser.add_argument("--kv-bytes", type=int, default=KV_BYTES)
    parser.add_argument("--json", type=Path, default=None)
    return parser.parse_args(argv)


def time_shape(engine: ModelEngine, sessions: int, rows: int, steps: int) -> float:
    """Median ms of the engine's step over `sessions` sessions feeding `rows` rows each."""
    opened = [engine.new_session(f"s{sessions}x{rows}-{i}", [100 + i] * CONTEXT_TOKENS, SamplingParams(0.0))
              for i in range(sessions)]
    try:
        for session in opened:
            engine.forward(session, session.token_ids[:-1], 1)  # all but the newest token cached
        parts = [Part(session, session.token_ids[-1:] + [7] * (rows - 1), rows) for session in opened]
        times = []
        for _ in range(steps + 2):  # the first two settle allocations (and capture a shape not captured yet)
            start = time.perf_counter()
            engine._run_step(parts)  # returns logits on the CPU: the step has finished
            times.append(time.perf_counter() - start)
            for session in opened:
                session.cache.crop(-rows)
        return statistics.median(times[2:]) * 1e3
    finally:
        for session in opened:
            engine.close(session.request_id)


def measure(args: argparse.Namespace) -> dict:
    model, tokenizer = load_model_in(args.model, args.device, args.dtype, trust_remote_code=args.trust_remote_code)
    shapes = [tuple(int(n) for n in shape.split("x")) for shape in args.shapes.split(",")]
    result = {"model": args.model, "device": args.device, "dtype": args.dtype, "context_tokens": CONTEXT_TOKENS,
              "ms": {}}
    for mode in ("off", "on"):
        sessions = max(s for s, _ in shapes)
        config = EngineConfig(model_name=args.model, max_sessions=sessions, max_sessions_per_caller=sessions,
                              kv_cache_memory=KVCacheMemory(bytes=args.kv_bytes), graph_steps=mode)
        engine = ModelEngine(model, tokenizer, config)
        engine.warm_up()
        result["ms"][mode] = {f"{s}x{r}": round(time_shape(engine, s, r, args.steps), 3) for s, r in shapes}
        del engine
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    return result


def lines(result: dict) -> list[str]:
    out = [f"engine step, median ms ({result['dtype']}, {result['context_tokens']} cached tokens a session):",
           f"  {'sessions x rows':>16} {'graph steps off':>16} {'on':>8} {'speed-up':>9}"]
    for shape, off in result["ms"]["off"].items():
        on = result["ms"]["on"][shape]
        out.append(f"  {shape:>16} {off:16.2f} {on:8.2f} {off / on:8.2f}x")
    return out


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    result = measure(args)
    print("\n".join(lines(result)), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
