"""Soak: does any process's memory keep growing over thousands of streams, on each CPU kernel; and
after them, does every process let go of its sessions and stop cleanly on SIGTERM?

Serves a stack (`specmesh serve`'s launcher: orchestrator, draft and target processes) per kernel
(--kernels: the services' --cpu-linear), sends --streams requests of random prompt lengths and
max_tokens, --concurrency at a time (a share of them, --cancel-fraction, cancelled after a random
number of responses, 0 to 6: at 0, before the first one arrives), and prints every process's
resident set size (RSS) after the first --checkpoint streams and after all of them, with the growth
between. After the last stream it polls each process's Prometheus /metrics until what it holds open
is 0 (the services' `specmesh_sessions_open`, the orchestrator's running and waiting requests) and
prints the seconds that took, or what was still open --sessions-deadline seconds after the last
stream. Then it sends SIGTERM to the orchestrator process, as `specmesh serve` gets it (it drains,
then stops the draft and target with SIGTERM), and prints each process's exit code and whether it
logged "drained and stopped". The stack's log passes through to stderr. The machine and the command
come first.

It passes when, with each kernel: every process's RSS after all streams is within 10 % of its RSS
after the first --checkpoint (the recorded soak: 5,000 streams against the first 500); every process's
open sessions are 0 within 10 s of the last stream (the recorded run of 20,000 cancelled streams, in
waves of 200: --cancel-fraction 1 --concurrency 200); every process drains and exits 0 on the SIGTERM.

    python -m benchmarks.soak_rss
    python -m benchmarks.soak_rss --streams 5000 --checkpoint 500 --cancel-fraction 0 --kernels onednn torch
    python -m benchmarks.soak_rss --streams 20000 --checkpoint 2000 --cancel-fraction 1 --concurrency 200
    python -m benchmarks.soak_rss --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --streams 1200
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from collections import Counter
from pathlib import Path

import grpc

from benchmarks.concurrency_memory import MIB, mixed_requests, service_processes, tiny_pair
from benchmarks.stack_checks import StackLog, print_header, stop_stack, wait_closed
from orchestrator.decoding.request import LoopConfig
from orchestrator.control.launch import ProcessGroup, StackOptions, start_stack
from orchestrator.serving.options import FrontendOptions
from specmesh.loading.models import load_tokenizer
from specmesh.server.service import ServiceOptions
from specmesh.v1 import generation_pb2_grpc

GROWTH_LIMIT = 0.10
EARLY_CANCEL_S = 0.2  # a stream cancelled before its first response is cancelled within this


async def one_stream(stub, request, cancel_after: int | None, delay_s: float) -> str:
    """Run a stream to its end, or cancel it after `cancel_after` responses (0: after `delay_s`, unanswered);
    'completed', 'cancelled' or the status code of its failure."""
    call = stub.Generate(request, timeout=3600)
    try:
        if cancel_after == 0:
            await asyncio.sleep(delay_s)  # somewhere in its admission, session opens or prefill
            return "cancelled" if call.cancel() else "completed"
        read = 0
        async for _ in call:
            read += 1
            if cancel_after is not None and read >= cancel_after:
                return "cancelled" if call.cancel() else "completed"
    except grpc.aio.AioRpcError as error:
        return error.code().name
    return "completed"


async def run_streams(endpoint: str, requests, args, rng: random.Random, processes) -> tuple[dict, Counter]:
    """RSS per process after the checkpoint and at the end; the streams' outcomes."""
    rss: dict[str, list[int]] = {name: [] for name in processes}
    outcomes: Counter = Counter()
    async with grpc.aio.insecure_channel(endpoint) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        queue = iter(enumerate(requests))
        started, done = time.monotonic(), [0]

        async def worker() -> None:
            for index, request in queue:
                cancel = rng.randint(0, 6) if rng.random() < args.cancel_fraction else None
                outcomes[await one_stream(stub, request, cancel, rng.uniform(0, EARLY_CANCEL_S))] += 1
                if index + 1 == args.checkpoint:
                    record(rss, processes)
                done[0] += 1
                if done[0] % args.checkpoint == 0:
                    print(f"  {done[0]} streams done in {time.monotonic() - started:.0f} s", flush=True)
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    record(rss, processes)
    return rss, outcomes


def record(rss: dict[str, list[int]], processes) -> None:
    for name, process in processes.items():
        rss[name].append(process.memory_info().rss)


