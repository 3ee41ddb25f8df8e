"""What the speculative loop asks of its draft and its target, whoever answers.

The loop (orchestrator.decoding.loop, .pipelined) is handed either a single service's gRPC
client (orchestrator.serving.clients) or a pool of replicas behind one client that moves
sessions when a replica dies (orchestrator.serving.failover); both are these. Timeouts are
seconds; positions are absolute and 0-based.
"""

from __future__ import annotations

from typing import AsyncIterator, Protocol, Sequence, runtime_checkable

from specmesh.engine.sampling_params import SamplingParams
from specmesh.v1 import common_pb2, draft_pb2, target_pb2


@runtime_checkable
class BranchStream(Protocol):
    """A PreDraft stream: iterate it for branches, cancel it to stop listening."""

    def __aiter__(self) -> AsyncIterator[draft_pb2.DraftBranch]: ...

    def cancel(self) -> bool: ...


@runtime_checkable
class DraftEndpoint(Protocol):
    async def open(self, request_id: str, prompt: Sequence[int], sampling: SamplingParams,
                   timeout: float, max_new_tokens: int = 0) -> draft_pb2.DraftOpenResponse:
        """Prefill a session; max_new_tokens: what it may add to the prompt (0: the context window)."""

    async def propose(self, request_id: str, round_number: int, commit: draft_pb2.Commit | None,
                      position: int, num_tokens: int, timeout: float,
                      stop_below: float = 0.0) -> draft_pb2.ProposeResponse:
        """Apply the commit, then draft num_tokens after `position`, fewer where the draft's run
        probability falls below stop_below (0: all of them)."""

    def predraft(self, request_id: str, round_number: int, commit: draft_pb2.Commit | None, position: int,
                 assumed_token_ids: Sequence[int], num_tokens: int, extra_branches: int,
                 timeout: float) -> BranchStream:
        """Draft round_number's branches while the round before it is verified."""

    async def close(self, request_id: str) -> None:
        """Free the session; best effort, never raises."""


@runtime_checkable
class TargetEndpoint(Protocol):
    async def open(self, request_id: str, prompt: Sequence[int], sampling: SamplingParams,
                   timeout: float, max_new_tokens: int = 0) -> target_pb2.TargetOpenResponse:
        """Prefill a session and sample its first token."""

    async def verify(self, request_id: str, round_number: int, position: int, draft_token_ids: Sequence[int],
                     distributions: Sequence[common_pb2.TokenDistribution], timeout: float,
                     draft_source: int = target_pb2.DRAFT_SOURCE_DRAFT_MODEL,
                     alternatives: Sequence[target_pb2.DraftAlternative] = (),
                     decode_ahead: int = 0) -> target_pb2.VerifyResponse:
        """Accept a prefix of the draft tokens at `position`; the next token after it (and, where that
        token is one of the alternatives, the one after that; with no drafts, up to `decode_ahead` more
        tokens of the target alone)."""

    async def close(self, request_id: str) -> None:
        """Free the session; best effort, never raises."""
