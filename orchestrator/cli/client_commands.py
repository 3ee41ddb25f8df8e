"""The `specmesh` commands that call a running server: generate, speculation, scale, replicas, rollout.

They import neither torch nor transformers, so a client command starts in well under a second.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

import grpc

from orchestrator.serving.clients import add_client_arguments, client_channel
from orchestrator.serving.finish_reasons import FINISH_REASON_NAMES
from specmesh.v1 import admin_pb2, admin_pb2_grpc, generation_pb2, generation_pb2_grpc


def add_parsers(commands) -> None:
    generate_parser = commands.add_parser("generate", help="stream a completion from a running server")
    generate_parser.add_argument("prompt")
    generate_parser.add_argument("--max-tokens", type=int, default=128)
    generate_parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default here)")
    generate_parser.add_argument("--top-k", type=int, default=None)
    generate_parser.add_argument("--top-p", type=float, default=None)
    generate_parser.add_argument("--seed", type=int, default=None)
    generate_parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    generate_parser.add_argument("--num-speculative-tokens", type=int, default=None)
    generate_parser.add_argument("--no-speculation", action="store_true", help="target-only decoding")
    generate_parser.add_argument("--timeout", type=float, default=600.0, help="deadline in seconds")
    generate_parser.add_argument("--json", action="store_true", help="print one JSON object at the end")
    add_client_arguments(generate_parser)
    generate_parser.set_defaults(handler=lambda args: asyncio.run(generate(args)))
    speculation = commands.add_parser("speculation", help="turn speculative decoding on or off server-wide")
    speculation.add_argument("state", choices=["on", "off", "status"])
    add_client_arguments(speculation)
    speculation.set_defaults(handler=lambda args: asyncio.run(set_speculation(args)))
    add_pool_parsers(commands)


def generate_request(args: argparse.Namespace) -> generation_pb2.GenerateRequest:
    request = generation_pb2.GenerateRequest(prompt=args.prompt, max_tokens=args.max_tokens,
                                             temperature=args.temperature, stop=args.stop)
    for field in ("top_k", "top_p", "seed", "num_speculative_tokens"):
        if getattr(args, field) is not None:
            setattr(request, field, getattr(args, field))
    if args.no_speculation:
        request.speculation = False
    return request


async def generate(args: argparse.Namespace) -> int:
    text, token_ids, last = [], [], None
    channel, metadata = client_channel(args)
    async with channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        try:
            async for response in stub.Generate(generate_request(args), timeout=args.timeout, metadata=metadata):
                text.append(response.text)
                token_ids.extend(response.token_ids)
                last = response
                if not args.json:
                    print(response.text, end="", flush=True)
        except grpc.aio.AioRpcError as error:
            print(f"\nspecmesh generate: {error.code().name}: {error.details()}", file=sys.stderr)
            return 2
    if args.json:
        stats = {f.name: getattr(last.stats, f.name) for f in last.stats.DESCRIPTOR.fields}
        print(json.dumps({"text": "".join(text), "token_ids": token_ids,
                          "finish_reason": FINISH_REASON_NAMES.get(last.finish_reason, ""), "stats": stats}))
    else:
        print()
    return 0


async def set_speculation(args: argparse.Namespace) -> int:
    channel, metadata = client_channel(args)
    async with channel:
        stub = admin_pb2_grpc.AdminStub(channel)
        try:
            if args.state == "status":
                state = await stub.GetSpeculation(admin_pb2.GetSpeculationRequest(), timeout=10, metadata=metadata)
            else:
                state = await stub.SetSpeculation(admin_pb2.SetSpeculationRequest(enabled=args.state == "on"),
                                                  timeout=10, metadata=metadata)
        except grpc.aio.AioRpcError as error:
            print(f"specmesh speculation: {error.code().name}: {error.details()}", file=sys.stderr)
            return 2
    print(f"speculation {'on' if state.enabled else 'off'}")
    return 0


ROLLOUT_TIMEOUT_S = 3600.0  # every replica of the pool loads the new model in turn
PROGRESS_INTERVAL_S = 1.0


def add_pool_parsers(commands) -> None:
    scale = commands.add_parser("scale", help="set the number of draft or target replicas (Ray pools)")
    scale.add_argument("pool", choices=["draft", "target"])
    scale.add_argument("replicas", type=int)
    add_client_arguments(scale)
    scale.set_defaults(handler=lambda args: asyncio.run(_admin(args, _scale)))
    replicas = commands.add_parser("replicas", help="list the replica pools and each replica's state")
    add_client_arguments(replicas)
    replicas.set_defaults(handler=lambda args: asyncio.run(_admin(args, _list)))
    rollout = commands.add_parser("rollout", help="replace the draft pool's model, one replica at a time, "
                                                  "without failing a request")
    rollout.add_argument("pool", choices=["draft"], help="the pool to roll (the target's model defines the output "
                                                         "and cannot be replaced)")
    rollout.add_argument("model", help="model directory, .gguf file, embedded alias or hub id, as where the "
                                       "replicas run sees it (e.g. a `specmesh distill` output)")
    rollout.add_argument("--timeout", type=float, default=ROLLOUT_TIMEOUT_S,
                         help="seconds to wait for the whole rollout (it goes on if this command stops)")
    add_client_arguments(rollout)
    rollout.set_defaults(handler=lambda args: asyncio.run(_admin(args, _rollout)))


async def _scale(stub: admin_pb2_grpc.AdminStub, args: argparse.Namespace, metadata) -> list[admin_pb2.PoolState]:
    if args.replicas < 0:
        raise SystemExit("specmesh scale: replicas must be >= 0")
    request = admin_pb2.ScalePoolRequest(pool=args.pool, replicas=args.replicas)
    return [await stub.ScalePool(request, timeout=10, metadata=metadata)]


async def _list(stub: admin_pb2_grpc.AdminStub, args: argparse.Namespace, metadata) -> list[admin_pb2.PoolState]:
    return list((await stub.ListReplicas(admin_pb2.ListReplicasRequest(), timeout=10, metadata=metadata)).pools)


async def _rollout(stub: admin_pb2_grpc.AdminStub, args: argparse.Namespace, metadata) -> list[admin_pb2.PoolState]:
    """ReplaceModel, printing the rollout's progress (from ListReplicas) while it runs."""
    request = admin_pb2.ReplaceModelRequest(pool=args.pool, model=args.model)
    call = asyncio.ensure_future(stub.ReplaceModel(request, timeout=args.timeout, metadata=metadata))
    shown = ""
    while not call.done():
        await asyncio.wait([call], timeout=PROGRESS_INTERVAL_S)
        if call.done():
            break
        try:
            listed = await stub.ListReplicas(admin_pb2.ListReplicasRequest(), timeout=10, metadata=metadata)
        except grpc.aio.AioRpcError:
            continue  # progress is a courtesy; the rollout's own answer decides
        progress = next((pool.rollout for pool in listed.pools if pool.pool == args.pool), "")
        if progress and progress != shown:
            print(progress, flush=True)
            shown = progress
    return [await call]


