"""Draft and target clients over replica pools: a session sticks to one replica and moves when it dies.

They are the loop's Draft/TargetEndpoint (orchestrator.decoding.endpoints), so it never sees
replicas. Each remembers the sequence its session holds on its replica — the
target's committed tokens (prompt, first token, each round's accepted prefix plus
recovered or bonus token), the draft's tokens (commits applied, proposals appended)
— so when a call finds its replica gone (UNAVAILABLE, or NOT_FOUND from a replica
that restarted empty), or the pool's health checks find the replica unreachable while
the call waits on it (a stalled link, a hung replica: orchestrator.serving.pool), the
session is re-prefilled on the least-loaded other replica from that sequence and the
same call is sent again with the same round and position. (A replica that was only cut
off by a link reset, and is chosen again, still holds the session: that copy is closed first.) The client stream then has no lost or
duplicated token, and under greedy the same output. (Under sampling the output keeps the target's distribution; a
seeded request is no longer reproducible across the move.) A request that loses `max_replica_failures` replicas is failed
(ABORTED) rather than allowed to take down one replica after another; a pool with
no healthy replica answers UNAVAILABLE within the request's deadline. The loop
treats any draft error as "go target-only", so draft failures never reach clients.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Sequence

import grpc

from orchestrator.serving.clients import UpstreamError
from orchestrator.serving.pool import NoHealthyReplica, Replica, ReplicaPool
from specmesh.engine.commit import committed_sequence, committed_tokens
from specmesh.errors import SpecmeshError
from specmesh.engine.sampling_params import SamplingParams
from specmesh.v1 import common_pb2, draft_pb2, target_pb2

log = logging.getLogger(__name__)
# UNAVAILABLE: the replica is unreachable; CANCELLED: it stopped under our call; NOT_FOUND:
# it restarted without our session. Each means the replica lost the session, never that the
# request was bad, so retrying elsewhere cannot change the output.
FAILOVER_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.NOT_FOUND})
MAX_REPLICA_FAILURES = 2


class ReplicaFailure(UpstreamError):
    """The pool could not serve the request: no healthy replica, or too many lost."""

    def __init__(self, service: str, code: grpc.StatusCode, message: str):
        SpecmeshError.__init__(self, f"{service} service: {code.name}: {message}")
        self.code = code


@dataclass
class Placement:
    sequence: list[int]  # what the session holds on its replica
    sampling: SamplingParams
    replica: Replica | None = None
    opened: bool = False  # the session exists (on this or a lost replica)
    stale: bool = False  # placed on a new replica that does not hold the session yet
    failures: int = 0
    kv_limit: int = 0  # the most tokens the session may hold (its KV reservation); 0: the context window

    @property
    def max_new_tokens(self) -> int:
        """What a re-opened session may still add: the rest of its reservation (0: no limit)."""
        return max(1, self.kv_limit - len(self.sequence)) if self.kv_limit else 0


def _code(error: Exception) -> grpc.StatusCode:
    return error.code if isinstance(error, UpstreamError) else error.code()


def _remaining(deadline: float) -> float:
    return max(0.001, deadline - time.monotonic())


async def _afresh(client, request_id: str, timeout: float, open_session: Callable[[float], Awaitable]):
    """open_session(timeout), on a replica that may still hold the session: then it is closed and opened again.

    Session ids are unique, so a replica answers an open with ALREADY_EXISTS only when the session was opened
    there before and a call found the replica lost though it was not: only the connection broke (a link reset),
    swallowing the answer to an open or a round, so the replica's copy may be past what we know of the session.
    Opened again from our record, it holds what any other replica would. (Not closed in advance: a close that
    finds no session, as on a replica that did restart, makes the replica refuse a later open of it.)
    """
    deadline = time.monotonic() + timeout
    try:
        return await open_session(timeout)
    except (UpstreamError, grpc.aio.AioRpcError) as error:
        if _code(error) != grpc.StatusCode.ALREADY_EXISTS:
            raise
    await client.close(request_id)
    return await open_session(_remaining(deadline))


class PooledClient:
    service = ""

    def __init__(self, pool: ReplicaPool, *, max_replica_failures: int = MAX_REPLICA_FAILURES,
                 acquire_timeout_s: float = 10.0):
        self.pool = pool
        self.max_replica_failures = max_replica_failures
        self.acquire_timeout_s = acquire_timeout_s  # longest wait for a healthy replica
        self.sessions: dict[str, Placement] = {}
        self.failovers = 0  # sessions moved off a lost replica, over this client's life

    async def model_info(self, timeout: float) -> common_pb2.ModelInfo:
        replica = await self._acquire(time.monotonic() + timeout, session=False)
        try:
            return await replica.client.model_info(timeout=timeout)
        finally:
            self.pool.release(replica)

    async def close(self, request_id: str) -> None:
        placement = self.sessions.pop(request_id, None)
        if placement is not None and placement.replica is not None:
            self.pool.release(placement.replica)
            await placement.replica.client.close(request_id)

    def _forget(self, request_id: str, placement: Placement) -> None:
        """A session its replica refused to open: nothing there to close, its place in the pool given back, and
        an open of the same id later is a new one."""
        if self.sessions.get(request_id) is placement:
            del self.sessions[request_id]
        if placement.replica is not None:
            self.pool.release(placement.replica)
            placement.replica = None

    async def _call(self, request_id: str, placement: Placement, timeout: float,
                    call: Callable[[object, float], Awaitable]):
        """Run call(client, timeout) on the session's replica, moving the session when it is lost."""
        deadline = time.monotonic() + timeout
        while True:
            if placement.replica is None:
                placement.replica = await self._acquire(deadline)
                placement.stale = placement.opened
            replica = placement.replica
            try:
                return await replica.unless_unreachable(self._attempt(request_id, placement, replica, deadline, call))
            except (UpstreamError, grpc.aio.AioRpcError) as error:
                if isinstance(error, ReplicaFailure) or _code(error) not in FAILOVER_CODES:
                    raise
                self._lose(request_id, placement, replica, error)

    async def _attempt(self, request_id: str, placement: Placement, replica: Replica, deadline: float,
                       call: Callable[[object, float], Awaitable]):
        """call(client, timeout) on `replica`, after re-opening the session there when it has just moved."""
        if placement.stale:
            await _afresh(replica.client, request_id, _remaining(deadline),
                          lambda left: self._reopen(replica.client, request_id, placement, left))
            placement.stale = False
        return await call(replica.client, _remaining(deadline))

    def _lose(self, request_id: str, placement: Placement, replica: Replica, error: Exception) -> None:
        placement.failures += 1
        self.failovers += 1
        self.pool.mark_failed(replica)
        self.pool.release(replica)
        placement.replica = None
        log.warning("request %s lost %s replica %s (%s)", request_id, self.service, replica.name, error)
        if placement.failures >= self.max_replica_failures:
            raise self._failure(grpc.StatusCode.ABORTED,
                                f"request {request_id} lost {placement.failures} {self.service} replicas; "
                                "failing it rather than letting it take down more")

    async def _acquire(self, deadline: float, session: bool = True) -> Replica:
        try:
            return await self.pool.acquire(min(self.acquire_timeout_s, max(0.0, deadline - time.monotonic())),
                                           session)
        except NoHealthyReplica as error:
            raise self._failure(grpc.StatusCode.UNAVAILABLE, str(error)) from None

    async def _reopen(self, client, request_id: str, placement: Placement, timeout: float) -> None:
        raise NotImplementedError

    def _failure(self, code: grpc.StatusCode, message: str) -> Exception:
        raise NotImplementedError

    async def open(self, request_id: str, prompt: Sequence[int], sampling: SamplingParams, timeout: float,
                   max_new_tokens: int = 0):
        placement = self.sessions[request_id] = Placement(
            list(prompt), sampling, kv_limit=len(prompt) + max_new_tokens if max_new_tokens else 0)
        try:
            opened = await self._call(request_id, placement, timeout, lambda client, t: _afresh(
                client, request_id, t, lambda left: client.open(request_id, prompt, sampling, left, max_new_tokens)))
        except (UpstreamError, grpc.aio.AioRpcError) as error:
            if _code(error) == grpc.StatusCode.RESOURCE_EXHAUSTED:  # refused before the replica made anything
                self._forget(request_id, placement)
            raise
        placement.opened = True
        self._opened(placement, opened)
        return opened

    def _opened(self, placement: Placement, opened) -> None:
        """What an open adds to the session's committed sequence (the target's first token)."""


