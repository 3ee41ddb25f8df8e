"""End to end through the three services: sampled output follows the target's distribution.

The second generated token is the first one decided by the rejection sampler
(the first comes from the target's prefill), so its empirical distribution over
many seeded generations must approach the target's exact marginal
P(x2) = sum_x1 p(x1 | prompt) p(x2 | prompt, x1) -- for drafts that send their
distributions (dense or sparse) and for drafts that send ids only.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from benchmarks.links import LinkSpec
from harness import start_stack
from parity import PROMPT, SAMPLES, exact_second_token_marginal, expected_sampling_tv, total_variation
from specmesh.engine.sampling_params import SamplingParams

GIGABIT = LinkSpec(rtt_ms=2.0, bandwidth_bps=1e9)
CASES = [  # (sampling, the draft proposes point masses, the link between the orchestrator and each service)
    (SamplingParams(1.0), False, None),  # dense fp16 distributions on the wire
    (SamplingParams(0.8, top_k=12, top_p=0.9), False, None),  # sparse distributions
    (SamplingParams(1.0), True, None),  # ids only
    (SamplingParams(1.0), False, GIGABIT),  # over 1 Gbit/s links with a 2 ms round trip (benchmarks/links.py)
]


async def second_token_counts(stack, params: SamplingParams, seeds: range, vocab: int) -> torch.Tensor:
    limit = asyncio.Semaphore(24)

    async def one(seed: int) -> int:
        async with limit:
            # max_tokens 3: the round after the first token has room for a draft token (k = min(2, 3 - 1 - 1))
            token_ids, _, _ = await stack.generate(prompt=PROMPT, max_tokens=3, temperature=params.temperature,
                                                   top_k=params.top_k, top_p=params.top_p, seed=seed,
                                                   num_speculative_tokens=2)
        return token_ids[1] if len(token_ids) > 1 else None
    tokens = [t for t in await asyncio.gather(*(one(seed) for seed in seeds)) if t is not None]
    return torch.bincount(torch.tensor(tokens), minlength=vocab).float()


@pytest.mark.parametrize("params, point_mass, link", CASES, ids=["dense", "sparse", "ids-only", "gigabit-link"])
async def test_second_token_follows_target_distribution(tiny_llama_dir, tiny_llama_perturbed_dir, device,
                                                        params, point_mass, link):
    exact = exact_second_token_marginal(str(tiny_llama_dir), device, params)
    stack = await start_stack(tiny_llama_dir, tiny_llama_perturbed_dir, k=2, device=device,
                              greedy_proposals=point_mass, link=link)
    try:
        counts = await second_token_counts(stack, params, range(SAMPLES), exact.numel())
    finally:
        await stack.stop()
    assert stack.target_engine.scheduler.batched_steps > 0  # the verifications ran in shared steps
    assert all(line.bytes_up > 0 and line.bytes_down > 0 for line in stack.links)  # the calls crossed the links
    tv = total_variation(counts, exact)
    # Within the noise of SAMPLES exact draws (this shrinks like 1/sqrt(samples)) ...
    assert tv < 2 * expected_sampling_tv(exact, int(counts.sum())), tv
    # ... and far from other distributions, which no number of samples would close.
    references = torch.softmax(torch.randn(5, exact.numel(), generator=torch.Generator().manual_seed(3)) * 2, -1)
    assert min(total_variation(counts, ref) for ref in references) > 4 * tv
