"""Hostile load on `specmesh serve --api-key`: idle connections, then floods of unauthenticated calls.

Usage (tiny models are enough: what is measured is the front door, not decoding):

    python -m benchmarks.hostile_load --target DIR [--idle 20000] [--flood 10000] [--floods 3]

It starts `specmesh serve --api-key` (target only, `--config` for extra settings) with its output
in a log file, then from this process runs authenticated requests throughout (one gRPC Generate
over a kept channel and one HTTP completion over a new connection, in turn) and:
  1. baseline: those requests alone, for --baseline-s;
  2. idle: other processes (8,000 connections each at most, within a usual file limit) hold --idle
     TCP connections that never send a byte, split between the gRPC and HTTP ports, and reopen
     each one the server closes after --reconnect-s, for --idle-s;
  3. floods: another process sends --flood Generate calls without the key at once, --floods times.
It prints the authenticated requests' failures and latency against the baseline, how much the
server's log grew, the connections the attackers held (summed over them; "most open at once" is
the sum of each one's peak), and each flood's status counts; with the machine and the command.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import grpc
import httpx

from benchmarks.serve_process import ServeProcess, start_serve
from specmesh.server.connections import raise_file_limit
from specmesh.v1 import generation_pb2, generation_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]  # the attackers run as `python -m benchmarks.hostile_load` from it
API_KEY = "hostile-load-key"
REQUEST = generation_pb2.GenerateRequest(prompt="def add(a, b):", max_tokens=8, temperature=0.0)
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]
IDLE_PER_ATTACKER = 8_000  # well under a usual hard file limit per process


def _split(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def start(args: argparse.Namespace, log_path: Path) -> ServeProcess:
    """`specmesh serve --api-key`, target only, once ready (its gRPC and HTTP ports)."""
    flags = ["--port", "0", "--http-port", "0", "--metrics-port", "-1", "--api-key", API_KEY, "--target", args.target,
             "--draft", "none", *(["--config", args.config] if args.config else [])]
    return start_serve(flags, log_path, timeout_s=300, http=True)


class Probe:
    """Authenticated requests in turn, gRPC and HTTP, recording latency and failures per phase."""

    def __init__(self, grpc_port: int, http_port: int):
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}")
        self.http_url = f"http://127.0.0.1:{http_port}"
        self.latencies: dict[str, list[float]] = {"grpc": [], "http": []}
        self.failures: Counter = Counter()

    def reset(self) -> None:
        self.latencies, self.failures = {"grpc": [], "http": []}, Counter()

    async def grpc_once(self) -> None:
        stub = generation_pb2_grpc.GenerationStub(self.channel)
        started = time.perf_counter()
        try:
            async for _ in stub.Generate(REQUEST, timeout=30, metadata=(("authorization", f"Bearer {API_KEY}"),)):
                pass
            self.latencies["grpc"].append(time.perf_counter() - started)
        except grpc.aio.AioRpcError as error:
            self.failures[f"grpc {error.code().name}"] += 1

    async def http_once(self) -> None:
        started = time.perf_counter()
        try:
            async with httpx.AsyncClient(base_url=self.http_url, timeout=30,
                                         headers={"authorization": f"Bearer {API_KEY}"}) as client:
                reply = await client.post("/v1/completions", json={"prompt": REQUEST.prompt, "max_tokens": 8})
            if reply.status_code == 200:
                self.latencies["http"].append(time.perf_counter() - started)
            else:
                self.failures[f"http {reply.status_code}"] += 1
        except httpx.HTTPError as error:
            self.failures[f"http {type(error).__name__}"] += 1

    async def run_until(self, done: asyncio.Event) -> None:
        while not done.is_set():
            await self.grpc_once()
            await self.http_once()

    def summary(self, baseline: dict[str, float] | None = None) -> str:
        parts = []
        for kind, values in self.latencies.items():
            if not values:
                parts.append(f"{kind}: no successes")
                continue
            p50 = statistics.median(values)
            p95 = sorted(values)[int(0.95 * (len(values) - 1))]
            ratio = f" ({p50 / baseline[kind]:.2f}x baseline p50)" if baseline and baseline.get(kind) else ""
            parts.append(f"{kind}: {len(values)} ok, p50 {p50 * 1000:.0f} ms, p95 {p95 * 1000:.0f} ms{ratio}")
        failed = ", ".join(f"{k} x{v}" for k, v in sorted(self.failures.items())) or "none"
        return "; ".join(parts) + f"; failures: {failed}"

    def medians(self) -> dict[str, float]:
        return {kind: statistics.median(values) for kind, values in self.latencies.items() if values}


async def hold_idle(ports: list[int], count: int, seconds: float, reconnect_s: float) -> dict:
    """`count` silent connections over `ports`, each reopened `reconnect_s` after the server closes it
    (0: at once, a storm of connection attempts rather than idle connections), for `seconds`."""
    stats = Counter()
    stop_at = time.monotonic() + seconds

    async def slot(port: int) -> None:
        while time.monotonic() < stop_at:
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                stats["connect errors"] += 1
                await asyncio.sleep(0.1)
                continue
            stats["opened"] += 1
            stats["open"] += 1
            try:
                async with asyncio.timeout(max(0.01, stop_at - time.monotonic())):
                    while await reader.read(1 << 16):  # a gRPC server's SETTINGS frame; then the end
                        pass
                stats["closed by the server"] += 1
            except TimeoutError:
                pass
            except OSError:
                stats["closed by the server"] += 1
            stats["open"] -= 1
            writer.close()
            await asyncio.sleep(reconnect_s)

    async def sample() -> None:
        while time.monotonic() < stop_at:
            stats["most open at once"] = max(stats["most open at once"], stats["open"])
            await asyncio.sleep(0.5)
    await asyncio.gather(sample(), *(slot(ports[i % len(ports)]) for i in range(count)))
    return dict(stats)


async def flood(port: int, calls: int) -> dict:
    """`calls` Generate calls without the key, all at once over one connected channel."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=OWN_CONNECTION) as channel:
        await channel.channel_ready()
        stub = generation_pb2_grpc.GenerationStub(channel)

        async def call() -> str:
            try:
                async for _ in stub.Generate(REQUEST, timeout=120):
                    pass
                return "OK"
            except grpc.aio.AioRpcError as error:
                return error.code().name
        return dict(Counter(await asyncio.gather(*(call() for _ in range(calls)))))