def soak(kernel: str, target: str, draft: str, args) -> dict:
    """One kernel's stack: RSS per process, seconds until its open sessions were 0, how it stopped."""
    requests = mixed_requests(load_tokenizer(target), args)
    group = ProcessGroup()
    log = StackLog()
    try:
        ready = start_stack(group, StackOptions(
            target=ServiceOptions(model=target, cpu_linear=kernel, metrics_port=0),
            draft=ServiceOptions(model=draft, cpu_linear=kernel, metrics_port=0),
            loop=LoopConfig(num_speculative_tokens=args.k), address="127.0.0.1:0",
            orchestrator=FrontendOptions(metrics_port=0)))["orchestrator"]
        log.detach()
        processes = service_processes(group.processes[0].pid, ready.replica_addresses or {})
        rss, outcomes = asyncio.run(run_streams(f"127.0.0.1:{ready.port}", requests, args, random.Random(args.seed), processes))
        last_stream = time.monotonic()
        ports = {"orchestrator": ready.metrics_port, **(ready.replica_metrics_ports or {})}
        closed = wait_closed(ports, last_stream, args.sessions_deadline)
        return {"rss": rss, "outcomes": dict(outcomes), "closed": closed, "stopped": stop_stack(group.processes[0], log, list(processes))}
    finally:
        log.close()
        group.stop()


def report(kernel: str, result: dict, args) -> None:
    print(f"{kernel}: {args.streams} streams, {args.concurrency} at a time, {args.cancel_fraction:.0%} cancelled")
    print("  streams: " + ", ".join(f"{count} {outcome}" for outcome, count in sorted(result["outcomes"].items())))
    for name, (checkpoint, end) in result["rss"].items():
        growth = end / checkpoint - 1
        verdict = "ok" if growth <= GROWTH_LIMIT else "GROWS"
        print(f"  {name:12s} RSS after {args.checkpoint}: {checkpoint / MIB:7.1f} MiB, after {args.streams}: "
              f"{end / MIB:7.1f} MiB ({growth:+.1%}) {verdict}")
    for name, closed in result["closed"].items():
        done = isinstance(closed, float)
        print(f"  {name:12s} open sessions 0 " + (f"{closed:.2f} s after the last stream" if done else
                                                    f"NOT within {args.sessions_deadline:g} s: {closed}"))
    for name, (code, drained) in result["stopped"].items():
        verdict = "ok" if code == 0 and drained else "FAILED"
        print(f"  {name:12s} SIGTERM: exit code {code}, {'drained and stopped' if drained else 'NOT drained'} "
              f"{verdict}")


def main(argv: list[str] | None = None) -> dict[str, dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=None, help="target model (default: a tiny one built here)")
    parser.add_argument("--draft", default=None, help="draft model (default: a tiny one)")
    parser.add_argument("--kernels", nargs="+", default=["torch", "onednn"], choices=["torch", "onednn"])
    parser.add_argument("--streams", type=int, default=2000)
    parser.add_argument("--checkpoint", type=int, default=500, help="RSS is compared against after this many")
    parser.add_argument("--concurrency", type=int, default=16, help="streams at a time (the recorded cancelled run: 200)")
    parser.add_argument("--cancel-fraction", type=float, default=0.3, help="share cancelled (1: every stream)")
    parser.add_argument("--prompt-tokens", type=int, nargs=2, default=(4, 600), metavar=("MIN", "MAX"))
    parser.add_argument("--max-tokens", type=int, nargs=2, default=(4, 64), metavar=("MIN", "MAX"))
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sessions-deadline", type=float, default=10.0, metavar="SECONDS",
                        help="how long after the last stream every process's open sessions must be 0")
    args = parser.parse_args(argv)
    args.requests = args.streams  # what mixed_requests reads
    print_header("benchmarks.soak_rss", argv)
    results = {}
    with tempfile.TemporaryDirectory() as root:
        target, draft = (args.target, args.draft) if args.target else tiny_pair(Path(root))
        for kernel in args.kernels:
            started = time.monotonic()
            results[kernel] = soak(kernel, target, draft, args)
            report(kernel, results[kernel], args)
            print(f"  ({time.monotonic() - started:.0f} s with the stack's start)", flush=True)
    return results


if __name__ == "__main__":
    main()
