"""Core benchmark: speculative vs target-only through specmesh, and transformers' assisted generation.

Greedy decoding of a fixed prompt set on one model pair. Phase 1 serves the pair
with specmesh (draft, target and orchestrator as three processes, as `specmesh
serve` does) and runs every prompt target-only and speculative. Phase 2 stops
them and runs transformers' `generate` in-process on the same pair and prompts,
target-only and with `assistant_model=`. Prints one table; figures are totals
over the prompt set plus the median of the per-prompt speedups.

    python benchmarks/bench_core.py                      # the embedded Qwen2.5-Coder pair
    python benchmarks/bench_core.py --target DIR --draft DIR --max-tokens 64 --k 2
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import statistics
import time
from dataclasses import dataclass, field

import grpc
import torch

from orchestrator.bench.peer import PeerPair, hf_generate
from orchestrator.deployment.launch import ProcessGroup, StackOptions, start_stack
from orchestrator.frontend.options import FrontendOptions
from orchestrator.decoding.request import LoopConfig
from specmesh.precision import DTYPE_CHOICES
from specmesh.service import ServiceOptions
from specmesh.v1 import generation_pb2, generation_pb2_grpc

PROMPTS = [
    "def quicksort(arr):",
    "# Python function that checks whether a string is a palindrome\ndef is_palindrome(s):",
    "class LinkedList:\n    def __init__(self):",
    "Write a short explanation of what a hash map is and when to use one.",
    "import json\n\ndef load_config(path):\n    \"\"\"Read a JSON config file and return it as a dict.\"\"\"",
    "SELECT name, COUNT(*) FROM orders",
]


@dataclass
class Run:
    name: str
    tokens: list[int] = field(default_factory=list)  # generated tokens per prompt
    seconds: list[float] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0

    @property
    def tokens_per_s(self) -> float:
        return sum(self.tokens) / sum(self.seconds)

    def per_prompt_rate(self) -> list[float]:
        return [n / s for n, s in zip(self.tokens, self.seconds)]


async def run_specmesh(endpoint: str, prompts: list[str], max_tokens: int, speculation: bool, k: int) -> Run:
    run = Run(f"specmesh speculative (k={k})" if speculation else "specmesh target-only")
    async with grpc.aio.insecure_channel(endpoint) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        for prompt in prompts:
            request = generation_pb2.GenerateRequest(prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                                                     speculation=speculation, num_speculative_tokens=k)
            start, token_ids = time.perf_counter(), []
            async for response in stub.Generate(request, timeout=3600):
                token_ids.extend(response.token_ids)
                last = response
            run.seconds.append(time.perf_counter() - start)
            run.tokens.append(len(token_ids))
            run.outputs.append(token_ids)
            run.drafted += last.stats.draft_tokens
            run.accepted += last.stats.accepted_tokens
            run.rounds += last.stats.rounds
    return run


def phase_specmesh(args) -> tuple[Run, list[Run]]:
    group = ProcessGroup()
    try:
        options = StackOptions(
            target=ServiceOptions(model=args.target, device=args.device, dtype=args.target_dtype),
            draft=ServiceOptions(model=args.draft, device=args.draft_device or args.device, dtype=args.draft_dtype),
            loop=LoopConfig(), address="127.0.0.1:0", orchestrator=FrontendOptions())
        endpoint = f"127.0.0.1:{start_stack(group, options)['orchestrator'].port}"
        asyncio.run(run_specmesh(endpoint, PROMPTS[:1], 8, True, args.k[0]))  # warm-up
        baseline = asyncio.run(run_specmesh(endpoint, args.prompts, args.max_tokens, False, 0))
        speculative = [asyncio.run(run_specmesh(endpoint, args.prompts, args.max_tokens, True, k)) for k in args.k]
        return baseline, speculative
    finally:
        group.stop()


def phase_transformers(args) -> tuple[Run, Run]:
    draft_device = args.draft_device or args.device
    pair = PeerPair.load(args.target, args.draft, args.device, draft_device, args.target_dtype, args.draft_dtype)
    baseline, assisted = Run("transformers target-only"), Run(f"transformers assisted (k={args.assisted_k})")
    generate(pair, PROMPTS[:1], 8, Run("warm-up"), None)
    generate(pair, args.prompts, args.max_tokens, baseline, None)
    generate(pair, args.prompts, args.max_tokens, assisted, args.assisted_k)
    del pair
    gc.collect()
    return baseline, assisted


def generate(pair: PeerPair, prompts, max_tokens, run: Run, k: int | None) -> None:
    """Greedy transformers `generate` per prompt (the target alone when k is None, else assisted), timed."""
    for prompt in prompts:
        start = time.perf_counter()
        generated = hf_generate(pair, pair.tokenizer.encode(prompt), max_tokens, k)
        run.seconds.append(time.perf_counter() - start)
        run.tokens.append(len(generated))
        run.outputs.append(generated)


def report(runs: list[Run], baselines: dict[str, Run], args) -> dict:
    print(f"\nmachine: {platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads, "
          f"device {args.device}; target {args.target} ({args.target_dtype}), draft {args.draft} "
          f"({args.draft_dtype}), greedy, {len(args.prompts)} prompts x {args.max_tokens} max tokens\n")
    header = f"{'method':<34}{'tokens/s':>10}{'accept':>9}{'tok/round':>11}{'speedup':>9}{'median':>8}"
    print(header + "\n" + "-" * len(header))
    rows = {}
    for run in runs:
        base = baselines[run.name]
        speedup = run.tokens_per_s / base.tokens_per_s
        median = statistics.median(r / b for r, b in zip(run.per_prompt_rate(), base.per_prompt_rate()))
        acceptance = run.accepted / run.drafted if run.drafted else float("nan")
        per_round = (sum(run.tokens) - len(run.tokens)) / run.rounds if run.rounds else float("nan")
        print(f"{run.name:<34}{run.tokens_per_s:>10.2f}{acceptance:>9.2f}{per_round:>11.2f}"
              f"{speedup:>8.2f}x{median:>7.2f}x")
        rows[run.name] = {"tokens_per_s": run.tokens_per_s, "acceptance": acceptance,
                          "tokens_per_round": per_round, "speedup": speedup, "median_speedup": median}
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--draft-device", default=None)
    parser.add_argument("--k", type=int, nargs="+", default=[LoopConfig.num_speculative_tokens],
                        help="draft tokens per round; several values run one after another")
    parser.add_argument("--assisted-k", type=int, default=None,
                        help="transformers' num_assistant_tokens (constant schedule); default: the first --k")
    parser.add_argument("--target-dtype", default="float32", choices=DTYPE_CHOICES)
    parser.add_argument("--draft-dtype", default="auto", choices=DTYPE_CHOICES)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--num-prompts", type=int, default=len(PROMPTS))
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    args.prompts = PROMPTS[: args.num_prompts]
    args.assisted_k = args.assisted_k or args.k[0]
    spec_base, speculative = phase_specmesh(args)
    runs = [spec_base, *speculative]
    baselines = {run.name: spec_base for run in runs}
    if not args.skip_transformers:
        hf_base, assisted = phase_transformers(args)
        runs += [hf_base, assisted]
        baselines.update({hf_base.name: hf_base, assisted.name: hf_base})
        for run in speculative:
            same = sum(a == b for a, b in zip(run.outputs, hf_base.outputs))
            print(f"{run.name}: output identical to transformers' greedy target on {same}/{len(args.prompts)} prompts")
    rows = report(runs, baselines, args)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=2)


if __name__ == "__main__":
    main()
