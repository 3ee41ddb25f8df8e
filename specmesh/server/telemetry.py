"""OpenTelemetry tracing for the three services.

One trace per request: the orchestrator's server span for Generate is the root.
Under it, a `specmesh.prefill` span and one `specmesh.round` span per round
carry what the responses said (tokens proposed and accepted, recovered or bonus,
forward ns of each model, response bytes); under those, the gRPC
instrumentation's client spans for OpenSession/Propose/Verify carry what the
requests said (request id, round, position, tokens, request bytes), and the
draft's and target's server spans are children of those across processes (the
context travels in gRPC metadata). A slow request can be read round by round.

The exporter follows the standard environment: OTEL_TRACES_EXPORTER (otlp,
console or none; otlp by default when OTEL_EXPORTER_OTLP[_TRACES]_ENDPOINT is
set, else none), OTEL_EXPORTER_OTLP[_TRACES]_PROTOCOL (grpc or http/protobuf),
OTEL_TRACES_SAMPLER[_ARG]; a ratio given in code or on the command line wins.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import TYPE_CHECKING, Iterator

from google.protobuf.message import Message
from opentelemetry import propagate, trace

if TYPE_CHECKING:  # the SDK and the gRPC instrumentation load where tracing is on only: start time
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

log = logging.getLogger(__name__)
# A session's rounds on one stream get spans per message instead of one per stream (client_message_span).
VERIFY_ROUNDS = "/specmesh.v1.TargetService/VerifyRounds"
PROPOSE_ROUNDS = "/specmesh.v1.DraftService/ProposeRounds"
# Many sessions' rounds on one stream: a span per part (specmesh.server.batches), none per stream.
VERIFY_BATCHES = "/specmesh.v1.TargetService/VerifyBatches"
PROPOSE_BATCHES = "/specmesh.v1.DraftService/ProposeBatches"
# request field -> client span attribute, for whichever request has the field
_FIELDS = {"request_id": "specmesh.request_id", "round": "specmesh.round", "position": "specmesh.position",
           "num_tokens": "specmesh.num_tokens"}
_COUNTED = {"prompt_token_ids": "specmesh.prompt_tokens", "draft_token_ids": "specmesh.draft_tokens",
            "draft_distributions": "specmesh.draft_distributions"}


def untraced():
    """The gRPC instrumentation's filter: health, reflection and round streams get no span per call."""
    from opentelemetry.instrumentation.grpc import filters  # only where tracing is on: start time
    return filters.negate(filters.any_of(filters.service_name("grpc.health.v1.Health"),
                                         filters.service_prefix("grpc.reflection"),
                                         *(filters.method_name(method.rsplit("/", 1)[1])
                                           for method in (VERIFY_ROUNDS, PROPOSE_ROUNDS, VERIFY_BATCHES,
                                                          PROPOSE_BATCHES))))


def _span_exporter(name: str) -> SpanExporter | None:
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter  # only where tracing is on: start time
        return ConsoleSpanExporter()
    if name != "otlp":
        return None
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
                              os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"))
    if protocol.startswith("http"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    return OTLPSpanExporter()


def default_exporter_name() -> str:
    if "OTEL_TRACES_EXPORTER" in os.environ:
        return os.environ["OTEL_TRACES_EXPORTER"].split(",")[0].strip().lower()
    has_endpoint = any(os.environ.get(v) for v in ("OTEL_EXPORTER_OTLP_ENDPOINT",
                                                   "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
    return "otlp" if has_endpoint else "none"


def make_tracer_provider(service_name: str, exporter: str | SpanExporter | None = None,
                         sample_ratio: float | None = None) -> TracerProvider | None:
    """A provider exporting this process's spans, or None when tracing is off."""
    if exporter is None or isinstance(exporter, str):  # a name: the SDK loads only if it names an exporter
        span_exporter = _span_exporter(exporter or default_exporter_name())
    else:
        from opentelemetry.sdk.trace.export import SpanExporter
        span_exporter = exporter if isinstance(exporter, SpanExporter) else _span_exporter(
            exporter or default_exporter_name())
    if span_exporter is None:
        return None
    # Only where tracing is on: the SDK costs a replica's start a few hundred ms.
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
    sampler = ParentBased(TraceIdRatioBased(sample_ratio)) if sample_ratio is not None else None
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}), sampler=sampler)
    provider.add_span_processor(BatchSpanProcessor(span_exporter))
    log.info("tracing %s with %s", service_name, type(span_exporter).__name__)
    return provider


