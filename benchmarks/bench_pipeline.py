"""Pipelined vs sequential speculation, with draft and target on separate compute.

Starts the target and the draft as processes pinned to their own CPU cores (or
devices), and two orchestrators over them: one sequential, one pipelined. Runs
the prompt set greedily at each concurrency through both and prints, per run:
tokens/s, the measured acceptance alpha, the measured costs (c_draft per draft
token, c_verify per verification of k+1 tokens, from the services' Prometheus
forward-time histograms), E = (1 - alpha^(k+1)) / (1 - alpha) tokens per round,
the analytic sequential bound E / (c_verify + k * c_draft) in tokens/s, each
run's ratio to it, the pre-draft hit rate and where the rounds' time went.

    python -m benchmarks.bench_pipeline                       # the embedded Qwen2.5-Coder pair, cores 0 and 1
    python -m benchmarks.bench_pipeline --target DIR --draft DIR --max-tokens 32 --k 3
    python -m benchmarks.bench_pipeline --device cuda --target-cpus 0-7 --draft-device cpu --draft-cpus 8-15
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
import urllib.request
from dataclasses import dataclass

import grpc
from prometheus_client.parser import text_string_to_metric_families

from orchestrator.control.launch import ProcessGroup, run_orchestrator, run_service
from orchestrator.serving.options import FrontendOptions
from specmesh.roles import START_TIMEOUT_S
from orchestrator.decoding.request import LoopConfig
from orchestrator.control.build import OrchestratorOptions
from orchestrator.decoding.timing import PARTS
from specmesh.loading.precision import DTYPE_CHOICES
from specmesh.server.service import ReplicaConfig, ServiceOptions, parse_cpu_list
from specmesh.v1 import generation_pb2, generation_pb2_grpc

PROMPTS = [
    "def quicksort(arr):",
    "# Python function that checks whether a string is a palindrome\ndef is_palindrome(s):",
    "class LinkedList:\n    def __init__(self):",
    "Write a short explanation of what a hash map is and when to use one.",
    "import json\n\ndef load_config(path):\n    \"\"\"Read a JSON config file and return it as a dict.\"\"\"",
    "SELECT name, COUNT(*) FROM orders",
]


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """Every sample of http://127.0.0.1:port/metrics, keyed by (name, sorted labels)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def total(samples: dict, name: str, **labels) -> float:
    return sum(v for (n, ls), v in samples.items() if n == name and all((k, x) in ls for k, x in labels.items()))


def delta(after: dict, before: dict, name: str, **labels) -> float:
    return total(after, name, **labels) - total(before, name, **labels)


@dataclass
class Run:
    mode: str
    concurrency: int
    tokens: int = 0
    seconds: float = 0.0
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0
    c_draft: float = float("nan")  # seconds per draft token (sequential Propose calls)
    c_verify: float = float("nan")  # seconds per verification
    hits: float = 0.0
    misses: float = 0.0
    parts: dict | None = None  # seconds per part of the round time breakdown

    @property
    def alpha(self) -> float:
        return self.accepted / self.drafted if self.drafted else float("nan")


async def generate_all(endpoint: str, prompts: list[str], max_tokens: int, k: int, concurrency: int, run: Run):
    limit = asyncio.Semaphore(concurrency)
    async with grpc.aio.insecure_channel(endpoint) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)

        async def one(prompt: str) -> None:
            async with limit:
                request = generation_pb2.GenerateRequest(prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                                                         num_speculative_tokens=k)
                async for response in stub.Generate(request, timeout=3600):
                    run.tokens += len(response.token_ids)
                    last = response
                run.drafted += last.stats.draft_tokens
                run.accepted += last.stats.accepted_tokens
                run.rounds += last.stats.rounds
        started = time.perf_counter()
        await asyncio.gather(*(one(p) for p in prompts))
        run.seconds = time.perf_counter() - started


def measure(mode: str, concurrency: int, endpoint: str, ports: dict[str, int], args) -> Run:
    run = Run(mode, concurrency)
    before = {name: scrape(port) for name, port in ports.items()}
    asyncio.run(generate_all(endpoint, args.prompts, args.max_tokens, args.k, concurrency, run))
    after = {name: scrape(port) for name, port in ports.items()}
    draft_s = delta(after["draft"], before["draft"], "specmesh_forward_seconds_sum", op="propose")
    if mode == "sequential" and run.drafted:
        run.c_draft = draft_s / run.drafted
    verifies = delta(after["target"], before["target"], "specmesh_forward_seconds_count", op="verify")
    if verifies:
        run.c_verify = delta(after["target"], before["target"], "specmesh_forward_seconds_sum", op="verify") / verifies
    orch_after, orch_before = after[mode], before[mode]
    run.hits = delta(orch_after, orch_before, "specmesh_predraft_hits_total")
    run.misses = delta(orch_after, orch_before, "specmesh_predraft_misses_total")
    run.parts = {p: delta(orch_after, orch_before, "specmesh_round_time_seconds_sum", part=p) for p in PARTS}
    return run


