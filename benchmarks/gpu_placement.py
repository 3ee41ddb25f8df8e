"""Where the draft should run beside a GPU target: what two processes time-sharing one GPU cost.

The services are separate processes, so a draft on the target's GPU time-shares it with the target
(CUDA contexts take turns unless MPS runs them concurrently). This times one-row decode steps of the
target and of the draft, each alone in its process, then both at once in two processes, then both at
once under CUDA MPS where its control daemon starts, and the draft alone on the CPU:

    python benchmarks/gpu_placement.py --target DIR --draft DIR --trust-remote-code

Prints and returns median ms a step per placement (benchmarks/gpu_speculation.py runs it on its pair).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from queue import Empty

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CONTEXT_TOKENS = 128  # cached tokens behind each timed step
WARM_STEPS = 5
CHILD_DEADLINE_S = 600.0  # loading a 7B model and timing it takes well under this


def step_times(model_dir: str, device: str, dtype: str, trust: bool, seconds: float, barrier=None) -> list[float]:
    """ms of one-row decode steps over `seconds` (after a barrier shared with another process, if given)."""
    import torch
    from transformers import DynamicCache

    from specmesh.hf_compat import cache_kwargs
    from specmesh.precision import load_model_in

    model, _ = load_model_in(model_dir, device, dtype, trust_remote_code=trust)
    cache = DynamicCache()
    with torch.inference_mode():
        model(torch.full((1, CONTEXT_TOKENS), 100, device=device), **cache_kwargs(model, cache), use_cache=True)
        row = torch.full((1, 1), 101, device=device)  # [1, 1]

        def step() -> float:
            start = time.perf_counter()
            model(row, **cache_kwargs(model, cache), use_cache=True)
            cache.crop(-1)  # every step at the same length
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            return (time.perf_counter() - start) * 1e3

        for _ in range(WARM_STEPS):
            step()
        if barrier is not None:
            barrier.wait()
        times, end = [], time.perf_counter() + seconds
        while time.perf_counter() < end:
            times.append(step())
    return times


def _child(queue, barrier, model_dir: str, device: str, dtype: str, trust: bool, seconds: float) -> None:
    queue.put((model_dir, statistics.median(step_times(model_dir, device, dtype, trust, seconds, barrier))))


def together(models: list[str], device: str, dtype: str, trust: bool, seconds: float) -> dict[str, float]:
    """Median step ms of each model, stepping in its own process at the same time as the others."""
    context = multiprocessing.get_context("spawn")
    queue, barrier = context.Queue(), context.Barrier(len(models))
    children = [context.Process(target=_child, args=(queue, barrier, model, device, dtype, trust, seconds))
                for model in models]
    for child in children:
        child.start()
    results, deadline = {}, time.monotonic() + CHILD_DEADLINE_S
    while len(results) < len(children):
        try:
            model, ms = queue.get(timeout=1.0)
            results[model] = ms
        except Empty:
            failed = [child.exitcode for child in children if child.exitcode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                for child in children:
                    child.kill()
                raise RuntimeError(f"a step-timing process failed (exit codes {failed}) or ran past its deadline")
    for child in children:
        child.join(timeout=60)
    return results


def start_mps() -> tuple[dict[str, str] | None, str]:
    """The environment that reaches a fresh MPS control daemon, or None and why not."""
    control = shutil.which("nvidia-cuda-mps-control")
    if control is None:
        return None, "nvidia-cuda-mps-control not found"
    scratch = tempfile.mkdtemp(prefix="specmesh-mps-")
    env = {"CUDA_MPS_PIPE_DIRECTORY": f"{scratch}/pipe", "CUDA_MPS_LOG_DIRECTORY": f"{scratch}/log"}
    for path in env.values():
        os.makedirs(path, exist_ok=True)
    done = subprocess.run([control, "-d"], env={**os.environ, **env}, capture_output=True, text=True)
    if done.returncode != 0:
        return None, f"nvidia-cuda-mps-control -d: exit {done.returncode} {done.stderr.strip()}"
    return env, ""


def stop_mps(env: dict[str, str]) -> None:
    subprocess.run(["nvidia-cuda-mps-control"], input="quit\n", env={**os.environ, **env}, text=True,
                   capture_output=True, timeout=30)


def measure(target: str, draft: str, device: str, dtype: str, trust: bool, seconds: float) -> dict:
    """Median ms a step per placement; keys name the placement."""
    alone = {role: together([path], device, dtype, trust, seconds)[path] for role, path in
             (("target", target), ("draft", draft))}
    shared = together([target, draft], device, dtype, trust, seconds)
    result = {"alone_ms": alone, "shared_ms": {"target": shared[target], "draft": shared[draft]},
              "draft_on_cpu_ms": statistics.median(step_times(draft, "cpu", "auto", trust, seconds)),
              "mps_ms": None, "mps": ""}
    if device.startswith("cuda"):
        env, why = start_mps()
        result["mps"] = why or "on"
        if env is not None:
            os.environ.update(env)  # the spawned children inherit it and reach the daemon
            try:
                mps = together([target, draft], device, dtype, trust, seconds)
                result["mps_ms"] = {"target": mps[target], "draft": mps[draft]}
            finally:
                stop_mps(env)
                for key in env:
                    del os.environ[key]
    return result


def lines(result: dict) -> list[str]:
    alone, shared, mps = result["alone_ms"], result["shared_ms"], result["mps_ms"]
    out = [f"one-row step, median ms: target alone {alone['target']:.2f}, draft alone {alone['draft']:.2f}; "
           f"both at once in two processes: target {shared['target']:.2f}, draft {shared['draft']:.2f}"]
    if mps:
        out.append(f"  under CUDA MPS: target {mps['target']:.2f}, draft {mps['draft']:.2f}")
    elif result["mps"]:
        out.append(f"  CUDA MPS: {result['mps']}")
    out.append(f"  the draft alone on this machine's CPU: {result['draft_on_cpu_ms']:.2f}")
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True)
    parser.add_argument("--draft", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--seconds", type=float, default=5.0, help="of timed steps per measurement")
    args = parser.parse_args(argv)
    result = measure(args.target, args.draft, args.device, args.dtype, args.trust_remote_code, args.seconds)
    print("\n".join(lines(result)), flush=True)
    return result


if __name__ == "__main__":
    main()
