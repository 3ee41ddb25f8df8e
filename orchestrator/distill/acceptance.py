"""Greedy acceptance at a fixed k, computed from one teacher-forced draft forward.

Under greedy decoding the speculative loop commits exactly the target's greedy
continuation c. A round starting at continuation index g drafts from prompt + c[:g];
as long as the draft's tokens equal c, its own autoregressive context equals the
teacher-forced one, so the accepted count is the run of consecutive j = g, g+1, ...
(at most k) where the draft's teacher-forced argmax at j equals c[j]. The round then
commits that run plus the target's token, and the next round starts after it.
This replays `SpeculativeGeneration`'s rounds (first token from the target's prefill,
k cut to the tokens left, stop at max_tokens or an eos) without running either service.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class AcceptanceStats:
    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    round_tokens: int = 0  # tokens committed by verification rounds
    outcomes: list[tuple[int, int]] = field(default_factory=list, repr=False)  # (drafted, accepted) a round

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def tokens_per_round(self) -> float:
        return self.round_tokens / self.rounds if self.rounds else 0.0

    def add(self, other: AcceptanceStats) -> None:
        self.rounds += other.rounds
        self.draft_tokens += other.draft_tokens
        self.accepted_tokens += other.accepted_tokens
        self.round_tokens += other.round_tokens
        self.outcomes += other.outcomes

    def as_dict(self) -> dict:
        return {"rounds": self.rounds, "draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens,
                "acceptance_rate": self.acceptance_rate, "tokens_per_round": self.tokens_per_round}


def replay_rounds(continuation: Sequence[int], draft_argmax: Sequence[int], k: int, max_tokens: int,
                  target_eos: set[int], draft_eos: set[int]) -> AcceptanceStats:
    """The rounds of one greedy request whose target continuation is `continuation` (>= max_tokens
    tokens); draft_argmax[j] is the draft's teacher-forced argmax for continuation index j.

    Drafted counts are exact except when the draft, after its first mismatch, would have
    proposed an eos (it stops there): its context has left the teacher-forced one by then."""
    stats = AcceptanceStats()
    generated = 1  # the first token comes from the target's prefill
    if continuation[0] in target_eos:
        return stats
    while generated < max_tokens:
        drafting = max(0, min(k, max_tokens - generated - 1))
        accepted, drafted = 0, drafting
        for offset in range(drafting):
            token = draft_argmax[generated + offset]
            if token in draft_eos:
                drafted = offset + 1  # the draft stops after proposing an eos
            if token != continuation[generated + offset]:
                break
            accepted += 1
            if token in draft_eos:
                break
        committed = continuation[generated: generated + accepted + 1]
        stats.rounds += 1
        stats.draft_tokens += drafted
        stats.accepted_tokens += accepted
        stats.round_tokens += len(committed)
        stats.outcomes.append((drafted, accepted))
        generated += len(committed)
        if any(token in target_eos for token in committed):
            break
    return stats


def measure_acceptance(draft_argmax: torch.Tensor, continuations: torch.Tensor, k: int,
                       target_eos: set[int], draft_eos: set[int]) -> AcceptanceStats:
    """Totals over requests; draft_argmax, continuations [N, L], max_tokens = L."""
    total = AcceptanceStats()
    length = continuations.shape[1]
    for argmax_row, continuation_row in zip(draft_argmax.tolist(), continuations.tolist()):
        total.add(replay_rounds(continuation_row, argmax_row, k, length, target_eos, draft_eos))
    return total
