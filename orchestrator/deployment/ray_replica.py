"""One draft or target replica as a Ray actor hosting its own grpc.aio server.

The actor is async, so the server runs on the actor's event loop; clients talk
gRPC to it directly (our own status codes, health and streaming), and Ray only
places, restarts and kills it. The server starts lazily on the first `address()`
call, so a restarted actor (Ray re-runs the constructor in a new process) comes
back on a new port and the pools find it by asking again.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from specmesh.service import ServiceOptions

log = logging.getLogger(__name__)
ROLES = ("draft", "target")
GENERATOR_SALT = {"target": 0, "draft": 1}  # as in orchestrator.deployment.launch


@dataclass(frozen=True)
class ReplicaConfig:
    role: str  # "draft" or "target"
    service: ServiceOptions  # model, device, dtype, host, session limits, tracing
    greedy_proposals: bool = False  # draft only
    disagreement_log: tuple[str, float] | None = None  # target only: (path, records per second)
    extra: dict = field(default_factory=dict)  # more create_server keyword arguments


def advertised_host(bind_host: str) -> str:
    """The host other nodes reach us on: the node's IP when bound to every interface."""
    if bind_host in ("0.0.0.0", "::", ""):
        import ray
        return ray.util.get_node_ip_address()
    return bind_host


class ReplicaActor:
    """Use through `ray.remote(ReplicaActor).options(...)`; see orchestrator.deployment.ray_controller."""

    def __init__(self, config: ReplicaConfig):
        if config.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, not {config.role!r}")
        self.config = config
        self._starting: asyncio.Future | None = None
        self._engine = None
        self._health = None

    async def address(self) -> str:
        """host:port of this replica's gRPC server, starting it on the first call."""
        if self._starting is None:
            self._starting = asyncio.ensure_future(self._start())
        return await asyncio.shield(self._starting)

    async def _start(self) -> str:
        from specmesh.service import load_engine, reap_idle_sessions
        from specmesh.telemetry import make_tracer_provider
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()  # the driver prints every actor's output
        config, options = self.config, self.config.service
        self._engine = await asyncio.to_thread(load_engine, options, GENERATOR_SALT[config.role])
        provider = make_tracer_provider(f"specmesh-{config.role}", options.trace_exporter,
                                        options.trace_sample_ratio)
        self._server, port, self._health = await _create_server(config, self._engine, provider)
        self._reaper = asyncio.ensure_future(reap_idle_sessions(self._engine, options.session_idle_timeout_s))
        address = f"{advertised_host(options.host)}:{port}"
        log.info("%s replica serving on %s", config.role, address)
        return address

    async def drain(self) -> None:
        """Report NOT_SERVING on every service: routers send no new sessions; running ones go on."""
        await self.address()
        await self._health.enter_graceful_shutdown()

    async def open_sessions(self) -> int:
        return len(self._engine.sessions) if self._engine is not None else 0

    async def pid(self) -> int:
        import os
        return os.getpid()


async def _create_server(config: ReplicaConfig, engine, provider):
    # Bind only the address the pool dials: the node's IP when --host is a wildcard, never every interface.
    bind = f"{advertised_host(config.service.host)}:0"
    token = config.service.internal_token
    if config.role == "draft":
        from draft_service.server import create_server
        return await create_server(engine, bind, greedy_proposals=config.greedy_proposals, tracer_provider=provider,
                                   tls=config.service.tls, internal_token=token, **config.extra)
    from target_service.disagreements import DisagreementLog
    from target_service.server import create_server
    disagreements = DisagreementLog(*config.disagreement_log) if config.disagreement_log else None
    return await create_server(engine, bind, tracer_provider=provider, disagreements=disagreements,
                               tls=config.service.tls, internal_token=token, **config.extra)