def tracer(provider: TracerProvider | None) -> trace.Tracer:
    return trace.get_tracer("specmesh", tracer_provider=provider or trace.NoOpTracerProvider())


def server_interceptors(provider: TracerProvider | None) -> list:
    if not provider:
        return []
    from opentelemetry.instrumentation.grpc import aio_server_interceptor  # only where tracing is on: start time
    return [aio_server_interceptor(tracer_provider=provider, filter_=untraced())]


def client_interceptors(provider: TracerProvider | None) -> list:
    if provider is None:
        return []
    from opentelemetry.instrumentation.grpc import aio_client_interceptors  # only where tracing is on: start time
    # No response hook: for unary calls the instrumentation hands it the status details,
    # not the response; the orchestrator's round spans carry what the responses say.
    return aio_client_interceptors(tracer_provider=provider, filter_=untraced(), request_hook=_describe_request)


def _describe_request(span: trace.Span, message: Message) -> None:
    """Span attributes from whichever of the known fields the request has."""
    if not span.is_recording() or not isinstance(message, Message):
        return
    present = {field.name for field in message.DESCRIPTOR.fields}
    for field, attribute in _FIELDS.items():
        if field in present:
            span.set_attribute(attribute, getattr(message, field))
    for field, attribute in _COUNTED.items():
        if field in present:
            span.set_attribute(attribute, len(getattr(message, field)))
    span.set_attribute("rpc.request.bytes", message.ByteSize())


def client_message_span(provider: TracerProvider | None, method: str,
                        request: Message) -> contextlib.AbstractContextManager[trace.Span]:
    """The client span of one message of a round stream, as the instrumentation gives a unary call; its
    context goes into the request's trace_context, for the server's span (server_message_span)."""
    if provider is None:  # tracing off: no span would record, so none is made (every round pays for one)
        return contextlib.nullcontext(trace.INVALID_SPAN)
    return _client_message_span(provider, method, request)


@contextlib.contextmanager
def _client_message_span(provider: TracerProvider, method: str, request: Message) -> Iterator[trace.Span]:
    span = start_client_part_span(provider, method, request)
    with trace.use_span(span, end_on_exit=True):
        yield span


def start_client_part_span(provider: TracerProvider | None, method: str, request: Message) -> trace.Span | None:
    """The client span of a part answered over time (a batch's pre-draft), started and not made current (the
    caller ends it when the part's answers end); its context goes into the request's trace_context."""
    if provider is None:
        return None
    span = tracer(provider).start_span(method, kind=trace.SpanKind.CLIENT)
    _describe_request(span, request)
    if span.is_recording():
        propagate.inject(request.trace_context, context=trace.set_span_in_context(span))
    return span


def server_message_span(provider: TracerProvider | None, method: str, request: Message):
    """The server span of one message of a round stream: a child of the context the message carries."""
    if provider is None:  # tracing off: the carried context is not even parsed
        return contextlib.nullcontext(trace.INVALID_SPAN)
    context = propagate.extract(dict(request.trace_context))
    return tracer(provider).start_as_current_span(method, context=context, kind=trace.SpanKind.SERVER)


def annotate_current_span(**attributes) -> None:
    """Add `specmesh.*` attributes to the current span (a service's server span) when it records."""
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attributes({f"specmesh.{name}": value for name, value in attributes.items()})
