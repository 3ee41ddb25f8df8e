"""Domain errors raised by engines and mapped to gRPC status codes in one place.

Engines and servicers raise these; `specmesh.server.grpc_server.ErrorInterceptor` turns them
into statuses, so a bad request never becomes INTERNAL and never kills a server.
"""

from __future__ import annotations

import grpc


class SpecmeshError(Exception):
    """Base class; `code` is the gRPC status the error maps to."""

    code = grpc.StatusCode.INTERNAL


class InvalidArgument(SpecmeshError):
    """A request field is malformed; `field` names it for the client."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, description: str):
        super().__init__(f"{field}: {description}" if field else description)  # "": the request as a whole
        self.field = field
        self.description = description


class SessionNotFound(SpecmeshError):
    code = grpc.StatusCode.NOT_FOUND

    def __init__(self, request_id: str):
        super().__init__(f"no session with request_id {request_id!r}")


class SessionExists(SpecmeshError):
    code = grpc.StatusCode.ALREADY_EXISTS

    def __init__(self, request_id: str):
        super().__init__(f"a session with request_id {request_id!r} is already open")


class SessionClosed(SpecmeshError):
    """An open for a session its caller already closed (the close overtook the open on its way)."""

    code = grpc.StatusCode.ABORTED  # not CANCELLED: a pooled client would re-open it on another replica

    def __init__(self, request_id: str):
        super().__init__(f"session {request_id!r} was closed before it opened")


class PositionMismatch(SpecmeshError):
    """The caller's idea of the sequence length differs from the session's."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class StaleRound(SpecmeshError):
    """A message for a round older than one the session has already seen."""

    code = grpc.StatusCode.ABORTED


class CapacityExhausted(SpecmeshError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class NotManagedHere(SpecmeshError):
    """An operation for a part this process does not own (e.g. scaling pools it only joined)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class ShuttingDown(SpecmeshError):
    """The server is draining (specmesh.server.drain): new work is refused, late work cut off."""

    code = grpc.StatusCode.UNAVAILABLE


class RolloutInProgress(SpecmeshError):
    """A rollout is already replacing the pool's model (one at a time); the message names it."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class RolloutStopped(SpecmeshError):
    """A validated rollout could not go on (a later replica failed to start); the pool is left mixed."""

    code = grpc.StatusCode.ABORTED
