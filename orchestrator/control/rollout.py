"""Replace the draft pool's model on a running deployment, one replica at a time, failing no request.

For each replica serving the old model: start one of the new model (withheld from
routing), wait until it serves, check that it shares the target's tokenizer, let it
take sessions, then drain and stop one old replica. The pool therefore never has
fewer serving replicas than before, also with a single replica; a session whose old
replica stops before it ends moves to another replica (its sequence is re-opened
there) or, with none free, goes on target-only — the loop treats any draft failure
that way, so either is lossless. The first new replica is the check of the model: a
model that does not start, or has another vocabulary, fails the rollout before any
old replica is touched. Once it passes, the controller's spec names the new model, so
replicas started later (scaling, replacements) serve it, and each replica keeps its
own model across restarts. Controllers: `supervisor.LocalPoolController`,
`ray_controller.PoolController` (start_replica, remove_replica, live, spec).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import Awaitable, Callable

from orchestrator.serving.backends import TokenizerMismatch, check_vocabularies
from orchestrator.serving.pool import Replica, ReplicaStartFailed
from specmesh.errors import InvalidArgument, RolloutStopped
from specmesh.v1 import common_pb2

log = logging.getLogger(__name__)
INFO_TIMEOUT_S = 10.0
POLL_S = 0.05


class Rollout:
    """One rollout of `controller`'s pool to `model`; `start()` runs it in the background."""

    def __init__(self, controller, model: str, target_info: Callable[[float], Awaitable[common_pb2.ModelInfo]],
                 start_timeout_s: float, on_model: Callable[[str], None] = lambda model: None):
        self.controller = controller
        self.model = model
        old = controller.spec.replica
        self.config = replace(old, service=replace(old.service, model=model))
        self.target_info = target_info  # the target's ModelInfo (timeout) -> its vocabulary fingerprint
        self.start_timeout_s = start_timeout_s
        self.on_model = on_model  # called once the new model passed its check
        self.replaced = 0
        self.total = 0
        self.task: asyncio.Task | None = None

    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()

    @property
    def progress(self) -> str:
        return f"rolling out {self.model!r}: {self.replaced} of {self.total} replicas replaced"

    def start(self) -> asyncio.Task:
        self.task = asyncio.ensure_future(self._run())
        self.task.add_done_callback(self._log_outcome)  # also when the caller has gone away
        return self.task

    def _log_outcome(self, task: asyncio.Task) -> None:
        if task.cancelled():
            log.warning("%s pool: rollout cancelled (%s)", self.controller.spec.role, self.progress)
        elif task.exception() is not None:
            log.error("%s pool: rollout of %r failed: %s", self.controller.spec.role, self.model, task.exception())
        else:
            log.info("%s pool: every replica serves %r", self.controller.spec.role, self.model)

    async def _run(self) -> None:
        controller = self.controller
        old = sorted(controller.live())
        self.total = len(old)
        controller.rolling = True
        try:
            first = await self._start_checked()
            controller.spec = replace(controller.spec, replica=self.config)
            self.on_model(self.model)
            log.info("%s pool: %r passed its check; %s", controller.spec.role, self.model, self.progress)
            if not old:  # nothing to replace: the check was all
                await controller.remove_replica(first)
            for index, name in enumerate(old):
                if index > 0:
                    await self._start_next()
                await controller.remove_replica(name)
                self.replaced += 1
                log.info("%s pool: %s", controller.spec.role, self.progress)
        finally:
            controller.rolling = False

    async def _start_checked(self) -> str:
        """The first new replica: it must start, serve and share the target's vocabulary."""
        try:
            name, replica = await self._start_withheld()
        except ReplicaStartFailed as error:
            raise InvalidArgument("model", f"no {self.controller.spec.role} replica could start with "
                                           f"{self.model!r}: {error}") from None
        try:
            target = await self.target_info(INFO_TIMEOUT_S)
            check_vocabularies(target.vocab_fingerprint, target, replica.info)
        except TokenizerMismatch as error:
            await self.controller.remove_replica(name)
            raise InvalidArgument("model", str(error)) from None
        except BaseException:
            await self.controller.remove_replica(name)
            raise
        self.controller.pool.withheld.discard(name)
        return name

    async def _start_next(self) -> None:
        try:
            name, _ = await self._start_withheld()
        except ReplicaStartFailed as error:
            raise RolloutStopped(f"{self.progress}; stopped: the next replica did not start: {error}") from None
        self.controller.pool.withheld.discard(name)

    async def _start_withheld(self) -> tuple[str, Replica]:
        """Start a replica of the new model and wait until the pool sees it serving; it is routed nothing yet."""
        pool = self.controller.pool
        started = time.monotonic()
        name = await self.controller.start_replica(self.config, self.start_timeout_s)  # withheld
        try:
            await _serving(pool, name, self.start_timeout_s - (time.monotonic() - started))
        except BaseException:
            await self.controller.remove_replica(name)
            raise
        return name, pool.replicas[name]


async def _serving(pool, name: str, timeout_s: float) -> None:
    """Until the pool's health checks find replica `name` serving (and know what it serves)."""
    deadline = time.monotonic() + timeout_s
    while not ((replica := pool.replicas.get(name)) and replica.serving and replica.info is not None):
        if time.monotonic() > deadline:
            raise ReplicaStartFailed(f"replica {name} started but was not serving within {timeout_s:.0f} s")
        await asyncio.sleep(POLL_S)
