"""What the orchestrator's client-facing front end runs with: its servers, metrics and tracing.

The model services have their own type (specmesh.server.service.ServiceOptions); this one is the
orchestrator process's, however it is started (`specmesh serve`, `specmesh bench`'s stack,
`python -m orchestrator`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specmesh.server.connections import ConnectionLimits
from specmesh.server.drain import DEFAULT_SHUTDOWN_GRACE_S
from specmesh.server.security import TLSConfig


@dataclass(frozen=True)
class FrontendOptions:
    host: str = "127.0.0.1"  # the gRPC API, the HTTP API and /metrics bind it
    http_port: int | None = None  # OpenAI-compatible HTTP API (0 = any free port); None or < 0 = off
    metrics_port: int | None = None  # Prometheus /metrics (0 = any free port); None = off
    trace_exporter: str | None = None  # otlp, console or none; None = from OTEL_* environment variables
    trace_sample_ratio: float | None = None  # None = from OTEL_TRACES_SAMPLER[_ARG], else every trace
    tls: TLSConfig | None = None  # serve TLS (mutual TLS with a client CA); None = plaintext
    api_key: str | None = field(default=None, repr=False)  # clients must send it; None = open
    shutdown_grace_s: float = DEFAULT_SHUTDOWN_GRACE_S  # on SIGTERM: how long in-flight requests may run on
    max_request_bytes: int | None = None  # a client's largest message; None = sized to the context window
    connection_limits: ConnectionLimits = ConnectionLimits()  # each client-facing port's (specmesh.server.connections)