async def measure_while(probe: Probe, *attacks: list[str]) -> dict:
    """Run this script as the attackers (`--attack ...`, one process each) while the probe runs; their
    reports, summed."""
    children = [await asyncio.create_subprocess_exec(sys.executable, "-m", "benchmarks.hostile_load", "--attack",
                                                     *attack_args, stdout=asyncio.subprocess.PIPE, cwd=ROOT)
                for attack_args in attacks]
    done = asyncio.Event()
    prober = asyncio.ensure_future(probe.run_until(done))
    outputs = await asyncio.gather(*(child.communicate() for child in children))
    done.set()
    await prober
    total = Counter()
    for output, _ in outputs:
        total.update(json.loads(output.decode().strip().splitlines()[-1]))
    return dict(total)


def attack(argv: list[str]) -> None:
    """The attacker process: `idle PORT,PORT COUNT SECONDS RECONNECT_S` or `flood PORT CALLS`; prints a JSON report."""
    raise_file_limit()
    if argv[0] == "idle":
        ports = [int(port) for port in argv[1].split(",")]
        report = asyncio.run(hold_idle(ports, int(argv[2]), float(argv[3]), float(argv[4])))
    else:
        report = asyncio.run(flood(int(argv[1]), int(argv[2])))
    print(json.dumps(report), flush=True)


async def run(args: argparse.Namespace, grpc_port: int, http_port: int, log_path: Path) -> dict:
    """Every phase in turn; returns {phase: failures of the authenticated requests} and the floods' statuses."""
    probe = Probe(grpc_port, http_port)
    done = asyncio.Event()
    asyncio.get_running_loop().call_later(args.baseline_s, done.set)
    await probe.run_until(done)
    baseline = probe.medians()
    print(f"baseline ({args.baseline_s:g} s): {probe.summary()}", flush=True)
    size_before = log_path.stat().st_size
    probe.reset()
    # One process holds at most its file limit: the connections are spread over enough attackers.
    attackers = -(-args.idle // IDLE_PER_ATTACKER)
    held = await measure_while(probe, *(["idle", f"{grpc_port},{http_port}", str(share), str(args.idle_s),
                                         str(args.reconnect_s)]
                                        for share in _split(args.idle, attackers)))
    growth = log_path.stat().st_size - size_before
    print(f"idle ({args.idle} connections for {args.idle_s:g} s): {probe.summary(baseline)}", flush=True)
    print(f"  attacker: {held}; server log grew {growth / 1e6:.3f} MB", flush=True)
    results = {"idle": dict(probe.failures), "log_growth": growth, "floods": []}
    for round_ in range(1, args.floods + 1):
        probe.reset()
        statuses = await measure_while(probe, ["flood", str(grpc_port), str(args.flood)])
        print(f"flood {round_} ({args.flood} unauthenticated Generate calls): statuses {statuses}; "
              f"authenticated: {probe.summary(baseline)}", flush=True)
        results["floods"].append((statuses, dict(probe.failures)))
    print(f"server log: {log_path.stat().st_size / 1e6:.3f} MB in all", flush=True)
    await probe.channel.close()
    return results


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True, help="model directory or hub id (a tiny one is enough)")
    parser.add_argument("--config", help="extra `specmesh serve --config` file (e.g. handshake-timeout: 5)")
    parser.add_argument("--idle", type=int, default=20_000, help="idle connections the attacker holds")
    parser.add_argument("--idle-s", type=float, default=60.0, help="how long it holds them")
    parser.add_argument("--reconnect-s", type=float, default=0.5,
                        help="pause before reopening a connection the server closed (0: reconnect at once)")
    parser.add_argument("--flood", type=int, default=10_000, help="unauthenticated calls per flood")
    parser.add_argument("--floods", type=int, default=3)
    parser.add_argument("--baseline-s", type=float, default=15.0)
    args = parser.parse_args(argv)
    limit = raise_file_limit()
    print(f"machine: {platform.platform()}, {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}; "
          f"RLIMIT_NOFILE {resource.getrlimit(resource.RLIMIT_NOFILE)} (raised to {limit})")
    print("command: python -m benchmarks.hostile_load " + " ".join(argv if argv is not None else sys.argv[1:]),
          flush=True)
    with tempfile.TemporaryDirectory() as scratch:
        log_path = Path(scratch) / "serve.log"
        serve = start(args, log_path)
        try:
            return asyncio.run(run(args, serve.grpc_port, serve.http_port, log_path))
        finally:
            serve.stop()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--attack"]:
        attack(sys.argv[2:])
    else:
        main()
