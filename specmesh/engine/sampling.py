"""Sampling math shared by the draft and the target.

Both sides turn logits into probabilities with the same function, so a draft
distribution q and a target distribution p are comparable position by position.
The order of the transforms follows transformers' `generate`: temperature, then
top-k, then top-p.
"""

from __future__ import annotations

import math

import torch

# What a request asks lives without torch (clients import it); the math over it is here.
from specmesh.engine.sampling_params import SamplingParams


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Apply temperature, top-k and top-p to `logits` [n, V]; return probs [n, V] in float32."""
    if params.greedy:
        raise ValueError("greedy decoding has no sampling distribution; use argmax")
    scores = logits.float() / params.temperature  # [n, V]
    if params.top_k > 0 and params.top_k < scores.shape[-1]:
        kth_best = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]  # [n, 1]
        scores = scores.masked_fill(scores < kth_best, -math.inf)
    if params.top_p < 1.0:
        scores = _mask_outside_nucleus(scores, params.top_p)
    return torch.softmax(scores, dim=-1)


def _mask_outside_nucleus(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest most-likely set whose mass reaches top_p (always >= 1 token)."""
    sorted_scores, order = torch.sort(scores, dim=-1, descending=True)  # [n, V]
    sorted_probs = torch.softmax(sorted_scores, dim=-1)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # [n, V]
    drop_sorted = mass_before >= top_p  # the token that crosses top_p is kept
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return scores.masked_fill(drop, -math.inf)


def make_generator(seed: int | None, salt: int = 0) -> torch.Generator:
    """A per-session CPU generator, so seeded requests are reproducible.

    `salt` separates the draft's stream from the target's under the same seed.
    """
    generator = torch.Generator(device="cpu")
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed((seed * 1_000_003 + salt) % (2**63))
    return generator


def generator_at(session_seed: int, position: int) -> torch.Generator:
    """A generator for draws that start at `position`, derived from the session's seed.

    The draft samples each proposal from the generator of its first position, so
    the same prefix drafted twice (a pre-drafted branch and a fresh proposal, or a
    pipelined and a sequential run) gives the same tokens, whatever the timing.
    """
    generator = torch.Generator(device="cpu")
    generator.manual_seed((session_seed * 1_000_033 + position * 998_244_353 + 17) % (2**63))
    return generator


def sample_token(probs: torch.Tensor, generator: torch.Generator) -> int:
    """Draw one token id from probs [V] (non-negative with positive mass, need not be normalised).

    One uniform draw located in the float64 cumulative sum: a token is drawn with probability its
    share of the mass (to float64 rounding), one sequential pass over V. torch.multinomial draws an
    exponential per token instead, several ms for a 150k vocabulary on a CPU core."""
    probs = probs.detach().cpu()
    cumulative = torch.cumsum(probs, dim=0, dtype=torch.float64)  # [V]
    point = torch.rand(1, generator=generator, dtype=torch.float64) * cumulative[-1]  # [1] in [0, mass)
    index = int(torch.searchsorted(cumulative, point, right=True))  # the first token whose mass passes it
    if index >= cumulative.numel():  # the draw rounded up to the whole mass: the last token that has any
        index = int(torch.nonzero(probs > 0).max())
    return index
