"""Speculation across emulated network links at emulated GPU step times: the regime benchmark.

    python -m benchmarks.regime --out docs/results/regime/regime.json            # the full sweep
    python -m benchmarks.regime --out /tmp/regime.json --small                   # the suite's: seconds

Every figure is emulated, not measured on a GPU or a network: the set-acceptance pair is padded to a
profile's GPU step times (benchmarks/gpu_profiles.py, acceptance alpha set by construction) and its services
reach each other through delay lines (benchmarks/links.py) with a round trip and a bandwidth. For each
profile x alpha it serves the pair (benchmarks/regime_stack.py, `specmesh serve` attached to the services)
in each placement and sweeps round trip x bandwidth x concurrency x temperature, one `specmesh bench` run a
cell, and reports per cell: tokens/s; the speedup over target-only served with the orchestrator beside the
target and no link (the `direct` stack's speculation-off mode: the best a user gets without speculation);
the bound (benchmarks/regime_bound.py: sequential, pipelined at the measured pre-draft hit rate and at
h = 1); bytes on the wire per round and per committed token; a round's breakdown and its overhead; the
target's busy milliseconds per committed token (the capacity a remote draft frees). Writes the JSON, a
markdown table and a plot of speedup against round trip per concurrency beside it.

Greedy outputs of every cell are compared with the direct stack's target-only outputs, prompt by prompt.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import platform
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from benchmarks.gpu_profiles import PROFILES, scaled
from benchmarks.regime_plot import plot_speedups, table
from benchmarks.regime_report import Counts, Regime, cell_figures, read_counts
from benchmarks.regime_stack import DRAFT_MODEL_ONLY, PLACEMENTS, RegimeStack, ensure_pair


@dataclass(frozen=True)
class Sweep:
    profiles: tuple[str, ...] = ("h100-8b", "h100x8-70b")
    alphas: tuple[float, ...] = (0.8, 0.6)
    rtts_ms: tuple[float, ...] = (0.0, 1.0, 5.0, 20.0)
    bandwidths: tuple[str, ...] = ("unlimited", "10gbit", "1gbit")
    concurrency: tuple[int, ...] = (1, 8, 64)
    temperatures: tuple[float, ...] = (0.0, 1.0)
    placements: tuple[str, ...] = ("beside-target", "beside-draft")
    prompts_c1: int = 8  # requests at concurrency 1; above, 2 per slot
    max_tokens: int = 64
    time_scale: float = 1.0  # every emulated time (steps and links) multiplied by this


SMALL = Sweep(profiles=("h100-8b",), alphas=(0.8,), rtts_ms=(5.0,), bandwidths=("1gbit",), concurrency=(1,),
              temperatures=(0.0,), placements=("beside-target",), prompts_c1=2, max_tokens=16)


def run_bench(stack: RegimeStack, concurrency: int, temperature: float, prompts: int, max_tokens: int, ab: bool,
              log: Path) -> dict:
    """One `specmesh bench` configuration against the stack, in this process; its result.json."""
    from orchestrator.bench.app import run
    from orchestrator.cli.main import build_parser

    result_dir = log.with_suffix("")
    argv = ["bench", "--endpoint", stack.endpoint, "--metrics-url", stack.metrics_url, "--kinds", "code",
            "--max-concurrency", str(concurrency), "--temperature", f"{temperature:g}", "--num-prompts",
            str(prompts), "--max-tokens", str(max_tokens), "--num-warmups", "1", "--no-progress",
            "--result-dir", str(result_dir), *(["--ab"] if ab else [])]
    with log.open("w") as out, contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = run(build_parser().parse_args(argv))
    if code != 0:
        raise RuntimeError(f"bench failed ({code}); see {log}")
    return json.loads((result_dir / "result.json").read_text())


def counts(stack: RegimeStack) -> Counts:
    # The load generator (this process) shares the host too, but its CPU time also holds the bench's report
    # and plots: only the stack's processes are counted.
    return read_counts(stack.metrics_url, stack.metrics_urls("target"), stack.metrics_urls("draft"),
                       stack.link_counters(), stack.cpu_seconds())


def outputs_by_prompt(result: dict, mode: str) -> dict[tuple[int, int], str]:
    """Each request's output token digest, by (prompt index, pass)."""
    return {(r["index"], r["repeat"]): r["output_digest"] for r in result["requests"] if r["mode"] == mode and r["ok"]}


