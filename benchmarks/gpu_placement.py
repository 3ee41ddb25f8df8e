"""Where the draft should run beside a GPU target: what two processes time-sharing one GPU cost.

The services are separate processes, so a draft on the target's GPU time-shares it with the target
(CUDA contexts take turns unless MPS runs them concurrently). This times one-row decode steps of the
target and of the draft, each alone in its process, then both at once in two processes, then both at
once under CUDA MPS where its control daemon starts, and the draft alone on the CPU:

    python -m benchmarks.gpu_placement --target DIR --draft DIR --trust-remote-code

Prints and returns median ms a step per placement (benchmarks/gpu_speculation.py runs it on its pair).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from queue import Empty

CONTEXT_TOKENS = 128  # cached tokens behind each timed step
WARM_STEPS = 5
CHILD_DEADLINE_S = 600.0  # loading a 7B model and timing it takes well under this


class StepTimer:
    """A model loaded once in this process, timing one-row decode steps at a fixed cached length."""

    def __init__(self, model_dir: str, device: str, dtype: str, trust: bool):
        import torch
        from transformers import DynamicCache

        from specmesh.loading.hf_compat import cache_kwargs
        from specmesh.loading.precision import load_model_in

        self.torch, self.device = torch, device
        self.model, _ = load_model_in(model_dir, device, dtype, trust_remote_code=trust)
        self.cache = DynamicCache()
        self.kwargs = cache_kwargs(self.model, self.cache)
        with torch.inference_mode():
            self.model(torch.full((1, CONTEXT_TOKENS), 100, device=device), **self.kwargs, use_cache=True)
        self.row = torch.full((1, 1), 101, device=device)  # [1, 1]
        for _ in range(WARM_STEPS):
            self.step()

    def step(self) -> float:
        start = time.perf_counter()
        with self.torch.inference_mode():
            self.model(self.row, **self.kwargs, use_cache=True)
        self.cache.crop(-1)  # every step at the same length
        if self.device.startswith("cuda"):
            self.torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1e3

    def median_ms(self, seconds: float) -> float:
        times, end = [], time.perf_counter() + seconds
        while time.perf_counter() < end:
            times.append(self.step())
        return statistics.median(times)


def _worker(commands, results, barrier, model_dir: str, device: str, dtype: str, trust: bool) -> None:
    """Load once, then per command: ("alone", s) times steps at once, ("together", s) after the barrier."""
    timer = StepTimer(model_dir, device, dtype, trust)
    results.put(("ready", model_dir, 0.0))
    while (command := commands.get()) is not None:
        phase, seconds = command
        if phase == "together":
            barrier.wait()
        results.put((phase, model_dir, timer.median_ms(seconds)))


class Workers:
    """One step-timing process per model, loaded once, run in phases: each alone, then all together."""

    def __init__(self, models: list[str], device: str, dtype: str, trust: bool):
        context = multiprocessing.get_context("spawn")
        self.results, barrier = context.Queue(), context.Barrier(len(models))
        self.commands = {model: context.Queue() for model in models}
        self.children = [context.Process(target=_worker, args=(self.commands[model], self.results, barrier,
                                                                model, device, dtype, trust)) for model in models]
        for child in self.children:
            child.start()
        self.collect(len(models))  # every model loaded

    def alone(self, model: str, seconds: float) -> float:
        self.commands[model].put(("alone", seconds))
        return self.collect(1)[model]

    def together(self, seconds: float) -> dict[str, float]:
        for queue in self.commands.values():
            queue.put(("together", seconds))
        return self.collect(len(self.commands))

    def collect(self, count: int) -> dict[str, float]:
        got, deadline = {}, time.monotonic() + CHILD_DEADLINE_S
        while len(got) < count:
            try:
                _, model, ms = self.results.get(timeout=1.0)
                got[model] = ms
            except Empty:
                failed = [child.exitcode for child in self.children if child.exitcode not in (None, 0)]
                if failed or time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError(f"a step-timing process failed (exit codes {failed}) or ran past its "
                                       "deadline") from None
        return got

    def close(self) -> None:
        for queue in self.commands.values():
            queue.put(None)
        for child in self.children:
            child.join(timeout=60)
            if child.is_alive():
                child.kill()


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
    workers = Workers([target, draft], device, dtype, trust)
    try:
        alone = {"target": workers.alone(target, seconds), "draft": workers.alone(draft, seconds)}
        shared = workers.together(seconds)
    finally:
        workers.close()
    result = {"alone_ms": alone, "shared_ms": {"target": shared[target], "draft": shared[draft]},
              "draft_on_cpu_ms": StepTimer(draft, "cpu", "auto", trust).median_ms(seconds), "mps_ms": None, "mps": ""}
    if device.startswith("cuda"):
        result["mps_ms"], result["mps"] = under_mps(target, draft, device, dtype, trust, seconds)
    return result


def under_mps(target: str, draft: str, device: str, dtype: str, trust: bool, seconds: float
              ) -> tuple[dict | None, str]:
    """Both models stepping at once in processes started under a fresh MPS daemon; or None and why not."""
    env, why = start_mps()
    if env is None:
        return None, why
    os.environ.update(env)  # the spawned children inherit it and reach the daemon
    try:
        workers = Workers([target, draft], device, dtype, trust)
        try:
            both = workers.together(seconds)
        finally:
            workers.close()
    finally:
        stop_mps(env)
        for key in env:
            del os.environ[key]
    return {"target": both[target], "draft": both[draft]}, "on"


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
