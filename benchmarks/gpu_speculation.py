"""Speculation on a GPU, in one go: the set-acceptance pair at real sizes, target-only and speculative
serving at set acceptance rates, and transformers' assisted generation on the same pair.

    python -m benchmarks.gpu_speculation --out docs/results/gpu-h200.json

Steps: check the device and measure its copy bandwidth (so each step time can be stated against the
time to read the target's weights once); build the pair on the device (benchmarks/set_acceptance_pair.py:
a Qwen2.5-7B-shaped target, a Qwen2.5-0.5B-shaped draft per alpha, random bf16 weights); time the
target's engine step with graph steps off and on (benchmarks/gpu_steps.py, in a process of its own so
its memory is free again for serving) and the placements (benchmarks/gpu_placement.py); then for each
alpha one `specmesh serve` (graph steps as configured, `auto` by default) and `specmesh bench` runs
against it, all greedy:

- concurrency 1: speculation on (the default policy) and off, each fixed k of --sweep-k, and the peer
  (transformers' generate with the same pair in this machine's other process: target alone and
  assisted at each k);
- each further --speculative-concurrency: on, off and each fixed k;
- with the first alpha, the --concurrency values left (target-only's batching; on runs beside it).

Writes the JSON (--out), a plot beside it, the bench results under --work, and prints a table with the
targets the run is held to (gpu_summary.bars). Every output is compared across modes prompt by prompt
(bench's greedy check).
`--small --device cpu --dtype float32` runs the same at test size (the test suite does).
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml

from benchmarks.gpu_placement import lines as placement_lines, measure as measure_placement
from benchmarks.gpu_summary import alpha_key, outputs_identical, plot, speculation, table, target_only
from benchmarks.serve_process import start_serve
from benchmarks.set_acceptance_pair import build_pair

ROOT = Path(__file__).resolve().parents[1]
MODULE = "benchmarks.gpu_speculation"
COPY_BYTES = 1 << 30  # per copy: large enough that launch costs vanish next to it
COPY_REPEATS = 10


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="the JSON (a .png plot is written beside it)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/specmesh-gpu"), help="the pair and bench results")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--alphas", type=float, nargs="+", default=[0.8, 0.6])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64], help="target-only's")
    parser.add_argument("--speculative-concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--sweep-k", type=int, nargs="+", default=[2, 4, 6], help="fixed ks, served and the peer's")
    parser.add_argument("--prompts-c1", type=int, default=8, help="prompts at concurrency 1")
    parser.add_argument("--prompts-per-slot", type=int, default=2, help="prompts = this x concurrency, above 1")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--small", action="store_true", help="test-sized pair")
    parser.add_argument("--commit", default=None, help="the code measured (default: git rev-parse HEAD)")
    parser.add_argument("--start-timeout", type=float, default=600.0)
    parser.add_argument("--placement-seconds", type=float, default=3.0,
                        help="of timed steps per placement (benchmarks/gpu_placement.py); 0: skip")
    parser.add_argument("--step-shapes", default=None,
                        help="sessions x rows for benchmarks/gpu_steps.py (default: its own); 'none': skip")
    parser.add_argument("--graph-steps", default="auto", choices=["auto", "on", "off"], help="the servers'")
    parser.add_argument("--kv-cache-memory", default="16GiB", help="each service's KV budget")
    return parser.parse_args(argv)


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"{platform.processor() or platform.machine()} CPU"


def check_environment(args: argparse.Namespace) -> None:
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: torch {torch.__version__} sees no CUDA device")
    if not args.device.startswith("cuda"):
        return
    free, total = torch.cuda.mem_get_info(torch.device(args.device))
    print(f"device: {device_name(args.device)}, {free / 2**30:.0f} of {total / 2**30:.0f} GiB free, "
          f"CUDA {torch.version.cuda}, torch {torch.__version__}", flush=True)


def copy_bandwidth_gb_s(device: str, size: int = COPY_BYTES) -> float:
    """Device memory copy rate, bytes read plus written per second (what a memory-bound step moves)."""
    source = torch.empty(size, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)  # warm
    synchronize(device)
    start = time.perf_counter()
    for _ in range(COPY_REPEATS):
        target.copy_(source)
    synchronize(device)
    return 2 * size * COPY_REPEATS / (time.perf_counter() - start) / 1e9


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(torch.device(device))


def weights_bytes(model_dir: Path) -> int:
    return sum(path.stat().st_size for path in model_dir.glob("*.safetensors"))


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def serve_flags(args: argparse.Namespace, target: Path, draft: Path, work: Path) -> list[str]:
    config = work / "serve.yaml"
    # The suffix index would find the walks the same prompt made in earlier modes: the model draft alone is measured.
    # A set KV budget: graph steps allocate it at start-up, and the peer loads the pair beside both services.
    config.write_text(yaml.safe_dump({"trust-remote-code": True, "target-dtype": args.dtype,
                                      "draft-dtype": args.dtype, "suffix-index": "off",
                                      "graph-steps": args.graph_steps, "kv-cache-memory": args.kv_cache_memory}))
    return ["--target", str(target), "--draft", str(draft), "--device", args.device, "--port", "0",
            "--http-port", "-1", "--metrics-port", "0", "--config", str(config)]


def prompt_count(args: argparse.Namespace, concurrency: int) -> int:
    return args.prompts_c1 if concurrency == 1 else args.prompts_per_slot * concurrency


def write_prompts(path: Path, count: int) -> Path:
    """`count` completion prompts, each a token or so longer than the one before: the target's walk starts
    from (last token, position), so prompts of one length ending alike would all get the same output."""
    lines = [json.dumps({"kind": "code", "prompt": f"# step {i}:" + " data" * (i + 1) + f"\ndef step_{i}(x):\n"})
             for i in range(count)]
    path.write_text("\n".join(lines) + "\n")
    return path


def bench(args: argparse.Namespace, serve, target: Path, draft: Path, concurrency: int, out: Path,
          peer: bool) -> dict:
    """One `specmesh bench` against the running server at one concurrency; its result.json (with where a
    round's time goes, from the server's /metrics: the RPCs' share at GPU step times)."""
    prompts = prompt_count(args, concurrency)
    command = [sys.executable, "-m", "orchestrator.cli.main", "bench", "--endpoint",
               f"127.0.0.1:{serve.grpc_port}", "--metrics-url", f"http://127.0.0.1:{serve.metrics_port}/metrics",
               "--tokenizer", str(target), "--prompt-file", str(args.work / "prompts.jsonl"), "--temperature", "0",
               "--max-tokens", str(args.max_tokens), "--num-prompts", str(prompts), "--max-concurrency",
               str(concurrency), "--ab", "--sweep-k", *map(str, args.sweep_k), "--no-progress",
               "--result-dir", str(out)]
    if peer:
        command += ["--peer-k", *map(str, args.sweep_k), "--target", str(target), "--draft", str(draft),
                    "--trust-remote-code", "--device", args.device, "--target-dtype", args.dtype,
                    "--draft-dtype", args.dtype]
    print("bench: " + shlex.join(command[3:]), flush=True)
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    (out.parent / f"{out.name}.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise SystemExit(f"bench failed ({done.returncode}):\n{done.stderr[-3000:]}")
    print(done.stdout[-2500:], flush=True)
    return json.loads((out / "result.json").read_text())


def step_times(args: argparse.Namespace, target: Path) -> dict | None:
    """benchmarks/gpu_steps.py on the target, in a child process (its KV and graphs are freed when it ends)."""
    if args.step_shapes == "none":
        return None
    out = args.work / "steps.json"
    command = [sys.executable, "-m", "benchmarks.gpu_steps", "--model", str(target), "--device", args.device,
               "--dtype", args.dtype, "--trust-remote-code", "--json", str(out)]
    if args.step_shapes:
        command += ["--shapes", args.step_shapes, "--steps", "3", "--kv-bytes", str(2**26)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    print(done.stdout[-3000:], flush=True)
    if done.returncode != 0:  # the serving runs still measure what they can
        print(f"gpu_steps failed ({done.returncode}):\n{done.stderr[-3000:]}", flush=True)
        return None
    return json.loads(out.read_text())


def start_server(args: argparse.Namespace, target: Path, draft: Path, work: Path):
    """`specmesh serve` for one alpha; where it fails to start with graph steps, once more (and for the rest of
    the run) with them off, so that the run still measures speculation on that GPU."""
    try:
        return start_serve(serve_flags(args, target, draft, work), work / "serve.log", args.start_timeout, metrics=True)
    except SystemExit as failure:
        if args.graph_steps == "off":
            raise
        print(f"serve with graph steps {args.graph_steps} did not start:\n{failure}\nonce more with them off",
              flush=True)
        args.graph_steps = "off"
        return start_serve(serve_flags(args, target, draft, work), work / "serve-graph-steps-off.log",
                           args.start_timeout, metrics=True)


def run_alpha(args: argparse.Namespace, pair: dict[str, Path], alpha: float, first: bool) -> dict:
    """One server with the draft of `alpha`, and its bench runs (module docstring)."""
    work = args.work / f"alpha-{alpha_key(alpha)}"
    work.mkdir(parents=True, exist_ok=True)
    draft = pair[f"draft-{alpha_key(alpha)}"]
    serve = start_server(args, pair["target"], draft, work)
    try:
        concurrencies = list(args.speculative_concurrency)
        if first:
            concurrencies += [c for c in args.concurrency if c not in concurrencies]
        results = [bench(args, serve, pair["target"], draft, c, work / f"c{c}", peer=c == 1)
                   for c in concurrencies]
    finally:
        serve.stop()
    configurations = [entry for result in results for entry in result["configurations"]]
    return {"alpha": alpha, "bench": {"configurations": configurations}}


def write_summary(args: argparse.Namespace, results: list[dict], measured: dict, complete: bool) -> dict:
    """The JSON of what has been measured so far (`complete` once every alpha ran), written to --out."""
    default, fixed, assisted = speculation(results)
    summary = {"gpu": device_name(args.device), "commit": args.commit or git_commit(),
               "date": time.strftime("%Y-%m-%d", time.gmtime()), "dtype": args.dtype, "complete": complete,
               "graph_steps": args.graph_steps,
               "copy_bandwidth_gb_s": measured["bandwidth"], "target_weights_read_ms": measured["read_ms"],
               "target_only": target_only(results), "default_policy": default, "best_fixed_k": fixed,
               "hf_assisted": assisted, "outputs_identical": outputs_identical(results),
               "placement": measured["placement"], "engine_steps": measured["steps"],
               "wall_s": time.perf_counter() - measured["started"],
               "settings": {key: str(value) if isinstance(value, Path) else value
                            for key, value in vars(args).items()}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    started = time.perf_counter()
    print(f"machine: {platform.platform()}, {device_name(args.device)}, torch {torch.__version__}", flush=True)
    print(f"command: python -m {MODULE} " + shlex.join(sys.argv[1:] if argv is None else argv), flush=True)
    check_environment(args)
    bandwidth = copy_bandwidth_gb_s(args.device, COPY_BYTES >> 4 if args.small else COPY_BYTES)
    pair = build_pair(args.work / "pair", args.alphas, args.device, args.dtype, args.small)
    write_prompts(args.work / "prompts.jsonl", max(prompt_count(args, c) for c in
                                                   {*args.concurrency, *args.speculative_concurrency}))
    read_ms = weights_bytes(pair["target"]) / (bandwidth * 1e9) * 1e3
    print(f"copy bandwidth {bandwidth:.0f} GB/s: the target's weights read once in {read_ms:.2f} ms", flush=True)
    steps = step_times(args, pair["target"])
    placement = None
    if args.placement_seconds > 0:
        placement = measure_placement(str(pair["target"]), str(pair[f"draft-{alpha_key(args.alphas[0])}"]),
                                      args.device, args.dtype, True, args.placement_seconds)
        print("\n".join(placement_lines(placement)), flush=True)
    measured = dict(bandwidth=bandwidth, read_ms=read_ms, placement=placement, steps=steps, started=started)
    results: list[dict] = []
    write_summary(args, results, measured, complete=False)  # a run cut short keeps what it measured
    for i, alpha in enumerate(args.alphas):
        results.append(run_alpha(args, pair, alpha, first=i == 0))
        summary = write_summary(args, results, measured, complete=i == len(args.alphas) - 1)
    plot(summary, args.out.with_suffix(".png"))
    print("\n" + table(summary) + f"\n\nwall time {summary['wall_s']:.0f} s; wrote {args.out} and "
          f"{args.out.with_suffix('.png')}", flush=True)
    return summary


if __name__ == "__main__":
    main()