class RegimeRun:
    """The cells of one profile x alpha, with the direct stack's target-only figures as their baseline."""

    def __init__(self, sweep: Sweep, profile: str, alpha: float, pair: dict[str, Path], work: Path):
        self.sweep, self.profile, self.alpha, self.work = sweep, profile, alpha, work
        self.target_dir, self.draft_dir = pair["target"], pair[f"draft-{alpha:g}"]
        self.baseline: dict[tuple[int, float], tuple[float, dict]] = {}  # (c, T) -> (tokens/s, output digests)
        self.rows: list[dict] = []

    def regime(self, placement: str, rtt_ms: float, concurrency: int) -> Regime:
        profile, scale = PROFILES[self.profile], self.sweep.time_scale
        rtt_s = rtt_ms * scale / 1e3
        return Regime(self.alpha, scaled(profile.target, scale), scaled(profile.draft, scale), concurrency,
                      rtt_s if placement == "beside-target" else 0.0, rtt_s if placement == "beside-draft" else 0.0)

    def run(self) -> list[dict]:
        self.run_placement("direct", [(0.0, "unlimited")])
        links = list(itertools.product(self.sweep.rtts_ms, self.sweep.bandwidths))
        for placement in self.sweep.placements:
            self.run_placement(placement, links)
        return self.rows

    def run_placement(self, placement: str, links: list[tuple[float, str]]) -> None:
        work = self.work / f"{self.profile}-a{self.alpha:g}-{placement}"
        stack = RegimeStack(self.target_dir, self.draft_dir, placement, work, DRAFT_MODEL_ONLY).start()
        try:
            for rtt_ms, bandwidth in links:
                stack.set_links(rtt_ms * self.sweep.time_scale, bandwidth)
                for concurrency, temperature in itertools.product(self.sweep.concurrency, self.sweep.temperatures):
                    self.run_cell(stack, placement, rtt_ms, bandwidth, concurrency, temperature)
        finally:
            stack.stop()

    def run_cell(self, stack: RegimeStack, placement: str, rtt_ms: float, bandwidth: str, concurrency: int,
                 temperature: float) -> None:
        name = f"{placement}-rtt{rtt_ms:g}-{bandwidth}-c{concurrency}-t{temperature:g}"
        prompts = self.sweep.prompts_c1 if concurrency == 1 else 2 * concurrency
        bench = (stack, concurrency, temperature, prompts, self.sweep.max_tokens)
        if placement == "direct":  # the baseline: speculation off and on alternating, the figures taken apart
            result = run_bench(*bench, ab=True, log=stack.work / f"{name}-ab.log")
            modes = result["configurations"][0]["modes"]
            self.baseline[concurrency, temperature] = (modes["off"]["overall"]["output_throughput"],
                                                       outputs_by_prompt(result, "off"))
        before = counts(stack)
        result = run_bench(*bench, ab=False, log=stack.work / f"{name}.log")
        spent = counts(stack) - before
        modes = result["configurations"][0]["modes"]
        base_tok_s, base_outputs = self.baseline[concurrency, temperature]
        row = {"profile": self.profile, "alpha": self.alpha, "placement": placement, "rtt_ms": rtt_ms,
               "bandwidth": bandwidth, "concurrency": concurrency, "temperature": temperature,
               "time_scale": self.sweep.time_scale, "baseline_tokens_per_s": base_tok_s,
               **cell_figures(modes["on"], spent, self.regime(placement, rtt_ms, concurrency), base_tok_s)}
        if temperature == 0:
            row["greedy_identical"] = outputs_by_prompt(result, "on") == base_outputs
        self.rows.append(row)
        print(f"{name}: {row['tokens_per_s']:.1f} tok/s, {row['speedup']:.2f}x (bound {row['bound_sequential']:.2f}x "
              f"seq, {row['bound_pipelined']:.2f}x pipelined at h={row['predraft_hit_rate']:.2f}), "
              f"{row['bytes_per_token']:.0f} B/token", flush=True)


