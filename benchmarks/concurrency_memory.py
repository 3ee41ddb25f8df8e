"""Memory under concurrency: 64 requests of mixed lengths at once, and what the services hold.

Serves a stack (three processes, `specmesh serve`'s launcher) and samples the resident set size
(RSS) of the draft and target service processes, and of the orchestrator, every 50 ms (psutil, from
the launcher's process handle: the services are the orchestrator process's children, told apart by
the gRPC port each listens on). It records a baseline while idle, sends 64 requests at once with
random prompt lengths and max_tokens (seeded), and records a stretch after they are answered.
Prints per process the baseline, peak and after-load RSS; requests completed and failed
(RESOURCE_EXHAUSTED counted apart from other errors); wall time and output tokens per second.

It passes when: every request is answered (completed, or refused RESOURCE_EXHAUSTED: a budget doing
its job) and the peak RSS of each service is what its KV budget allows; the after-load RSS shows
whether the sessions' memory was given back.

--target-option and --draft-option set fields of each service's ServiceOptions (specmesh.server.service),
e.g. `--target-option max_sessions=32`; `--kv-cache-memory SIZE` sets both services' KV budget
(the services' own flag, e.g. 1GiB or 0.2).

By default the stack is tiny random-weight models built on the fly (benchmarks/tiny_models.py, with a
4096-token context); --target and --draft take real ones:

    python -m benchmarks.concurrency_memory
    python -m benchmarks.concurrency_memory --requests 128 --prompt-tokens 16 2048 --max-tokens 16 512
    python -m benchmarks.concurrency_memory --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import dataclasses
import random
import tempfile
import threading
import time
from pathlib import Path

import grpc
import psutil

from orchestrator.decoding.request import LoopConfig
from orchestrator.control.launch import ProcessGroup, StackOptions, start_stack
from orchestrator.serving.options import FrontendOptions
from specmesh.engine.kv_budget import parse_kv_cache_memory
from specmesh.loading.models import load_tokenizer
from specmesh.server.service import ServiceOptions
from specmesh.v1 import generation_pb2, generation_pb2_grpc

SAMPLE_INTERVAL_S = 0.05
MIB = 1024 * 1024


def tiny_pair(root: Path) -> tuple[str, str]:
    from benchmarks.tiny_models import TINY_CORPUS, build_tiny_model, build_tokenizer, perturb_model
    tokenizer = build_tokenizer(root / "tokenizer", corpus=TINY_CORPUS)
    target = build_tiny_model(root / "target", "llama", tokenizer, seed=1, max_positions=4096)
    return str(target), str(perturb_model(target, root / "draft", seed=101))


def service_option(text: str) -> tuple[str, object]:
    """KEY=VALUE for a ServiceOptions field; VALUE a Python literal, else a string."""
    key, _, value = text.partition("=")
    names = {f.name for f in dataclasses.fields(ServiceOptions)}
    if key not in names or not value:
        raise argparse.ArgumentTypeError(f"want KEY=VALUE with KEY one of {sorted(names)}")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


class RssSampler:
    """RSS of named processes every SAMPLE_INTERVAL_S, on a thread, as (time, {name: bytes})."""

    def __init__(self, processes: dict[str, psutil.Process]):
        self.processes = processes
        self.samples: list[tuple[float, dict[str, int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rss-sampler", daemon=True)

    def __enter__(self) -> "RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *_) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.is_set():
            rss = {}
            for name, process in self.processes.items():
                try:
                    rss[name] = process.memory_info().rss
                except psutil.Error:  # exited: a dead service shows as missing samples
                    pass
            self.samples.append((time.perf_counter(), rss))
            self._stop.wait(SAMPLE_INTERVAL_S)  # paces the sampling; nothing waits on it

    def stats(self, name: str, start: float, end: float) -> tuple[int, int]:
        """(median, peak) RSS of `name` over [start, end]; (0, 0) without samples."""
        values = sorted(rss[name] for t, rss in self.samples if start <= t <= end and name in rss)
        return (values[len(values) // 2], values[-1]) if values else (0, 0)


def service_processes(orchestrator_pid: int, addresses: dict[str, str]) -> dict[str, psutil.Process]:
    """The orchestrator and its child services, by role (matched on the port each listens on)."""
    processes = {"orchestrator": psutil.Process(orchestrator_pid)}
    ports = {int(address.rsplit(":", 1)[1]): role for role, address in addresses.items()}
    for child in processes["orchestrator"].children(recursive=True):
        for connection in child.net_connections(kind="tcp"):
            if connection.status == psutil.CONN_LISTEN and connection.laddr.port in ports:
                processes[ports[connection.laddr.port]] = child
    return processes


def mixed_requests(tokenizer, args) -> list[generation_pb2.GenerateRequest]:
    """args.requests prompts of random token lengths (varied code lines) with random max_tokens."""
    rng = random.Random(args.seed)
    lines = "".join(f"def step_{i}(x):\n    return x * {i} + {i * i % 97}\n" for i in range(2000))
    corpus = tokenizer.encode(lines)
    requests = []
    for _ in range(args.requests):
        length = rng.randint(*args.prompt_tokens)
        start = rng.randrange(max(1, len(corpus) - length))
        requests.append(generation_pb2.GenerateRequest(
            prompt=tokenizer.decode(corpus[start: start + length]), max_tokens=rng.randint(*args.max_tokens),
            temperature=args.temperature, seed=rng.randrange(2**31)))
    return requests


async def one_request(stub, request) -> tuple[int, str]:
    """(output tokens, outcome): 'OK' or the status code's name."""
    tokens = 0
    try:
        async for response in stub.Generate(request, timeout=3600):
            tokens += len(response.token_ids)
    except grpc.aio.AioRpcError as error:
        return tokens, error.code().name
    return tokens, "OK"


