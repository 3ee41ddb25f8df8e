"""Check the draft and target against the orchestrator's tokenizer and decide pipelining: the Backends a
servicer runs over."""

from __future__ import annotations

import logging

from transformers import PreTrainedTokenizerBase

from orchestrator.decoding.request import LoopConfig
from orchestrator.decoding.pipelined import pipeline_enabled
from orchestrator.serving.step_reports import StepReports
from orchestrator.serving.servicer import Backends
from orchestrator.serving.validation import ModelLimits
from specmesh.loading import models
from specmesh.v1 import common_pb2


log = logging.getLogger(__name__)
STARTUP_TIMEOUT_S = 30.0


class TokenizerMismatch(RuntimeError):
    """Draft and target (or the orchestrator's tokenizer) disagree on the vocabulary."""


def check_vocabularies(tokenizer_fingerprint: str, target: common_pb2.ModelInfo,
                       draft: common_pb2.ModelInfo | None) -> None:
    """Refuse to start when draft and target would mean different things by a token id."""
    if draft is not None and draft.vocab_fingerprint != target.vocab_fingerprint:
        raise TokenizerMismatch(
            f"draft model {draft.model!r} and target model {target.model!r} have different tokenizer "
            f"vocabularies (fingerprints {draft.vocab_fingerprint[:12]} vs {target.vocab_fingerprint[:12]}); "
            "speculative decoding needs a draft that shares the target's tokenizer")
    if tokenizer_fingerprint != target.vocab_fingerprint:
        raise TokenizerMismatch(
            f"the orchestrator's tokenizer differs from the target model {target.model!r}'s")


async def backends_for(tokenizer: PreTrainedTokenizerBase, target, draft, draft_info: common_pb2.ModelInfo | None,
                       loop: LoopConfig, step_reports: StepReports | None = None) -> Backends:
    """Check the target (and the draft's info, when known) against the tokenizer; return the backends.
    `step_reports`: those the pools' health checks keep current, if any."""
    target_info = await target.model_info(timeout=STARTUP_TIMEOUT_S)
    check_vocabularies(models.vocab_fingerprint(tokenizer), target_info, draft_info)
    pipelined = pipeline_enabled(loop.pipeline, target_info, draft_info)
    if draft is not None:
        where = f"{draft_info.host} {draft_info.device}" if draft_info is not None else "(no draft replica yet)"
        log.info("speculation %s: target on %s %s, draft on %s", "pipelined" if pipelined else "sequential",
                 target_info.host, target_info.device, where)
    limits = ModelLimits(vocab_size=target_info.vocab_size, context_window=target_info.context_window,
                         default_num_speculative_tokens=loop.num_speculative_tokens)
    step_reports = StepReports() if step_reports is None else step_reports
    step_reports.update("target", target_info)
    step_reports.update("draft", draft_info)
    return Backends(target=target, draft=draft, eos_token_ids=set(target_info.eos_token_ids), limits=limits,
                    model=target_info.model, pipelined=pipelined,
                    draft_model=draft_info.model if draft_info is not None else "", step_reports=step_reports)