class PooledTargetClient(PooledClient):
    service = "target"

    def _opened(self, placement: Placement, opened: target_pb2.TargetOpenResponse) -> None:
        placement.sequence.append(opened.token_id)  # the target's prefill committed the first token

    async def verify(self, request_id: str, round_number: int, position: int, draft_token_ids: Sequence[int],
                     distributions: Sequence[common_pb2.TokenDistribution], timeout: float,
                     draft_source: int = target_pb2.DRAFT_SOURCE_DRAFT_MODEL,
                     alternatives: Sequence[target_pb2.DraftAlternative] = (),
                     decode_ahead: int = 0) -> target_pb2.VerifyResponse:
        placement = self.sessions[request_id]
        verified = await self._call(request_id, placement, timeout, lambda client, t: client.verify(
            request_id, round_number, position, draft_token_ids, distributions, t, draft_source, alternatives,
            decode_ahead))
        placement.sequence = committed_sequence(placement.sequence, position, committed_tokens(
            draft_token_ids, verified.accepted_count, verified.next_token_id, verified.after_token_ids))
        return verified

    async def _reopen(self, client, request_id: str, placement: Placement, timeout: float) -> None:
        await client.resume(request_id, placement.sequence, placement.sampling, timeout, placement.max_new_tokens)

    def _failure(self, code: grpc.StatusCode, message: str) -> Exception:
        return ReplicaFailure(self.service, code, message)