def start_services(group: ProcessGroup, args) -> dict:
    group.start("target", run_service, ReplicaConfig("target", ServiceOptions(
        model=args.target, device=args.device, dtype=args.target_dtype, metrics_port=0, cpus=args.target_cpus)))
    group.start("draft", run_service, ReplicaConfig("draft", ServiceOptions(
        model=args.draft, device=args.draft_device or args.device, dtype=args.draft_dtype, metrics_port=0,
        cpus=args.draft_cpus)))
    ready = group.wait_ready({"target", "draft"}, START_TIMEOUT_S)
    for mode, pipeline in (("sequential", "off"), ("pipelined", "on")):
        options = OrchestratorOptions(f"127.0.0.1:{ready['target'].port}", f"127.0.0.1:{ready['draft'].port}",
                                      LoopConfig(num_speculative_tokens=args.k, pipeline=pipeline,
                                                 extra_branches=args.extra_branches))
        group.start(mode, run_orchestrator, args.target, options, "127.0.0.1:0",
                    FrontendOptions(metrics_port=0))
        ready[mode] = group.wait_ready({"orchestrator"}, START_TIMEOUT_S)["orchestrator"]  # one at a time
    return ready


def report(runs: list[Run], args) -> list[dict]:
    print(f"\n{os.cpu_count()} cores; target {args.target} on {args.device} cpus {args.target_cpus}, draft "
          f"{args.draft} on {args.draft_device or args.device} cpus {args.draft_cpus}; greedy, k={args.k}, "
          f"{len(args.prompts)} prompts x {args.max_tokens} max tokens\n")
    header = (f"{'mode':<11}{'conc':>5}{'tok/s':>9}{'alpha':>7}{'c_draft':>9}{'c_verify':>10}{'E':>6}"
              f"{'bound':>8}{'ratio':>7}{'hits':>7}  % of round time: draft/target/wire/idle/overlap")
    print(header + "\n" + "-" * len(header))
    costs = {run.concurrency: run for run in runs if run.mode == "sequential"}
    rows = []
    for run in runs:
        c_draft, c_verify = costs[run.concurrency].c_draft, run.c_verify
        alpha, k = run.alpha, args.k
        e = (1 - alpha ** (k + 1)) / (1 - alpha) if alpha < 1 else k + 1.0
        bound = e / (c_verify + k * c_draft)
        rate = run.tokens / run.seconds
        hit_rate = run.hits / (run.hits + run.misses) if run.hits + run.misses else float("nan")
        wall = sum(run.parts.values()) - 2 * run.parts["overlap"] or 1.0  # parts sum to wall + overlap
        shares = "/".join(f"{100 * run.parts[p] / wall:.0f}" for p in PARTS)
        print(f"{run.mode:<11}{run.concurrency:>5}{rate:>9.2f}{alpha:>7.2f}{c_draft * 1e3:>7.1f}ms"
              f"{c_verify * 1e3:>8.1f}ms{e:>6.2f}{bound:>8.2f}{rate / bound:>6.2f}x{hit_rate:>7.2f}  {shares}")
        rows.append({"mode": run.mode, "concurrency": run.concurrency, "tokens_per_s": rate, "alpha": alpha,
                     "c_draft_s": c_draft, "c_verify_s": c_verify, "E": e, "sequential_bound_tokens_per_s": bound,
                     "ratio_to_bound": rate / bound, "predraft_hit_rate": hit_rate, "round_time_s": run.parts})
    print("\nbound = E / (c_verify + k * c_draft): one sequential stream with no overhead; at concurrency > 1 the "
          "ratio compares the aggregate rate with that single-stream bound.")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--draft-device", default=None)
    parser.add_argument("--target-dtype", default="float32", choices=DTYPE_CHOICES)
    parser.add_argument("--draft-dtype", default="float32", choices=DTYPE_CHOICES)
    parser.add_argument("--target-cpus", type=parse_cpu_list, default=(0,))
    parser.add_argument("--draft-cpus", type=parse_cpu_list, default=(1,))
    parser.add_argument("--k", type=int, default=3, help="draft tokens per round")
    parser.add_argument("--extra-branches", type=int, default=None, help="default: from measured costs")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    args.prompts = PROMPTS[: args.num_prompts]
    group = ProcessGroup()
    try:
        ready = start_services(group, args)
        ports = {name: r.metrics_port for name, r in ready.items()}
        endpoints = {mode: f"127.0.0.1:{ready[mode].port}" for mode in ("sequential", "pipelined")}
        for endpoint in endpoints.values():  # warm-up: first forwards page the weights in
            asyncio.run(generate_all(endpoint, PROMPTS[:1], 8, args.k, 1, Run("warm-up", 1)))
        runs = [measure(mode, c, endpoints[mode], ports, args) for c in args.concurrency for mode in endpoints]
    finally:
        group.stop()
    rows = report(runs, args)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=2)


if __name__ == "__main__":
    main()
