"""What a verification round did and where its time went, as attributes on its span."""

from __future__ import annotations

from opentelemetry import trace

from orchestrator.decoding.timing import RoundBreakdown
from specmesh.v1 import draft_pb2, target_pb2


def describe_round(span: trace.Span, proposal: draft_pb2.ProposeResponse | None,
                   verified: target_pb2.VerifyResponse, proposed: int) -> None:
    """What one round did, on its span: the facts only the responses know, and the tokens it proposed
    (the draft's, or a free proposal's)."""
    if not span.is_recording():
        return
    span.set_attributes({
        "specmesh.proposed": proposed,
        "specmesh.accepted": verified.accepted_count,
        "specmesh.next_token": "bonus" if verified.next_token_kind == target_pb2.NEXT_TOKEN_KIND_BONUS
        else "recovered",
        "specmesh.committed_length": verified.committed_length,
        "specmesh.target_forward_ns": verified.forward_ns,
        "specmesh.verify_response_bytes": verified.ByteSize(),
    })
    if proposal is not None:
        span.set_attributes({"specmesh.draft_forward_ns": proposal.forward_ns,
                             "specmesh.propose_response_bytes": proposal.ByteSize()})


def describe_breakdown(span: trace.Span, breakdown: RoundBreakdown) -> None:
    """Where the round's time went (orchestrator.decoding.timing), in milliseconds."""
    if not span.is_recording():
        return
    span.set_attributes({f"specmesh.time.{part}_ms": seconds * 1e3 for part, seconds in breakdown.parts().items()})
    span.set_attribute("specmesh.time.wall_ms", breakdown.wall_s * 1e3)
    if breakdown.predraft is not None:
        span.set_attribute("specmesh.predraft", breakdown.predraft)
