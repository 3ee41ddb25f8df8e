"""Engine operations only tests need, built on what the engines offer the services."""

from __future__ import annotations

from typing import Sequence

import torch
from transformers import DynamicCache

from draft_service.engine import CommitSpec, DraftEngine
from specmesh.engine.model_engine import ModelEngine, Session
from specmesh.engine.sampling_params import SamplingParams


def feed_uncached(engine: ModelEngine, session: Session, extra: Sequence[int] = (),
                  keep_rows: int | None = None) -> tuple[torch.Tensor, int]:
    """Forward the sequence's uncached tail plus `extra` now, on this thread and outside any batched
    step (the services feed through jobs); (logits [keep_rows, V] of the last positions, ns)."""
    return engine.forward(session, session.uncached_tail + list(extra), keep_rows)


def next_logits_cached(engine: ModelEngine, request_id: str) -> torch.Tensor:
    """The logits [V] after the session's sequence, from its cache."""
    return feed_uncached(engine, engine.get(request_id))[0][-1]


def next_logits_fresh(engine: ModelEngine, token_ids: list[int]) -> torch.Tensor:
    """The logits [V] after `token_ids`, from a fresh prefill."""
    session = engine.new_session("fresh", token_ids, SamplingParams(0.0))
    try:
        return feed_uncached(engine, session)[0][-1]
    finally:
        engine.close("fresh")


async def commit_alone(draft: DraftEngine, request_id: str, round_number: int, commit: CommitSpec) -> int:
    """Apply a commit with no drafting after it; the sequence's new length.

    The services only ever apply a commit at the start of a Propose or PreDraft; a test that checks
    the draft's state between the two applies it on its own, as a call of that round would: it
    interrupts any pre-draft and runs on the engine's worker after the session's earlier jobs.
    """
    session, _ = draft._arrive(request_id, round_number)
    await draft.engine.run(draft._apply_commit, session, commit, session=session)
    return len(session.token_ids)


def session_over(engine, token_ids: list[int], cached: int) -> Session:
    """A session whose cache covers token_ids[:cached]."""
    session = Session(f"s{len(token_ids)}-{cached}", list(token_ids), DynamicCache(), SamplingParams(), torch.Generator())
    if cached:
        engine.forward(session, token_ids[:cached])
    return session
