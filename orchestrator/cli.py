"""The `specmesh` command: serve the three services, or generate against a running server."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

import grpc

from orchestrator import stats_view
from orchestrator.launcher import START_TIMEOUT_S, ProcessGroup, install_stop_flag
from orchestrator.launcher import DisagreementLogOptions, run_draft, run_orchestrator, run_target
from orchestrator.loop import LoopConfig
from orchestrator.server import OrchestratorOptions
from orchestrator.servicer import FINISH_REASON_NAMES
from orchestrator.pipelined import PIPELINE_MODES
from specmesh.service import DTYPE_CHOICES, ServiceOptions, add_telemetry_arguments, parse_cpu_list
from specmesh.v1 import admin_pb2, admin_pb2_grpc, generation_pb2, generation_pb2_grpc

DEFAULT_TARGET = "qwen2.5-coder-1.5b"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specmesh", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="start the draft, target and orchestrator services")
    serve.add_argument("--target", default=DEFAULT_TARGET, help="target model: alias, directory, .gguf or hub id")
    serve.add_argument("--draft", default=DEFAULT_DRAFT, help="draft model, or 'none' for target-only")
    serve.add_argument("--host", default="127.0.0.1", help="address every service binds")
    serve.add_argument("--port", type=int, default=50051, help="client-facing gRPC port")
    serve.add_argument("--http-port", type=int, default=8000,
                       help="OpenAI-compatible HTTP API port (0 = any free port, -1 = off)")
    serve.add_argument("--num-speculative-tokens", type=int, default=LoopConfig.num_speculative_tokens)
    serve.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (both models)")
    serve.add_argument("--draft-device", default=None, help="device of the draft (default: --device)")
    serve.add_argument("--target-dtype", default="float32", choices=DTYPE_CHOICES)
    serve.add_argument("--draft-dtype", default="auto", choices=DTYPE_CHOICES,
                       help="auto: bfloat16 where the device computes it natively, else float32; "
                            "the draft's precision never changes the output, only acceptance and speed")
    serve.add_argument("--draft-timeout", type=float, default=LoopConfig.draft_timeout_s,
                       help="seconds a draft round may take before the request goes target-only")
    serve.add_argument("--greedy-draft", action="store_true",
                       help="the draft proposes its argmax tokens (point masses) even when sampling")
    add_pipeline_arguments(serve)
    serve.add_argument("--target-cpus", type=parse_cpu_list, default=None, metavar="LIST",
                       help="pin the target service to these CPU cores, e.g. 0 or 0-3")
    serve.add_argument("--draft-cpus", type=parse_cpu_list, default=None, metavar="LIST",
                       help="pin the draft service to these CPU cores, e.g. 4-5")
    add_telemetry_arguments(serve, default_metrics_port=9400)
    serve.add_argument("--disagreement-log", default=None, metavar="PATH",
                       help="append the target's rejected draft tokens to this JSONL file")
    serve.add_argument("--disagreement-log-rate", type=float, default=100.0,
                       help="at most this many disagreement records per second")
    generate = commands.add_parser("generate", help="stream a completion from a running server")
    generate.add_argument("prompt")
    generate.add_argument("--endpoint", default="127.0.0.1:50051")
    generate.add_argument("--max-tokens", type=int, default=128)
    generate.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default here)")
    generate.add_argument("--top-k", type=int, default=None)
    generate.add_argument("--top-p", type=float, default=None)
    generate.add_argument("--seed", type=int, default=None)
    generate.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    generate.add_argument("--num-speculative-tokens", type=int, default=None)
    generate.add_argument("--no-speculation", action="store_true", help="target-only decoding")
    generate.add_argument("--timeout", type=float, default=600.0, help="deadline in seconds")
    generate.add_argument("--json", action="store_true", help="print one JSON object at the end")
    stats_view.add_parser(commands)
    speculation = commands.add_parser("speculation", help="turn speculative decoding on or off server-wide")
    speculation.add_argument("state", choices=["on", "off", "status"])
    speculation.add_argument("--endpoint", default="127.0.0.1:50051")
    return parser


def add_pipeline_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pipeline", choices=PIPELINE_MODES, default=LoopConfig.pipeline,
                        help="draft the next round while the target verifies; auto: when draft and target "
                             "compute on separate hardware (hosts, devices or disjoint --*-cpus)")
    parser.add_argument("--extra-branches", type=int, default=None, metavar="N",
                        help="pipelined: also pre-draft N likely rejection outcomes (default: as many as "
                             "the measured draft and target costs leave time for)")


def loop_config(args: argparse.Namespace) -> LoopConfig:
    return LoopConfig(num_speculative_tokens=args.num_speculative_tokens, draft_timeout_s=args.draft_timeout,
                      pipeline=args.pipeline, extra_branches=args.extra_branches)


def serve(args: argparse.Namespace) -> int:
    group = ProcessGroup()
    stop_flag = install_stop_flag()
    telemetry = dict(host=args.host, trace_exporter=args.trace_exporter, trace_sample_ratio=args.trace_sample_ratio)
    metrics_ports = _metrics_ports(args.metrics_port)
    disagreement_log = DisagreementLogOptions(args.disagreement_log, args.disagreement_log_rate) \
        if args.disagreement_log else None
    group.start("target", run_target, ServiceOptions(model=args.target, device=args.device, dtype=args.target_dtype,
                                                     metrics_port=metrics_ports["target"], cpus=args.target_cpus,
                                                     **telemetry),
                disagreement_log)
    names = {"target"}
    if args.draft.lower() != "none":
        draft_options = ServiceOptions(model=args.draft, device=args.draft_device or args.device,
                                       dtype=args.draft_dtype, metrics_port=metrics_ports["draft"],
                                       cpus=args.draft_cpus, **telemetry)
        group.start("draft", run_draft, draft_options, args.greedy_draft)
        names.add("draft")
    try:
        ready = group.wait_ready(names, START_TIMEOUT_S)
        options = OrchestratorOptions(
            target_endpoint=f"{args.host}:{ready['target'].port}",
            draft_endpoint=f"{args.host}:{ready['draft'].port}" if "draft" in ready else None,
            loop=loop_config(args))
        group.start("orchestrator", run_orchestrator, args.target, options, f"{args.host}:{args.port}",
                    ServiceOptions(model=args.target, metrics_port=metrics_ports["orchestrator"],
                                   http_port=args.http_port, **telemetry))
        ready.update(group.wait_ready({"orchestrator"}, START_TIMEOUT_S))
    except RuntimeError as error:
        print(f"specmesh serve: {error}", file=sys.stderr)
        group.stop()
        return 1
    orchestrator = ready["orchestrator"]
    http = f", OpenAI API http://{args.host}:{orchestrator.http_port}/v1" if orchestrator.http_port else ""
    print(f"specmesh ready: client endpoint {args.host}:{orchestrator.port}{http}", flush=True)
    metrics = [f"{name} http://{args.host}:{r.metrics_port}/metrics" for name, r in sorted(ready.items())
               if r.metrics_port is not None]
    if metrics:
        print("metrics: " + ", ".join(metrics), flush=True)
    group.wait_any_exit(lambda: stop_flag[0])
    group.stop()
    return 0


def _metrics_ports(base: int | None) -> dict[str, int | None]:
    """The orchestrator on `base`, the target and the draft on the next two (0: any free ports)."""
    if base is None or base < 0:
        return dict.fromkeys(("orchestrator", "target", "draft"))
    offsets = {"orchestrator": 0, "target": 1, "draft": 2}
    return {name: base + offset if base else 0 for name, offset in offsets.items()}


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
    async with grpc.aio.insecure_channel(args.endpoint) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        try:
            async for response in stub.Generate(generate_request(args), timeout=args.timeout):
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
    async with grpc.aio.insecure_channel(args.endpoint) as channel:
        stub = admin_pb2_grpc.AdminStub(channel)
        try:
            if args.state == "status":
                state = await stub.GetSpeculation(admin_pb2.GetSpeculationRequest(), timeout=10)
            else:
                state = await stub.SetSpeculation(admin_pb2.SetSpeculationRequest(enabled=args.state == "on"),
                                                  timeout=10)
        except grpc.aio.AioRpcError as error:
            print(f"specmesh speculation: {error.code().name}: {error.details()}", file=sys.stderr)
            return 2
    print(f"speculation {'on' if state.enabled else 'off'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return serve(args)
    if args.command == "stats":
        return args.handler(args)
    if args.command == "speculation":
        return asyncio.run(set_speculation(args))
    return asyncio.run(generate(args))


if __name__ == "__main__":
    sys.exit(main())
