"""What a round's calls cost beyond the forwards: unary calls against messages on a session's round stream.

    python -m benchmarks.round_calls --model /tmp/sap/target --role target --trust-remote-code
    python -m benchmarks.round_calls --model /tmp/gpu/pair/target --trust-remote-code --device cuda --dtype bfloat16

Starts one model service (`python -m target_service` or `draft_service`), then, with the orchestrator's
own client (orchestrator.serving.clients), runs blocks of rounds on fresh sessions, unary and
stream blocks taking turns (ABBA), so the host's drift favours neither. A round is a Verify of two
draft tokens (target) or a Propose of two tokens (draft); its cost beyond the forward is its wall time
minus the forward time the response reports. Prints each block's median and the medians over blocks.
Small models show it best: at step times of a few milliseconds the calls are a large share of a round.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import socket
import statistics
import subprocess
import sys
import time

from orchestrator.bench.report import machine_info
from orchestrator.serving.clients import DraftClient, TargetClient, open_channel
from specmesh.engine.sampling_params import SamplingParams

PROMPT = list(range(10, 40))
READY_TIMEOUT_S = 300.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a model directory the service loads")
    parser.add_argument("--role", choices=("target", "draft"), default="target")
    parser.add_argument("--trust-remote-code", action="store_true", help="for models that ship their code")
    parser.add_argument("--device", default="cpu", help="the service's --device")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--rounds", type=int, default=300, help="rounds a block")
    parser.add_argument("--blocks", type=int, default=8, help="blocks of each kind of call")
    return parser.parse_args(argv)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


async def one_round(client, request_id: str, number: int, position: int) -> tuple[float, int]:
    """(seconds beyond the forward, the next round's position)."""
    started = time.perf_counter()
    if isinstance(client, TargetClient):
        response = await client.verify(request_id, number, position, [7, 8], [], timeout=30)
        return time.perf_counter() - started - response.forward_ns / 1e9, response.committed_length
    response = await client.propose(request_id, number, None, position, 2, timeout=30)
    return time.perf_counter() - started - response.forward_ns / 1e9, position + len(response.token_ids)


async def block(client, request_id: str, rounds: int) -> float:
    """Median ms beyond the forward over `rounds` rounds of a fresh session."""
    opened = await client.open(request_id, PROMPT, SamplingParams(0.0), timeout=30)
    position = getattr(opened, "committed_length", 0) or len(PROMPT)
    beyond = []
    for number in range(1, rounds + 1):
        seconds, position = await one_round(client, request_id, number, position)
        beyond.append(seconds)
    await client.close(request_id)
    return statistics.median(beyond) * 1e3


async def wait_ready(client, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        try:
            await client.model_info(timeout=5)
            return
        except Exception:  # noqa: BLE001 - still loading
            if process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the service did not start")
            await asyncio.sleep(0.2)  # paces polling another process


async def measure(args: argparse.Namespace, port: int, process: subprocess.Popen) -> dict[str, list[float]]:
    channel = open_channel(f"127.0.0.1:{port}")
    make = TargetClient if args.role == "target" else DraftClient
    clients = {"unary": make(channel), "stream": make(channel, round_calls="stream")}
    await wait_ready(clients["unary"], process)
    for name, client in clients.items():  # warm-up
        await block(client, f"warm-{name}", 30)
    blocks: dict[str, list[float]] = {"unary": [], "stream": []}
    for index in range(args.blocks):
        for name in (("unary", "stream") if index % 2 == 0 else ("stream", "unary")):
            blocks[name].append(await block(clients[name], f"{name}-{index}", args.rounds))
    await channel.close()
    return blocks


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    args = parse_args(argv)
    info = machine_info()
    print(f"machine: {info['platform']}, {info['cpu']}, {info['cpu_count']} cores, torch {info['torch']}")
    print(f"command: python -m benchmarks.round_calls {shlex.join(argv if argv is not None else sys.argv[1:])}")
    port = free_port()
    flags = ["--model", args.model, "--port", str(port), "--device", args.device, "--dtype", args.dtype]
    process = subprocess.Popen([sys.executable, "-m", f"{args.role}_service", *flags,
                                *(["--trust-remote-code"] if args.trust_remote_code else [])],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        blocks = asyncio.run(measure(args, port, process))
    finally:
        process.terminate()
        process.wait()
    call = "Verify" if args.role == "target" else "Propose"
    for name, values in blocks.items():
        print(f"{name:>6}: a {call}'s ms beyond its forward, block medians {' '.join(f'{v:.2f}' for v in values)}; "
              f"median {statistics.median(values):.2f}")
    cheaper = sum(stream < unary for unary, stream in zip(blocks["unary"], blocks["stream"]))
    print(f"stream cheaper in {cheaper} of {len(blocks['stream'])} paired blocks")
    return blocks


if __name__ == "__main__":
    main()