class PooledDraftClient(PooledClient):
    service = "draft"

    async def propose(self, request_id: str, round_number: int, commit: draft_pb2.Commit | None,
                      position: int, num_tokens: int, timeout: float,
                      stop_below: float = 0.0) -> draft_pb2.ProposeResponse:
        placement = self.sessions[request_id]
        placement.opened = True  # an open lost with its replica is redone on the next one
        # A re-opened replica holds exactly `sequence`, so the same commit applies to it unchanged.
        proposal = await self._call(request_id, placement, timeout, lambda client, t: client.propose(
            request_id, round_number, commit, position, num_tokens, t, stop_below))
        if commit is not None:
            placement.sequence = committed_sequence(placement.sequence, commit.position, commit.token_ids)
        placement.sequence.extend(proposal.token_ids)
        return proposal

    def predraft(self, request_id: str, round_number: int, commit: draft_pb2.Commit | None, position: int,
                 assumed_token_ids: Sequence[int], num_tokens: int, extra_branches: int, timeout: float):
        """The PreDraft stream on the session's replica; an empty one while the session is between replicas.

        A pre-draft is only an optimisation: when its replica is lost the stream just ends,
        and the loop's next Propose moves the session (its commit re-syncs the new replica).
        """
        placement = self.sessions[request_id]
        if placement.replica is None or placement.stale:
            return _NoBranches()
        if commit is not None:  # what a re-opened replica must hold: the commit, then the tokens assumed
            placement.sequence = committed_sequence(placement.sequence, commit.position, commit.token_ids)
        placement.sequence.extend(assumed_token_ids)
        return placement.replica.client.predraft(request_id, round_number, commit, position, assumed_token_ids,
                                                 num_tokens, extra_branches, timeout)

    def model_of(self, request_id: str) -> str | None:
        """The model of the replica the session is on (from its last health check); None between replicas."""
        placement = self.sessions.get(request_id)
        replica = placement.replica if placement is not None else None
        return replica.info.model if replica is not None and replica.info is not None else None

    async def _reopen(self, client, request_id: str, placement: Placement, timeout: float) -> None:
        await client.open(request_id, placement.sequence, placement.sampling, timeout, placement.max_new_tokens)

    def _failure(self, code: grpc.StatusCode, message: str) -> Exception:
        # The loop answers any draft RPC error by going target-only: the output is unchanged.
        return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=message)


class _NoBranches:
    """A PreDraft stream that yields nothing (the loop then drafts with a fresh Propose)."""

    def __aiter__(self):
        return self

    async def __anext__(self):
        raise StopAsyncIteration

    def cancel(self) -> bool:
        return False
