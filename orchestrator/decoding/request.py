"""What the speculative loop is given and what it reports: the request, the server's settings, a round's
waits, and the request's counts (orchestrator.decoding.loop; the policy it plans rounds with:
orchestrator.decoding.plan)."""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.decoding.proposals import LOOKUP, FreeProposal
from orchestrator.decoding.suffix_index import DEFAULT_MAX_BYTES
from specmesh.roles import MAX_DECODE_AHEAD
from specmesh.engine.sampling_params import SamplingParams

ROUND_CALLS = ("unary", "stream", "batch")  # LoopConfig.round_calls


@dataclass(frozen=True)
class LoopConfig:
    # The most draft tokens a round asks for; the adaptive policy picks each round's k up to it
    # (docs/design/draft-length.md).
    num_speculative_tokens: int = 7
    # Adaptive: k per round from observed acceptance and costs, up to the request's k
    # (orchestrator.decoding.policy). Requests that name their k, or sample with a seed, keep it fixed.
    adaptive_k: bool = True
    draft_timeout_s: float = 5.0  # per-round deadline on the draft; past it, target-only
    target_timeout_s: float = 120.0  # per-call deadline on the target
    # ... plus this much per prompt token for its prefill: a batching target feeds a long prompt
    # in chunks between other streams' steps, which takes longer than one hung call would.
    prefill_timeout_per_token_s: float = 0.1
    # Draft the next round while the target verifies this one (orchestrator.decoding.pipelined):
    # "on", "off", or "auto" = on when draft and target compute on separate hardware.
    pipeline: str = "auto"
    extra_branches: int | None = None  # pre-drafted rejection branches; None = from measured costs
    # With the adaptive policy, rounds may verify tokens proposed at no model cost where they pay more
    # than the draft's: prompt lookup's (orchestrator.decoding.lookup) and the suffix index's, from
    # earlier requests (orchestrator.decoding.suffix_index), which holds up to suffix_index_bytes.
    prompt_lookup: bool = True
    suffix_index: bool = True
    suffix_index_bytes: int = DEFAULT_MAX_BYTES
    # How a session's rounds reach the draft and target: "batch", a part of one message that carries every
    # session's round to a replica (orchestrator.serving.round_batches; the replica steps them together);
    # "stream", a message each on one bidirectional stream per session and service; or "unary", a Propose
    # and a Verify call each (dearer a round).
    round_calls: str = "batch"
    # The most tokens a target-only round's Verify decodes after its next one, as many as the measured
    # call latency asks for (orchestrator.decoding.decode_ahead); 0: one token a round.
    decode_ahead: int = MAX_DECODE_AHEAD


class SpeculationSwitch:
    """The server-wide kill switch; every generation reads it at the start of each round."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: list[str]
    num_speculative_tokens: int  # 0 = target-only; with adaptive k, the most per round
    fixed_k: bool = False  # the client asked for exactly num_speculative_tokens
    deadline: float | None = None  # time.monotonic() by which the client gives up
    prompt_class: str = ""  # metrics label chosen by the client
    user: str = ""  # the client's end user, recorded on the trace only


@dataclass(frozen=True)
class RoundTiming:
    draft_s: float  # wall time the round waited for its draft tokens (0 in a target-only round)
    verify_s: float  # wall time of the Verify call
    # The forward time the services reported for those waits; None: unknown (the waits count as forward time).
    draft_forward_s: float | None = None
    verify_forward_s: float | None = None
    target_steps: int = 1  # the Verify's target steps: more than one where it decoded ahead
    predraft: str | None = None  # pipelined: HIT or MISS where the round had a pre-draft (timing.RoundBreakdown)


@dataclass
class LoopStats:
    draft_tokens: int = 0
    accepted_tokens: int = 0
    rounds: int = 0
    round_tokens: int = 0  # tokens committed by verification rounds
    target_forward_passes: int = 0
    draft_fallback: bool = False
    lookup_tokens: int = 0  # prompt-lookup tokens verified (orchestrator.decoding.lookup) ...
    lookup_accepted_tokens: int = 0  # ... and accepted
    suffix_tokens: int = 0  # suffix-index tokens verified (orchestrator.decoding.suffix_index) ...
    suffix_accepted_tokens: int = 0  # ... and accepted
    alternative_tokens: int = 0  # the draft's second choices verified beside its tokens ...
    alternative_accepted_tokens: int = 0  # ... and committed

    def count_free(self, free: FreeProposal, accepted: int) -> None:
        if free.source == LOOKUP:
            self.lookup_tokens += len(free.tokens)
            self.lookup_accepted_tokens += accepted
        else:
            self.suffix_tokens += len(free.tokens)
            self.suffix_accepted_tokens += accepted
