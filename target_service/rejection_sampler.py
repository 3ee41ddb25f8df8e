"""Speculative verification as pure tensor functions (no gRPC, no model).

Given the target's scores for k draft tokens plus one extra position, decide how
many draft tokens to accept and which token follows them:

- greedy: accept draft token i iff it equals the target's argmax at i; the next
  token is the target's argmax at the first mismatch (recovered) or after the
  last draft token (bonus). The output is exactly target-only greedy decoding.
- sampling: accept draft token x with probability min(1, p(x) / q(x)); at the
  first rejection sample the recovered token from norm(max(0, p - q)); when all
  k are accepted sample a bonus token from p. Each output token is then
  distributed exactly as if sampled from p (Leviathan et al., Chen et al. 2023).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specmesh.engine.sampling import sample_token


@dataclass(frozen=True)
class Verdict:
    accepted_count: int  # length of the accepted prefix of the draft
    next_token_id: int  # recovered (rejection) or bonus (all accepted)
    bonus: bool


def verify_greedy(target_logits: torch.Tensor, draft_token_ids: torch.Tensor) -> Verdict:
    """target_logits [k+1, V], draft_token_ids [k] -> Verdict."""
    k = draft_token_ids.numel()
    target_argmax = target_logits.argmax(dim=-1)  # [k+1]
    matches = (target_argmax[:k] == draft_token_ids).long()  # [k]
    accepted = int(matches.cumprod(dim=0).sum()) if k else 0
    return Verdict(accepted, int(target_argmax[accepted]), bonus=accepted == k)


def verify_sampled(
    target_probs: torch.Tensor,  # [k+1, V]
    draft_token_ids: torch.Tensor,  # [k]
    draft_probs: torch.Tensor | None,  # [k, V], or None: each draft token is a point mass
    generator: torch.Generator,
) -> Verdict:
    """Standard speculative rejection sampling; reproducible for a seeded generator."""
    k = draft_token_ids.numel()
    positions = torch.arange(k)
    p = target_probs[positions, draft_token_ids]  # [k] target prob of each draft token
    if draft_probs is None:
        q = torch.ones(k)  # point mass: q(x) = 1 for the proposed token
    else:
        q = draft_probs[positions, draft_token_ids]  # [k]
    uniform = torch.rand(k, generator=generator)  # [k]
    # q > 0 guard: a token the draft could not have sampled is never accepted.
    accept = (q > 0) & (uniform * q < p)  # u < p/q, without dividing by q
    accepted = int(accept.long().cumprod(dim=0).sum()) if k else 0
    if accepted == k:
        return Verdict(k, sample_token(target_probs[k], generator), bonus=True)
    return Verdict(accepted, _sample_recovered(target_probs[accepted], draft_probs, draft_token_ids,
                                               accepted, generator), bonus=False)


def _sample_recovered(
    target_row: torch.Tensor,  # [V] p at the rejected position
    draft_probs: torch.Tensor | None,  # [k, V]
    draft_token_ids: torch.Tensor,  # [k]
    position: int,
    generator: torch.Generator,
) -> int:
    if draft_probs is None:
        q_row = torch.zeros_like(target_row)
        q_row[draft_token_ids[position]] = 1.0
    else:
        q_row = draft_probs[position]
    residual = torch.clamp(target_row - q_row, min=0.0)  # [V]
    if residual.sum() <= 0:
        # Only when p == q numerically, where rejection has probability ~0: p itself is exact.
        residual = target_row
    return sample_token(residual, generator)
