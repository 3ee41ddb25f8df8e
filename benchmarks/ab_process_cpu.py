"""Speculation on against off, pass by pass, with the CPU seconds each process of the server spent.

Runs passes of the bench's 16 built-in prompts (32 tokens, greedy) at one concurrency against a
running `specmesh serve`, in the bench's order (on, off, off, on, ...), after one warm-up pass of
each mode, and prints per pass: the mode, its wall time, output tokens/s, and the CPU seconds of
every process under the server's (orchestrator, target, draft) and of this client. It answers
whether speculation on costs anything where it drafts nothing: the same target-only steps, and
what else burns CPU beside them.

    specmesh serve --http-port -1 &
    python benchmarks/ab_process_cpu.py --pid $(pgrep -f "specmesh serve") --concurrency 16 --passes 8
"""
from __future__ import annotations

import argparse
import asyncio
import math
import statistics

import psutil

from orchestrator.bench.clients import GrpcClient
from orchestrator.bench.modes import DEFAULT, OFF
from orchestrator.bench.prompts import KINDS, prompt_pool, select_prompts
from orchestrator.bench.runner import Configuration, LoadSettings, run_load
from specmesh.models import load_tokenizer
from specmesh.roles import TARGET

ORDER = (True, False, False, True)  # speculation on / off, the bench's ABBA passes
# The bench's flags here: 32 tokens, greedy (Configuration), all prompts at once under the concurrency cap.
LOAD = LoadSettings(max_tokens=32, request_rate=math.inf, seed=0, num_speculative_tokens=None, timeout_s=600.0,
                    progress=False)


def cpu_seconds(server_pid: int) -> dict[int, float]:
    """User + system CPU seconds of the server, its children and this process, by pid."""
    root = psutil.Process(server_pid)
    seconds = {}
    for process in [root, *root.children(recursive=True), psutil.Process()]:
        try:
            times = process.cpu_times()
        except psutil.Error:  # gone since the listing
            continue
        seconds[process.pid] = times.user + times.system
    return seconds


async def one_pass(client: GrpcClient, prompts, concurrency: int, speculation: bool) -> tuple[float, int]:
    """(wall seconds, output tokens) of every prompt sent, `concurrency` at a time (the bench's own pass)."""
    mode = DEFAULT if speculation else OFF
    records, wall = await run_load(client, prompts, Configuration(concurrency, 0.0), LOAD, mode)
    return wall, sum(r.output_tokens for r in records)


async def main(args: argparse.Namespace) -> None:
    client = GrpcClient(args.endpoint, load_tokenizer(args.tokenizer))
    prompts = select_prompts(prompt_pool(list(KINDS), None), 16, 0)
    throughput: dict[bool, list[float]] = {True: [], False: []}
    try:
        for speculation in (True, False):
            await one_pass(client, prompts, args.concurrency, speculation)
        for index in range(args.passes):
            speculation = ORDER[index % len(ORDER)]
            before = cpu_seconds(args.pid)
            wall, tokens = await one_pass(client, prompts, args.concurrency, speculation)
            after = cpu_seconds(args.pid)
            spent = sorted(((after[p] - before[p], p) for p in after if p in before), reverse=True)
            throughput[speculation].append(tokens / wall)
            print(f"{'on ' if speculation else 'off'} wall {wall:5.1f} s  {tokens / wall:5.2f} tok/s  CPU s by pid: "
                  + "  ".join(f"{pid}={s:.1f}" for s, pid in spent if s >= 0.05), flush=True)
    finally:
        await client.close()
    if throughput[True] and throughput[False]:
        print(f"on/off (medians): {statistics.median(throughput[True]) / statistics.median(throughput[False]):.3f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--endpoint", default="127.0.0.1:50051")
    parser.add_argument("--pid", type=int, required=True, help="the `specmesh serve` process")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--passes", type=int, default=8)
    parser.add_argument("--tokenizer", default=TARGET.default_model, help="for the chat prompts (the target's)")
    asyncio.run(main(parser.parse_args()))
