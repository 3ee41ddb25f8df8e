"""One orchestrator over several target and draft replicas, up to hundreds of requests: the scale benchmark.

    python -m benchmarks.scale --out docs/results/scale/scale.json      # the full sweep
    python -m benchmarks.scale --out /tmp/scale.json --small            # the suite's: one layout, c = 2

Every figure is emulated, not measured on a GPU: the set-acceptance pair padded to a profile's GPU step
times (benchmarks/gpu_profiles.py, `h100-8b` by default, acceptance alpha 0.8 set by construction), each
service a process of its own, `specmesh serve` attached to all of them (benchmarks/regime_stack.py,
`direct`: no link delay). For each replica layout (default 1 target + 1 draft, and 4 targets + 2 drafts) it
serves every concurrency (default 1, 8, 64, 256) with speculation off, then on (the default policy; `k=N`
a fixed k); one
`specmesh bench` run a cell: `max(8, 4 c)` greedy `code` prompts of 32 tokens each, one uncounted warm-up
a slot. Speculation off is the orchestrator restarted with `num-speculative-tokens: 0` (every request
target-only, as a request with speculation off runs), on the same services: so each cell's CPU is its own.

Per cell: tokens/s (the bench's output throughput); the engines' bound and tokens/s over it; CPU seconds
per 1,000 committed tokens (the orchestrator's `specmesh_generation_tokens_total`) of the orchestrator
process and of the target and draft services (each role summed over its replicas; /proc of each process,
before and after the cell, warm-ups included on both sides), and the orchestrator's CPU over the cell's
wall time (1.0: one core busy) and the rate at which it would fill one core at this CPU per token
(`orchestrator_ceiling_tokens_per_s`: where the orchestrator saturates, whatever else the host runs); the
load generator's CPU (this process: `specmesh bench` runs in it) likewise; p50 and p99 inter-token latency (the gap between streamed chunks: with
speculation a chunk is a round); whether every greedy output equals target-only's (the first layout's
speculation-off cell at the same concurrency, prompt by prompt).

The engines' bound is what the profile's batched steps allow with zero overhead. The c sessions are split
evenly over the N target replicas (c // N each, one more on the first c % N); each replica steps its share
s in lockstep; each of the M drafts steps ceil(c / M) sessions at once. With speculation off a replica
commits one token per session per step: s / t_s(1) tokens/s, t_s(rows) being the profile's step of s
sessions with `rows` rows each (benchmarks.regime_report.Regime). With speculation on, that times the
pipelined bound of benchmarks/regime_bound.py at those step times, alpha and the cell's measured pre-draft
hit rate (the best k's E(k) t_s(1) / round; no link): the same bound as the regime benchmark's, per replica
(for a fixed k too: what any k allows).
The bound is the replicas' sum; `bound_h1_tokens_per_s` is the same at hit rate 1, the ceiling. Prefill is
left out of it.

Writes the JSON and a markdown table beside it (.md).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.gpu_profiles import PROFILES, scaled
from benchmarks.regime import counts, given_sweep, outputs_by_prompt, run_bench, sweep_parser
from benchmarks.regime_report import Counts, Regime
from benchmarks.regime_stack import DRAFT_MODEL_ONLY, ROLES, RegimeStack, ensure_pair

Layout = tuple[int, int]  # (target replicas, draft replicas)


@dataclass(frozen=True)
class ScaleSweep:
    profile: str = "h100-8b"
    alpha: float = 0.8
    layouts: tuple[Layout, ...] = ((1, 1), (4, 2))
    concurrency: tuple[int, ...] = (1, 8, 64, 256)
    speculation: tuple[str, ...] = ("off", "on")  # off first: on's outputs are compared with it
    prompts_per_slot: int = 4
    min_prompts: int = 8
    max_tokens: int = 32
    time_scale: float = 1.0  # every emulated step time multiplied by this

    def prompts(self, concurrency: int) -> int:
        return max(self.min_prompts, self.prompts_per_slot * concurrency)


SMALL = ScaleSweep(layouts=((2, 1),), concurrency=(2,), min_prompts=4, max_tokens=8)


def serve_settings(speculation: str) -> dict:
    """The orchestrator's config keys for a speculation mode: "off", "on" (the default policy) or "k=N" (a
    fixed k of N every round)."""
    if speculation == "off":
        return {**DRAFT_MODEL_ONLY, "num-speculative-tokens": 0}
    if speculation.startswith("k="):
        return {**DRAFT_MODEL_ONLY, "num-speculative-tokens": int(speculation[2:]), "speculation-policy": "fixed"}
    return dict(DRAFT_MODEL_ONLY)


def speculation_mode(text: str) -> str:
    if text in ("off", "on") or (text.startswith("k=") and text[2:].isdigit() and int(text[2:]) > 0):
        return text
    raise argparse.ArgumentTypeError(f"off, on or k=N, not {text!r}")


def replica_shares(concurrency: int, replicas: int) -> list[int]:
    """Sessions per replica, split evenly: c // n each, one more on the first c % n."""
    return [concurrency // replicas + (1 if i < concurrency % replicas else 0) for i in range(replicas)]


def engines_bound(sweep: ScaleSweep, layout: Layout, concurrency: int, speculation: bool, hit: float) -> dict:
    """Tokens/s the profile's batched steps allow with zero overhead (the module's docstring says how)."""
    profile = PROFILES[sweep.profile]
    target, draft = scaled(profile.target, sweep.time_scale), scaled(profile.draft, sweep.time_scale)
    targets, drafts = layout
    bound = {"bound_tokens_per_s": 0.0, "bound_h1_tokens_per_s": 0.0, "bound_k": 0}
    for share in filter(None, replica_shares(concurrency, targets)):
        regime = Regime(sweep.alpha, target, draft, share, 0.0, 0.0, draft_concurrency=math.ceil(concurrency / drafts))
        target_only = share / regime.target_s(1)  # one token a session a step
        bounds = regime.bounds(hit) if speculation else {}
        bound["bound_tokens_per_s"] += target_only * bounds.get("bound_pipelined", 1.0)
        bound["bound_h1_tokens_per_s"] += target_only * bounds.get("bound_pipelined_h1", 1.0)
        bound["bound_k"] = max(bound["bound_k"], bounds.get("bound_pipelined_k", 0))
    return bound


def cpu_by_role(spent: Counts, stack: RegimeStack) -> dict[str, float]:
    """CPU seconds of the orchestrator and of each role's services summed."""
    return {"orchestrator": spent.cpu_s.get("orchestrator", 0.0),
            **{role: sum(spent.cpu_s.get(name, 0.0) for name in stack.names(role)) for role in ROLES}}


def cell_row(sweep: ScaleSweep, layout: Layout, speculation: str, concurrency: int, result: dict,
             spent: Counts, cpu: dict[str, float], wall_s: float, load_cpu_s: float) -> dict:
    overall = result["configurations"][0]["modes"]["on"]["overall"]  # the bench's default mode: serve decides
    hit = spent.hits / (spent.hits + spent.misses) if spent.hits + spent.misses else 0.0
    per_1k = 1e3 / max(1.0, spent.tokens)
    bound = engines_bound(sweep, layout, concurrency, speculation != "off", hit)
    tok_s = overall["output_throughput"]
    return {
        "layout": f"{layout[0]}t+{layout[1]}d", "targets": layout[0], "drafts": layout[1],
        "speculation": speculation, "concurrency": concurrency, "prompts": sweep.prompts(concurrency),
        "max_tokens": sweep.max_tokens, "failed": overall["failed"], "tokens_per_s": tok_s, **bound,
        "of_bound": tok_s / bound["bound_tokens_per_s"] if tok_s else None,
        "committed_tokens": spent.tokens, "tokens_per_round": spent.tokens / max(1.0, spent.rounds),
        "acceptance_rate": overall.get("acceptance_rate"), "predraft_hit_rate": hit,
        "cpu_s_per_1k_tokens": {role: seconds * per_1k for role, seconds in cpu.items()},
        "orchestrator_cpu_share": cpu["orchestrator"] / wall_s,  # of one core, over the cell's wall time
        "orchestrator_ceiling_tokens_per_s": spent.tokens / cpu["orchestrator"] if cpu["orchestrator"] else None,
        "stack_cpu_share": sum(cpu.values()) / wall_s, "load_generator_cpu_share": load_cpu_s / wall_s,
        "itl_p50_ms": overall["itl_ms"].get("p50"), "itl_p99_ms": overall["itl_ms"].get("p99"),
        "sessions_per_target_step": spent.sessions_per_target_step,
        "wall_s": wall_s,
    }


class ScaleRun:
    """Every layout's cells, and the greedy outputs each is compared with."""

    def __init__(self, sweep: ScaleSweep, pair: dict[str, Path], work: Path):
        self.sweep, self.pair, self.work = sweep, pair, work
        self.reference: dict[int, dict] = {}  # concurrency -> target-only outputs by prompt
        self.rows: list[dict] = []

    def run(self) -> list[dict]:
        for layout in self.sweep.layouts:
            self.run_layout(layout)
        return self.rows

    def run_layout(self, layout: Layout) -> None:
        first = self.sweep.speculation[0]
        stack = RegimeStack(self.pair["target"], self.pair[f"draft-{self.sweep.alpha:g}"], "direct",
                            self.work / f"scale-{layout[0]}t{layout[1]}d", serve_settings(first),
                            targets=layout[0], drafts=layout[1]).start()
        try:
            for speculation in self.sweep.speculation:
                if speculation != first:
                    stack.restart_serve(serve_settings(speculation))
                for concurrency in self.sweep.concurrency:
                    self.run_cell(stack, layout, speculation, concurrency)
        finally:
            stack.stop()

    def run_cell(self, stack: RegimeStack, layout: Layout, speculation: str, concurrency: int) -> None:
        name = f"{layout[0]}t{layout[1]}d-{speculation}-c{concurrency}"
        before, started, load_cpu = counts(stack), time.monotonic(), time.process_time()
        result = run_bench(stack, concurrency, 0.0, self.sweep.prompts(concurrency), self.sweep.max_tokens,
                           ab=False, log=stack.work / f"{name}.log")
        wall_s, load_cpu_s = time.monotonic() - started, time.process_time() - load_cpu
        spent = counts(stack) - before
        row = cell_row(self.sweep, layout, speculation, concurrency, result, spent, cpu_by_role(spent, stack), wall_s,
                       load_cpu_s)
        outputs = outputs_by_prompt(result, "on")
        if speculation == "off":
            self.reference.setdefault(concurrency, outputs)
        reference = self.reference.get(concurrency)
        row["greedy_identical"] = None if reference is None else outputs == reference
        self.rows.append(row)
        print(f"{name}: {row['tokens_per_s']:.0f} tok/s, {row['of_bound']:.2f} of bound "
              f"{row['bound_tokens_per_s']:.0f}; orchestrator {row['cpu_s_per_1k_tokens']['orchestrator']:.2f} "
              f"CPU s/1k tokens, {row['orchestrator_cpu_share']:.0%} of a core; ITL p50 {row['itl_p50_ms']:.1f} "
              f"p99 {row['itl_p99_ms']:.1f} ms", flush=True)


def table(rows: list[dict]) -> str:
    """The cells as a markdown table (emulated)."""
    head = ("| layout | spec | c | tok/s (emulated) | bound | of bound | orch. CPU s/1k tok | orch. CPU/core "
            "| orch. 1-core tok/s | target CPU s/1k | draft CPU s/1k | stack CPU/core | sessions/target step "
            "| ITL p50 ms | ITL p99 ms | identical |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        cpu = r["cpu_s_per_1k_tokens"]
        lines.append(f"| {r['layout']} | {r['speculation']} | {r['concurrency']} | {r['tokens_per_s']:.0f} "
                     f"| {r['bound_tokens_per_s']:.0f} | {r['of_bound']:.2f} | {cpu['orchestrator']:.2f} "
                     f"| {r['orchestrator_cpu_share']:.0%} | {r['orchestrator_ceiling_tokens_per_s'] or 0:.0f} "
                     f"| {cpu['target']:.2f} | {cpu['draft']:.2f} | {r['stack_cpu_share']:.0%} "
                     f"| {r['sessions_per_target_step']:.2f} | {r['itl_p50_ms']:.1f} | {r['itl_p99_ms']:.1f} | {r['greedy_identical']} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, ScaleSweep]:
    parser = sweep_parser("benchmarks.scale", __doc__, "the JSON (a .md table beside it)",
                          "the test suite's: 2 targets + 1 draft at c = 2")
    defaults = ScaleSweep()
    parser.add_argument("--profile", choices=sorted(PROFILES), default=None, help=f"default {defaults.profile}")
    parser.add_argument("--alpha", type=float, default=None, help=f"default {defaults.alpha}")
    parser.add_argument("--layouts", nargs="+", default=None, metavar="TxD",
                        help="target x draft replicas, e.g. 1x1 4x2 (the default)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=None)
    parser.add_argument("--speculation", nargs="+", type=speculation_mode, default=None,
                        help="off, on (the default policy), k=N (fixed); default off on")
    parser.add_argument("--prompts-per-slot", type=int, default=None, help=f"default {defaults.prompts_per_slot}")
    parser.add_argument("--max-tokens", type=int, default=None, help=f"default {defaults.max_tokens}")
    parser.add_argument("--time-scale", type=float, default=None, help="every emulated step multiplied by this")
    args = parser.parse_args(argv)
    layouts = None if args.layouts is None else tuple(tuple(map(int, text.split("x"))) for text in args.layouts)
    given = {"profile": args.profile, "alpha": args.alpha, "layouts": layouts, "concurrency": args.concurrency,
             "speculation": args.speculation, "prompts_per_slot": args.prompts_per_slot,
             "max_tokens": args.max_tokens, "time_scale": args.time_scale}
    return args, given_sweep(SMALL if args.small else defaults, given)


def main(argv: list[str] | None = None) -> int:
    args, sweep = parse_args(argv)
    pair = ensure_pair(args.work, sweep.profile, [sweep.alpha], sweep.time_scale)
    rows = ScaleRun(sweep, pair, args.work).run()
    result = {"emulated": True, "command": "python -m benchmarks.scale " + " ".join(argv or sys.argv[1:]),
              "machine": {"processor": platform.processor() or platform.machine(), "python": platform.python_version()},
              "sweep": asdict(sweep), "profile": list(PROFILES[sweep.profile].sources), "cells": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    args.out.with_suffix(".md").write_text(table(rows))
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
