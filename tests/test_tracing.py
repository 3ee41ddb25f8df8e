"""One generation through `specmesh serve` makes one trace across the three processes.

The three processes export over OTLP/gRPC to a collector this test runs on
127.0.0.1; the same run's Prometheus endpoints are scraped for the documented
series.
"""

from __future__ import annotations

import asyncio
import urllib.request

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2

from specmesh.v1 import generation_pb2, generation_pb2_grpc
from test_cli import start_serve

SERVER, CLIENT = trace_pb2.Span.SPAN_KIND_SERVER, trace_pb2.Span.SPAN_KIND_CLIENT


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP trace receiver keeping (service name, span) pairs."""

    def __init__(self):
        self.spans: list[tuple[str, trace_pb2.Span]] = []
        self.received = asyncio.Condition()  # notified after every export

    async def Export(self, request, context):
        for resource_spans in request.resource_spans:
            service = next(a.value.string_value for a in resource_spans.resource.attributes
                           if a.key == "service.name")
            for scope_spans in resource_spans.scope_spans:
                self.spans.extend((service, span) for span in scope_spans.spans)
        async with self.received:
            self.received.notify_all()
        return trace_service_pb2.ExportTraceServiceResponse()


def attributes(span: trace_pb2.Span) -> dict:
    values = {}
    for attribute in span.attributes:
        value = attribute.value
        values[attribute.key] = getattr(value, value.WhichOneof("value"))
    return values


async def generate(endpoint: str) -> generation_pb2.GenerateResponse:
    async with grpc.aio.insecure_channel(endpoint) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        request = generation_pb2.GenerateRequest(prompt="def add(a, b):", max_tokens=16, temperature=0.0,
                                                 prompt_class="code")
        async for response in stub.Generate(request, timeout=60):
            last = response
    return last


def trace_complete(collector: Collector, stats: generation_pb2.GenerationStats) -> bool:
    """The request's root span, its every round and Verify on both ends, and every remote span's parent."""
    roots = [s for _, s in collector.spans if s.name.endswith("Generation/Generate")]
    if not roots:
        return False
    trace = [(service, s) for service, s in collector.spans if s.trace_id == roots[0].trace_id]
    local = {s.span_id for service, s in trace if service == "specmesh-orchestrator"}
    remote = [(service, s) for service, s in trace if service != "specmesh-orchestrator"]

    def count(service: str, name_end: str) -> int:
        return sum(1 for svc, s in trace if svc == service and s.name.endswith(name_end))
    return ({service for service, _ in remote} == {"specmesh-draft", "specmesh-target"}
            and all(s.parent_span_id in local for _, s in remote)
            and count("specmesh-orchestrator", "specmesh.round") == stats.rounds
            and count("specmesh-orchestrator", "TargetService/Verify") == stats.rounds
            and count("specmesh-target", "TargetService/Verify") == stats.rounds)


async def wait_for_trace(collector: Collector, stats: generation_pb2.GenerationStats, timeout_s: float = 30.0) -> None:
    try:
        async with collector.received:
            await asyncio.wait_for(collector.received.wait_for(lambda: trace_complete(collector, stats)), timeout_s)
    except TimeoutError:
        raise AssertionError(f"no complete trace; got {sorted({svc for svc, _ in collector.spans})}") from None


def scrape(url: str) -> str:
    return urllib.request.urlopen(url, timeout=10).read().decode()


async def test_one_trace_across_three_processes_and_metrics(tiny_llama_dir, tiny_llama_perturbed_dir,
                                                            monkeypatch):
    collector = Collector()
    server = grpc.aio.server()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    process, endpoint, metrics = None, None, {}
    try:
        process, endpoint, lines = await asyncio.to_thread(
            start_serve, "--target", str(tiny_llama_dir), "--draft", str(tiny_llama_perturbed_dir),
            "--num-speculative-tokens", "3", "--metrics-port", "0", expect_metrics=True)
        metrics = dict(part.strip().split(" ") for part in lines[-1].removeprefix("metrics: ").split(","))
        last = await generate(endpoint)
        await wait_for_trace(collector, last.stats)
        orchestrator_metrics = await asyncio.to_thread(scrape, metrics["orchestrator"])
        target_metrics = await asyncio.to_thread(scrape, metrics["target"])
    finally:
        if process is not None:
            process.terminate()
            await asyncio.to_thread(process.wait, 60)
        await server.stop(None)
    check_trace(collector, last.stats)
    check_metrics(orchestrator_metrics, target_metrics, last.stats)


def check_trace(collector: Collector, stats: generation_pb2.GenerationStats) -> None:
    root = next(s for _, s in collector.spans if s.name.endswith("Generation/Generate"))
    trace = [(service, s) for service, s in collector.spans if s.trace_id == root.trace_id]
    assert not root.parent_span_id and root.kind == SERVER
    assert attributes(root)["gen_ai.usage.output_tokens"] == stats.completion_tokens
    assert attributes(root)["gen_ai.request.max_tokens"] == 16 and "gen_ai.request.model" in attributes(root)
    local = {s.span_id: s for service, s in trace if service == "specmesh-orchestrator"}
    phases = {s.span_id: s for s in local.values() if s.name in ("specmesh.prefill", "specmesh.round")}
    assert all(s.parent_span_id == root.span_id for s in phases.values())
    clients = {i: s for i, s in local.items() if s.kind == CLIENT and s.name.startswith("/specmesh")}
    assert all(s.parent_span_id in phases or s.parent_span_id == root.span_id for s in clients.values())
    remote = [(service, s) for service, s in trace if service != "specmesh-orchestrator"]
    assert {service for service, _ in remote} == {"specmesh-draft", "specmesh-target"}
    assert all(s.kind == SERVER and s.parent_span_id in clients for _, s in remote)
    rounds = [attributes(s) for s in phases.values() if s.name == "specmesh.round"]
    assert sorted(r["specmesh.round"] for r in rounds) == list(range(1, stats.rounds + 1))
    assert sum(r["specmesh.accepted"] for r in rounds) == stats.accepted_tokens
    assert sum(r["specmesh.proposed"] for r in rounds) == stats.draft_tokens
    assert all(r["specmesh.target_forward_ns"] > 0 and r["specmesh.next_token"] in ("recovered", "bonus")
               for r in rounds)
    parts = ("draft_busy", "target_busy", "wire", "idle")  # where each round's time went (orchestrator.decoding.timing)
    assert all(r["specmesh.time.target_busy_ms"] > 0 and min(r[f"specmesh.time.{p}_ms"] for p in parts) >= 0
               and sum(r[f"specmesh.time.{p}_ms"] for p in parts) <= r["specmesh.time.wall_ms"] * 1.01 + 0.01
               for r in rounds)
    verifies = [attributes(s) for s in clients.values() if s.name.endswith("TargetService/Verify")]
    assert sorted(v["specmesh.round"] for v in verifies) == list(range(1, stats.rounds + 1))
    assert all(v["rpc.request.bytes"] > 0 and "specmesh.position" in v for v in verifies)
    served_verifies = [attributes(s) for service, s in remote if s.name.endswith("TargetService/Verify")]
    assert sum(v["specmesh.accepted"] for v in served_verifies) == stats.accepted_tokens
    assert all(v["specmesh.forward_ns"] > 0 for v in served_verifies)
    assert not any("Health" in s.name for _, s in collector.spans)


def check_metrics(orchestrator: str, target: str, stats: generation_pb2.GenerationStats) -> None:
    def value(text: str, prefix: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))
    assert value(orchestrator, "specmesh_spec_decode_num_draft_tokens_total{") == stats.draft_tokens
    assert value(orchestrator, 'specmesh_requests_total{finish_reason="length"') + \
        value(orchestrator, 'specmesh_requests_total{finish_reason="stop"') == 1
    assert value(orchestrator, 'specmesh_round_time_seconds_count{') == 5 * stats.rounds  # five parts a round
    assert 'prompt_class="code"' in orchestrator and "process_resident_memory_bytes" in orchestrator
    assert value(target, 'specmesh_forward_seconds_count{model') >= stats.rounds + 1
    assert "specmesh_sessions_open" in target
