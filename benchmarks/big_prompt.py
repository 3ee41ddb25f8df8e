"""A maximum-size request must not stall anyone else: a 20 MB prompt against a streaming request.

Serves a stack (three processes, `specmesh serve`'s launcher), streams one greedy request, and
while it streams sends a 20 MB prompt over gRPC and over HTTP. Prints, per run, how long each
big request took to get its error (and which error), and the stream's largest gap between two
responses while the big requests were in flight, next to its median gap (one decode step: a
speculation round), its largest gap over the whole stream, and the largest gap of the same stream
run alone (what this machine's noise does without any big request). It passes when: each error comes
within a second, and the largest gap stays below one decode step + 100 ms.

By default the stack is tiny random-weight models built on the fly (benchmarks/tiny_models.py, with a
4096-token context so the stream lasts long enough to overlap the big requests); --target and
--draft take real ones. --max-request-bytes raises the cap, e.g. above 20 MB to watch a 20 MB
prompt being read and tokenized (off the event loop) instead of refused:

    python -m benchmarks.big_prompt
    python -m benchmarks.big_prompt --runs 5 --max-tokens 1500
    python -m benchmarks.big_prompt --max-request-bytes 67108864 --prompt-mb 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import grpc
import httpx

from orchestrator.decoding.request import LoopConfig
from orchestrator.control.launch import ProcessGroup, StackOptions, start_stack
from orchestrator.serving.options import FrontendOptions
from specmesh.server.service import ServiceOptions
from specmesh.v1 import generation_pb2, generation_pb2_grpc

PROMPT = "The quick brown fox"


def tiny_pair(root: Path) -> tuple[str, str]:
    from benchmarks.tiny_models import TINY_CORPUS, build_tiny_model, build_tokenizer, perturb_model
    tokenizer = build_tokenizer(root / "tokenizer", corpus=TINY_CORPUS)
    target = build_tiny_model(root / "target", "llama", tokenizer, seed=1, max_positions=4096)
    return str(target), str(perturb_model(target, root / "draft", seed=101))


async def stream(stub, max_tokens: int, started: asyncio.Event) -> list[float]:
    """Arrival times of the stream's responses (each carries one round's tokens)."""
    arrivals = []
    request = generation_pb2.GenerateRequest(prompt=PROMPT, max_tokens=max_tokens, temperature=0.0)
    async for response in stub.Generate(request, timeout=600):
        arrivals.append(time.perf_counter())
        if len(arrivals) == 5:
            started.set()
    return arrivals


async def big_grpc(channel: grpc.aio.Channel, data: bytes) -> tuple[float, str]:
    call = channel.unary_stream("/specmesh.v1.Generation/Generate", request_serializer=lambda raw: raw,
                                response_deserializer=generation_pb2.GenerateResponse.FromString)
    sent = time.perf_counter()
    try:
        async for _ in call(data, timeout=600):
            pass
        outcome = "OK (!)"
    except grpc.aio.AioRpcError as error:
        outcome = f"{error.code().name}: {error.details()}"
    return time.perf_counter() - sent, outcome


async def big_http(http: httpx.AsyncClient, body: bytes) -> tuple[float, str]:
    sent = time.perf_counter()
    response = await http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    return time.perf_counter() - sent, f"{response.status_code} {response.text[:160]}"


def gaps_ms(arrivals: list[float], window: tuple[float, float] | None = None) -> list[float]:
    """Gaps between consecutive responses; with `window`, only those overlapping it."""
    return [(b - a) * 1e3 for a, b in zip(arrivals, arrivals[1:])
            if window is None or (b >= window[0] and a <= window[1])]


async def one_run(endpoint: str, http_port: int, args, prompt_grpc: bytes, prompt_http: bytes) -> None:
    options = [("grpc.max_send_message_length", -1)]
    async with grpc.aio.insecure_channel(endpoint, options=options) as channel, \
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{http_port}", timeout=600) as http:
        stub = generation_pb2_grpc.GenerationStub(channel)
        quiet = gaps_ms(await stream(stub, args.max_tokens, asyncio.Event()))
        started = asyncio.Event()
        streaming = asyncio.ensure_future(stream(stub, args.max_tokens, started))
        await started.wait()
        window_start = time.perf_counter()
        (grpc_s, grpc_outcome), (http_s, http_outcome) = await asyncio.gather(
            big_grpc(channel, prompt_grpc), big_http(http, prompt_http))
        window = (window_start, time.perf_counter())
        if streaming.done():
            print("  (the stream finished before the big requests were answered: raise --max-tokens)")
        arrivals = await streaming
    gaps, during = gaps_ms(arrivals), gaps_ms(arrivals, window)
    step = statistics.median(gaps)
    print(f"  gRPC {args.prompt_mb} MB prompt: {grpc_s * 1e3:.0f} ms -> {grpc_outcome}")
    print(f"  HTTP {args.prompt_mb} MB prompt: {http_s * 1e3:.0f} ms -> {http_outcome}")
    print(f"  stream: median gap (decode step) {step:.1f} ms; largest gap while the big requests were in flight "
          f"{max(during, default=0):.1f} ms (budget {step + 100:.1f} ms), over the whole stream {max(gaps):.1f} ms; "
          f"alone: largest {max(quiet):.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=None, help="target model (default: a tiny one built here)")
    parser.add_argument("--draft", default=None)
    parser.add_argument("--prompt-mb", type=float, default=20.0)
    parser.add_argument("--max-tokens", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-request-bytes", type=int, default=None, help="the server's cap (default: its own)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        target, draft = (args.target, args.draft) if args.target else tiny_pair(Path(root))
        group = ProcessGroup()
        try:
            ready = start_stack(group, StackOptions(
                target=ServiceOptions(model=target), draft=ServiceOptions(model=draft) if draft else None,
                loop=LoopConfig(num_speculative_tokens=3), address="127.0.0.1:0",
                orchestrator=FrontendOptions(http_port=0, max_request_bytes=args.max_request_bytes)))
            orchestrator = ready["orchestrator"]
            text = "x" * int(args.prompt_mb * 1024 * 1024)
            prompt_grpc = generation_pb2.GenerateRequest(prompt=text, max_tokens=4).SerializeToString()
            prompt_http = json.dumps({"prompt": text, "max_tokens": 4}).encode()
            for run in range(args.runs):
                print(f"run {run + 1}:")
                asyncio.run(one_run(f"127.0.0.1:{orchestrator.port}", orchestrator.http_port, args,
                                    prompt_grpc, prompt_http))
        finally:
            group.stop()


if __name__ == "__main__":
    main()
