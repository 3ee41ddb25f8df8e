"""Fault recovery of a deployment: kill a draft or target replica mid-request, time the way back.

Usage (tiny models are enough: recovery is process start-up and model load, not decoding):

    python -m benchmarks.fault_recovery --backend local --target DIR --draft DIR
    python -m benchmarks.fault_recovery --backend ray --target DIR --draft DIR

Per role and trial: start a greedy request, kill the role's only replica after the
second round (SIGKILL of the child process in local mode; `ray.kill` of the actor,
which Ray restarts, in Ray mode), and measure
  - recovery: from the kill until the pool routes to the replica again (a new incarnation);
  - extra delay: the request's wall time minus the same request's without a kill.
It checks that the killed request's output equals the undisturbed one token for token.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import time

from orchestrator.decoding.loop import SpeculativeGeneration
from orchestrator.decoding.request import GenerationRequest, LoopConfig
from orchestrator.serving.pool import PoolSpec
from orchestrator.control.ray_cli import init_ray
from orchestrator.control.pools import Pools
from orchestrator.control.options import PoolsOptions
from orchestrator.control.build import servicer_over_pools
from orchestrator.control.options import RestartPolicy
from specmesh.loading.models import load_tokenizer
from specmesh.engine.sampling_params import SamplingParams
from specmesh.server.service import ReplicaConfig, ServiceOptions

PROMPT = "The quick brown fox"
RECOVERY_TIMEOUT_S = 300.0


async def generate(servicer, tokenizer, max_tokens: int, kill=None) -> tuple[list[int], float]:
    """Greedy tokens and wall seconds; `kill()` runs once two rounds are done."""
    backends = servicer.backends
    request = GenerationRequest(request_id="bench", prompt_token_ids=tokenizer.encode(PROMPT), max_tokens=max_tokens,
                                sampling=SamplingParams(temperature=0.0), stop=[], num_speculative_tokens=3)
    gen = SpeculativeGeneration(request, backends.target, backends.draft, backends.eos_token_ids,
                                LoopConfig(num_speculative_tokens=3))
    tokens, started = [], time.monotonic()
    async for batch in gen.tokens():
        tokens.extend(batch)
        if kill is not None and gen.stats.rounds == 2:
            kill()
            kill = None
    return tokens, time.monotonic() - started


def killer(pools: Pools, role: str, backend: str):
    """A function that kills the role's only replica the way a crash would."""
    controller = pools.controllers[role]
    if backend == "local":
        (replica,) = controller.replicas.values()
        return lambda: os.kill(replica.process.pid, signal.SIGKILL)
    import ray
    (handle,) = controller.actors.values()
    return lambda: ray.kill(handle, no_restart=False)


async def wait_recovered(pools: Pools, role: str, old: set[str | None], since: float) -> float:
    pool = pools.pools[role]
    while not any(r.address not in old for r in pool.routable()):
        if time.monotonic() - since > RECOVERY_TIMEOUT_S:
            raise RuntimeError(f"{role} did not come back within {RECOVERY_TIMEOUT_S} s")
        await asyncio.sleep(0.02)
    return time.monotonic() - since


async def trial(pools: Pools, servicer, tokenizer, role: str, args) -> tuple[float, float]:
    baseline, baseline_s = await generate(servicer, tokenizer, args.max_tokens)
    old = {r.address for r in pools.pools[role].replicas.values()}
    kill, killed_at = killer(pools, role, args.backend), []

    def kill_now() -> None:
        killed_at.append(time.monotonic())
        kill()
    tokens, seconds = await generate(servicer, tokenizer, args.max_tokens, kill_now)
    if tokens != baseline:
        raise AssertionError(f"{role} kill changed the output")
    recovery = await wait_recovered(pools, role, old, killed_at[0])
    return recovery, seconds - baseline_s


def pools_options(args) -> PoolsOptions:
    def spec(role: str, model: str) -> PoolSpec:
        return PoolSpec(ReplicaConfig(role, ServiceOptions(model=model)), num_cpus=0.5)
    return PoolsOptions(backend=args.backend, target=spec("target", args.target), draft=spec("draft", args.draft),
                        check_interval_s=0.1, acquire_timeout_s=RECOVERY_TIMEOUT_S,
                        restart_policy=RestartPolicy(max_restarts=args.trials + 1))


async def main(args) -> None:
    if args.backend == "ray":
        init_ray(None, "specmesh-bench")
    tokenizer = load_tokenizer(args.target)
    pools = Pools.from_options(pools_options(args))
    servicer = await servicer_over_pools(tokenizer, pools, LoopConfig(num_speculative_tokens=3))
    try:
        await generate(servicer, tokenizer, 8)  # warm-up
        for role in ("draft", "target"):
            results = [await trial(pools, servicer, tokenizer, role, args) for _ in range(args.trials)]
            recovery = [r for r, _ in results]
            delay = [d for _, d in results]
            print(f"{args.backend:<6} {role:<7} recovery {statistics.median(recovery):6.2f} s "
                  f"(min {min(recovery):.2f}, max {max(recovery):.2f}); in-flight request's extra delay "
                  f"{statistics.median(delay):6.2f} s (min {min(delay):.2f}, max {max(delay):.2f}); "
                  f"{args.trials} trials, output identical", flush=True)
    finally:
        await pools.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=["local", "ray"], default="local")
    parser.add_argument("--target", required=True)
    parser.add_argument("--draft", required=True)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--trials", type=int, default=3)
    asyncio.run(main(parser.parse_args()))