async def _admin(args: argparse.Namespace, call) -> int:
    channel, metadata = client_channel(args)
    async with channel:
        try:
            pools = await call(admin_pb2_grpc.AdminStub(channel), args, metadata)
        except grpc.aio.AioRpcError as error:
            print(f"specmesh {args.command}: {error.code().name}: {error.details()}", file=sys.stderr)
            return 2
    for pool in pools:
        bounds = f"autoscaling {pool.min_replicas}..{pool.max_replicas}" if pool.max_replicas else "autoscaling off"
        model = f", model {pool.model}" if pool.model else ""
        print(f"{pool.pool}: {pool.desired_replicas} replicas desired ({bounds}){model}")
        if pool.rollout:
            print(f"  {pool.rollout}")
        for replica in pool.replicas:
            print(f"  {replica.name:<22} {replica.state:<10} {replica.address or '-':<22} "
                  f"sessions {replica.open_sessions} (routed here {replica.routed_sessions}) "
                  f"load {replica.load:.1f} KV {replica.kv_cache_usage:.0%}" + ("" if replica.has_room else " full")
                  + (f" {replica.model}" if replica.model else "")
                  + (f" ({replica.precision}, {replica.cpu_linear} linear)" if replica.precision else "")
                  + (f" retry in {replica.retry_in_s:.0f} s" if replica.state == "backoff" else ""))
    return 0