def sweep_parser(module: str, doc: str, out_help: str, small_help: str) -> argparse.ArgumentParser:
    """A sweep benchmark's command line: where its JSON goes, its work folder, its small sweep; `doc` (the
    module's docstring: run with -m, the module is __main__) as its description. The caller adds the sweep's
    own options."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help=out_help)
    name = module.rsplit(".", 1)[-1]
    parser.add_argument("--work", type=Path, default=Path(f"/tmp/specmesh-{name}"), help="pairs, logs, bench results")
    parser.add_argument("--small", action="store_true", help=small_help)
    return parser


def given_sweep(sweep, given: dict):
    """`sweep` (a frozen dataclass) with the options the command line gave (None: not given; lists as tuples)."""
    given = {key: tuple(value) if isinstance(value, list) else value for key, value in given.items() if value is not None}
    return replace(sweep, **given)


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, Sweep]:
    parser = sweep_parser("benchmarks.regime", __doc__, "the JSON (a .md table and a .png plot beside it)",
                          "the test suite's sweep: one cell each way, seconds")
    defaults = Sweep()
    parser.add_argument("--profiles", nargs="+", choices=sorted(PROFILES), default=None)
    parser.add_argument("--alphas", type=float, nargs="+", default=None)
    parser.add_argument("--rtt-ms", type=float, nargs="+", default=None)
    parser.add_argument("--bandwidths", nargs="+", default=None, help="1gbit, 10gbit, unlimited, ...")
    parser.add_argument("--concurrency", type=int, nargs="+", default=None)
    parser.add_argument("--temperatures", type=float, nargs="+", default=None)
    parser.add_argument("--placements", nargs="+", choices=[p for p in PLACEMENTS if p != "direct"], default=None)
    parser.add_argument("--prompts-c1", type=int, default=None, help=f"default {defaults.prompts_c1}")
    parser.add_argument("--max-tokens", type=int, default=None, help=f"default {defaults.max_tokens}")
    parser.add_argument("--time-scale", type=float, default=None,
                        help="every emulated time multiplied by this (a host too slow for the profile's shortest "
                             "step; speedups and bounds are ratios and do not move)")
    args = parser.parse_args(argv)
    given = {"profiles": args.profiles, "alphas": args.alphas, "rtts_ms": args.rtt_ms, "bandwidths": args.bandwidths,
             "concurrency": args.concurrency, "temperatures": args.temperatures, "placements": args.placements,
             "prompts_c1": args.prompts_c1, "max_tokens": args.max_tokens, "time_scale": args.time_scale}
    return args, given_sweep(SMALL if args.small else defaults, given)


def main(argv: list[str] | None = None) -> int:
    args, sweep = parse_args(argv)
    rows: list[dict] = []
    for profile in sweep.profiles:
        pair = ensure_pair(args.work, profile, list(sweep.alphas), sweep.time_scale)
        for alpha in sweep.alphas:
            rows += RegimeRun(sweep, profile, alpha, pair, args.work).run()
    result = {"emulated": True, "command": "python -m benchmarks.regime " + " ".join(argv or sys.argv[1:]),
              "machine": {"processor": platform.processor() or platform.machine(), "python": platform.python_version()},
              "sweep": asdict(sweep), "profiles": {name: list(PROFILES[name].sources) for name in sweep.profiles},
              "cells": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    args.out.with_suffix(".md").write_text(table(rows))
    plot_speedups(rows, args.out.with_suffix(".png"))
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
