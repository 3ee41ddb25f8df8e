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
from harness import load, start_stack
from specmesh.sampling import SamplingParams, logits_to_probs

PROMPT = "def add(a, b):"
SAMPLES = 1000
GIGABIT = LinkSpec(rtt_ms=2.0, bandwidth_bps=1e9)
CASES = [  # (sampling, the draft proposes point masses, the link between the orchestrator and each service)
    (SamplingParams(1.0), False, None),  # dense fp16 distributions on the wire
    (SamplingParams(0.8, top_k=12, top_p=0.9), False, None),  # sparse distributions
    (SamplingParams(1.0), True, None),  # ids only
    (SamplingParams(1.0), False, GIGABIT),  # over 1 Gbit/s links with a 2 ms round trip (benchmarks/links.py)
]


def exact_two_tokens(model, prompt_ids: list[int], params: SamplingParams, eos: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """p(first token) [V], never EOS (a generation that ends at its first token has no second), and
    p(second | first) [V, V]."""
    with torch.inference_mode():
        first = logits_to_probs(model(torch.tensor([prompt_ids], device=model.device)).logits[0, -1:].cpu(),
                                params)[0]  # [V]
        vocab = first.numel()
        batch = torch.cat([torch.tensor(prompt_ids).repeat(vocab, 1), torch.arange(vocab)[:, None]], dim=1)
        second = logits_to_probs(model(batch.to(model.device)).logits[:, -1].cpu(), params)  # [V, V]
        first[eos] = 0.0
    return first / first.sum(), second


def exact_second_token_marginal(model_dir: str, device: str, params: SamplingParams) -> torch.Tensor:
    model, tokenizer = load(model_dir, device)
    first, second = exact_two_tokens(model, tokenizer.encode(PROMPT), params, tokenizer.eos_token_id)
    return first @ second  # [V]


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


def total_variation(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - probs).abs().sum())


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


def expected_sampling_tv(probs: torch.Tensor, samples: int) -> float:
    """E[TV(empirical, probs)] over `samples` draws: 0.5 * sum_v sqrt(2 p (1 - p) / (pi n))."""
    return 0.5 * float(torch.sqrt(2 * probs * (1 - probs) / torch.pi).sum()) / samples ** 0.5
