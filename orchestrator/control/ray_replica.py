"""One draft or target replica as a Ray actor hosting its own grpc.aio server.

The actor is async, so the server runs on the actor's event loop; clients talk
gRPC to it directly (our own status codes, health and streaming), and Ray only
places, restarts and kills it. The server starts lazily on the first `address()`
call, so a restarted actor (Ray re-runs the constructor in a new process) comes
back on a new port and the pools find it by asking again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from transformers.utils import logging as hf_logging

from orchestrator.control.replicas import create_model_server
from specmesh.roles import role
from specmesh.server.service import ReplicaConfig, RunningService, load_engine, start_model_service

log = logging.getLogger(__name__)


def advertised_host(bind_host: str) -> str:
    """The host other nodes reach us on: the node's IP when bound to every interface."""
    if bind_host in ("0.0.0.0", "::", ""):
        import ray  # only inside a Ray actor: plain `specmesh serve` never imports Ray
        return ray.util.get_node_ip_address()
    return bind_host


class ReplicaActor:
    """Use through `ray.remote(ReplicaActor).options(...)`; see orchestrator.control.ray_controller."""

    def __init__(self, config: ReplicaConfig):
        role(config.role)  # an unknown role fails here, not at the first call
        self.config = config
        self._starting: asyncio.Future | None = None
        self._engine = None
        self._service: RunningService | None = None

    async def address(self) -> str:
        """host:port of this replica's gRPC server, starting it on the first call."""
        if self._starting is None:
            self._starting = asyncio.ensure_future(self._start())
        return await asyncio.shield(self._starting)

    async def _start(self) -> str:
        hf_logging.disable_progress_bar()  # the driver prints every actor's output
        # Bind only the address the pool dials: the node's IP when --host is a wildcard, never every interface.
        config = dataclasses.replace(self.config, service=dataclasses.replace(
            self.config.service, host=advertised_host(self.config.service.host)))
        self._engine = await asyncio.to_thread(load_engine, config.service, config.role)
        self._service = await start_model_service(config, self._engine, create_model_server)
        address = f"{config.service.host}:{self._service.port}"
        log.info("%s replica serving on %s", config.role, address)
        return address

    async def drain(self) -> None:
        """Report NOT_SERVING on every service: routers send no new sessions; running ones go on."""
        await self.address()
        await self._service.health.enter_graceful_shutdown()

    async def open_sessions(self) -> int:
        return len(self._engine.sessions) if self._engine is not None else 0
