"""A draft and a target on the same cores, by OpenMP spin count (specmesh.loading.openmp).

For each GOMP_SPINCOUNT: a target process (float32, `--target-rows` rows a step) and a draft
process (`--draft-dtype`, int8 on these CPUs; one row a step) load one after the other, each
times its step alone over a 150-token cache, then both step at once for `--seconds`. Prints
the median step of each, alone and beside the other. 300000 is libgomp's own default;
specmesh sets 2000. TARGET/DRAFT gives the two their own, e.g. 300000/2000.

With `--alternate K` they take turns instead, as the sequential decoding loop does: K draft
steps, then one target step of `--target-rows` rows, for `--seconds`; prints the median round
and each side's median share of it. What a spin costs there is only its tail: the side that
just finished spins while the other starts.

    python -m benchmarks.openmp_contention
    python -m benchmarks.openmp_contention --spin-counts 300000 5000 2000 500 0 300000/2000 --seconds 20
    python -m benchmarks.openmp_contention --alternate 4 --target-rows 5 --spin-counts 300000/2000 300000/20000 300000
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ALONE_STEPS = 15


def child(model: str, dtype: str, rows: int, seconds: float) -> None:
    """One stepping process: load, time alone, say so on stdout, wait for 'go' on stdin, step beside the other."""
    import torch
    from transformers import DynamicCache

    from specmesh.loading.cpu_linear import choose_cpu_linear
    from specmesh.engine.model_engine import EngineConfig, ModelEngine, Session
    from specmesh.loading.precision import load_model_in
    from specmesh.engine.sampling_params import SamplingParams

    loaded, tokenizer = load_model_in(model, "cpu", dtype)
    choose_cpu_linear(loaded, "auto", "cpu")
    engine = ModelEngine(loaded, tokenizer, EngineConfig(model_name=model))
    engine.warm_up()
    prompt = [1 + (i * 7919) % (engine.vocab_size - 1) for i in range(150)]
    session = Session("bench", prompt, DynamicCache(), SamplingParams(), torch.Generator())
    engine.forward(session, prompt)

    def step() -> float:
        began = time.perf_counter()
        engine.forward(session, [5] * rows, 1)
        session.cache.crop(-rows)
        return time.perf_counter() - began

    alone = statistics.median(step() for _ in range(ALONE_STEPS))
    print("ready", flush=True)
    if sys.stdin.readline().strip() == "turns":
        take_turns(step, model, rows, alone)
        return
    beside, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end:
        beside.append(step())
    print(json.dumps({"model": model, "rows": rows, "alone_ms": alone * 1e3,
                      "beside_ms": statistics.median(beside) * 1e3, "steps": len(beside)}), flush=True)


def take_turns(step, model: str, rows: int, alone: float) -> None:
    """'N' on stdin: N steps, then their seconds on stdout; an empty line: the end."""
    while (line := sys.stdin.readline().strip()):
        print(sum(step() for _ in range(int(line))), flush=True)
    print(json.dumps({"model": model, "rows": rows, "alone_ms": alone * 1e3}), flush=True)


def ask(process: subprocess.Popen, line: str) -> str:
    process.stdin.write(line + "\n")
    process.stdin.flush()
    return process.stdout.readline()


def alternate(processes: list[subprocess.Popen], k: int, seconds: float) -> dict:
    """Rounds of k draft steps then one target step: the median round, and each side's median seconds."""
    target, draft = processes
    rounds, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end:
        began = time.perf_counter()
        draft_s = float(ask(draft, str(k)))
        target_s = float(ask(target, "1"))
        rounds.append((time.perf_counter() - began, draft_s, target_s))
    alone = [json.loads(ask(process, "")) for process in processes]
    return {"round_ms": statistics.median(r[0] for r in rounds) * 1e3,
            "draft_ms": statistics.median(r[1] for r in rounds) * 1e3,
            "target_ms": statistics.median(r[2] for r in rounds) * 1e3, "rounds": len(rounds),
            "alone_ms": [row["alone_ms"] for row in alone]}


def measure(spin_count: str, args: argparse.Namespace) -> list[dict] | dict:
    """Start the target, then the draft (each times itself alone while the other is not yet loading),
    then let both step at once."""
    target_spin, _, draft_spin = spin_count.partition("/")
    processes = []
    for model, dtype, rows, spin in ((args.target, "float32", args.target_rows, target_spin),
                                     (args.draft, args.draft_dtype, 1, draft_spin or target_spin)):
        env = {**os.environ, "GOMP_SPINCOUNT": spin}  # read when the child loads torch
        command = [sys.executable, __file__, "--child", model, dtype, str(rows), str(args.seconds)]
        process = subprocess.Popen(command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   stderr=subprocess.DEVNULL, text=True)
        if process.stdout.readline().strip() != "ready":
            raise RuntimeError(f"{model} did not start: exit code {process.wait()}")
        processes.append(process)
    for process in processes:
        process.stdin.write("turns\n" if args.alternate else "go\n")
        process.stdin.flush()
    if args.alternate:
        result = alternate(processes, args.alternate, args.seconds)
        for process in processes:
            process.wait()
        return result
    results = [json.loads(process.stdout.readline()) for process in processes]
    for process in processes:
        process.wait()
    return results


def main(argv: list[str] | None = None) -> dict[str, list[dict]]:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        model, dtype, rows, seconds = argv[1:5]
        child(model, dtype, int(rows), float(seconds))
        return {}
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--draft-dtype", default="auto")
    parser.add_argument("--target-rows", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--spin-counts", nargs="+", default=["300000", "2000"])
    parser.add_argument("--alternate", type=int, default=0, metavar="K",
                        help="take turns as the sequential loop does: K draft steps, then one target step")
    args = parser.parse_args(argv)
    if args.alternate:
        return print_turns(args)
    print(f"{'GOMP_SPINCOUNT':>14}  {'model':<22} {'rows':>4}  {'alone ms':>8}  {'beside ms':>9}  {'ratio':>6}  steps")
    table = {}
    for spin_count in args.spin_counts:
        table[spin_count] = measure(spin_count, args)
        for row in table[spin_count]:
            print(f"{spin_count:>14}  {os.path.basename(row['model']):<22} {row['rows']:>4}  {row['alone_ms']:8.1f}  "
                  f"{row['beside_ms']:9.1f}  {row['beside_ms'] / row['alone_ms']:5.2f}x  {row['steps']}", flush=True)
    return table


def print_turns(args: argparse.Namespace) -> dict[str, dict]:
    print(f"{'GOMP_SPINCOUNT':>14}  {'round ms':>8}  {'draft ms':>8}  {'target ms':>9}  "
          f"{'draft alone':>11}  {'target alone':>12}  rounds   (k = {args.alternate}, target rows {args.target_rows})")
    table = {}
    for spin_count in args.spin_counts:
        row = table[spin_count] = measure(spin_count, args)
        target_alone, draft_alone = row["alone_ms"]
        print(f"{spin_count:>14}  {row['round_ms']:8.1f}  {row['draft_ms']:8.1f}  {row['target_ms']:9.1f}  "
              f"{args.alternate * draft_alone:11.1f}  {target_alone:12.1f}  {row['rounds']}", flush=True)
    return table


if __name__ == "__main__":
    main()