async def load(endpoint: str, requests) -> list[tuple[int, str]]:
    async with grpc.aio.insecure_channel(endpoint) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        return await asyncio.gather(*(one_request(stub, r) for r in requests))


def quiet_stretch(seconds: float) -> tuple[float, float]:
    start = time.perf_counter()
    time.sleep(seconds)  # an idle stretch for the sampler to measure, not synchronisation
    return start, time.perf_counter()


def report(sampler: RssSampler, before, during, after, results) -> None:
    for name in sampler.processes:
        baseline, _ = sampler.stats(name, *before)
        _, peak = sampler.stats(name, *during)
        settled, _ = sampler.stats(name, *after)
        print(f"  {name:12s} RSS: baseline {baseline / MIB:8.1f} MiB, peak under load {peak / MIB:8.1f} MiB "
              f"(+{(peak - baseline) / MIB:.1f}), after {settled / MIB:8.1f} MiB")
    outcomes = [outcome for _, outcome in results]
    tokens = sum(t for t, _ in results)
    wall = during[1] - during[0]
    others = {code: outcomes.count(code) for code in set(outcomes) - {"OK", "RESOURCE_EXHAUSTED"}}
    print(f"  requests: {outcomes.count('OK')} completed, {outcomes.count('RESOURCE_EXHAUSTED')} RESOURCE_EXHAUSTED, "
          f"{sum(others.values())} other failures" + (f" {others}" if others else ""))
    print(f"  wall {wall:.1f} s, {tokens} output tokens, {tokens / wall:.1f} tokens/s")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=None, help="target model (default: a tiny one built here)")
    parser.add_argument("--draft", default=None, help="draft model (default: a tiny one); 'none': target-only")
    parser.add_argument("--requests", type=int, default=64, help="all sent at once")
    parser.add_argument("--prompt-tokens", type=int, nargs=2, default=(16, 1024), metavar=("MIN", "MAX"))
    parser.add_argument("--max-tokens", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX"))
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--k", type=int, default=3, help="the server's default draft tokens per round")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quiet-seconds", type=float, default=1.0, help="idle sampling before and after the load")
    parser.add_argument("--kv-cache-memory", type=parse_kv_cache_memory, default=None, metavar="SIZE",
                        help="both services' KV budget (default: theirs)")
    parser.add_argument("--target-option", type=service_option, action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--draft-option", type=service_option, action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    budget = {} if args.kv_cache_memory is None else {"kv_cache_memory": args.kv_cache_memory}
    with tempfile.TemporaryDirectory() as root:
        target, draft = (args.target, args.draft) if args.target else tiny_pair(Path(root))
        draft = None if draft is None or draft.lower() == "none" else draft
        requests = mixed_requests(load_tokenizer(target), args)
        group = ProcessGroup()
        try:
            ready = start_stack(group, StackOptions(
                target=ServiceOptions(model=target, **budget, **dict(args.target_option)),
                draft=ServiceOptions(model=draft, **budget, **dict(args.draft_option)) if draft else None,
                loop=LoopConfig(num_speculative_tokens=args.k), address="127.0.0.1:0",
                orchestrator=FrontendOptions()))["orchestrator"]
            processes = service_processes(group.processes[0].pid, ready.replica_addresses or {})
            print(f"{args.requests} concurrent requests, prompts {args.prompt_tokens[0]}..{args.prompt_tokens[1]} "
                  f"tokens, max_tokens {args.max_tokens[0]}..{args.max_tokens[1]}; processes {sorted(processes)}")
            with RssSampler(processes) as sampler:
                before = quiet_stretch(args.quiet_seconds)
                start = time.perf_counter()
                results = asyncio.run(load(f"127.0.0.1:{ready.port}", requests))
                during = (start, time.perf_counter())
                after = quiet_stretch(args.quiet_seconds)
        finally:
            group.stop()
    report(sampler, before, during, after, results)


if __name__ == "__main__":
    main()
