"""Sampled output under penalties and biases follows the target's penalized distribution.

As in test_sampling_parity: the second generated token is the first one the
rejection sampler decides, and its exact marginal is
sum_x1 p(x1 | prompt) p(x2 | prompt, x1), here with p taken after transformers'
own logits processors (and our reference for OpenAI's penalties), whose counts
see x1 -- a draft token while it is verified.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import LogitsProcessorList

from harness import load, start_stack
from parity import PROMPT, exact_second_token_marginal, expected_sampling_tv, reference_processors, total_variation
from specmesh.engine.sampling_params import SamplingParams
from specmesh.engine.sampling import logits_to_probs

SAMPLES = 1000
PENALTIES = {"repetition_penalty": 1.5, "presence_penalty": 1.0, "frequency_penalty": 1.0, "logit_bias": {7: 3.0}}
CASES = [SamplingParams(0.5), SamplingParams(0.8, top_k=12)]  # dense and sparse draft distributions


def processed_probs(processors: LogitsProcessorList, input_ids: torch.Tensor, logits: torch.Tensor,
                    params: SamplingParams) -> torch.Tensor:
    """input_ids [B, L], logits [B, V] of their next token -> probs [B, V] after the processors and sampling."""
    return logits_to_probs(processors(input_ids, logits.float()), params)


def exact_penalized_marginal(model_dir: str, device: str, params: SamplingParams) -> torch.Tensor:
    model, tokenizer = load(model_dir, device)
    prompt_ids = tokenizer.encode(PROMPT)
    processors = reference_processors(PENALTIES, len(prompt_ids))
    prompt = torch.tensor([prompt_ids])  # [1, L]
    with torch.inference_mode():
        first = processed_probs(processors, prompt, model(prompt.to(model.device)).logits[:, -1].cpu(), params)[0]
        vocab = first.numel()
        batch = torch.cat([prompt.repeat(vocab, 1), torch.arange(vocab)[:, None]], dim=1)  # [V, L+1]
        second = processed_probs(processors, batch, model(batch.to(model.device)).logits[:, -1].cpu(), params)
        first[tokenizer.eos_token_id] = 0.0  # a generation that ends at its first token has no second
    return (first / first.sum()) @ second  # [V]


async def penalized_second_token_counts(stack, params: SamplingParams, vocab: int) -> torch.Tensor:
    limit = asyncio.Semaphore(24)

    async def one(seed: int) -> int | None:
        async with limit:
            token_ids, _, _ = await stack.generate(prompt=PROMPT, max_tokens=3, temperature=params.temperature,
                                                   top_k=params.top_k, seed=seed, num_speculative_tokens=2,
                                                   **PENALTIES)
        return token_ids[1] if len(token_ids) > 1 else None
    tokens = [t for t in await asyncio.gather(*(one(seed) for seed in range(SAMPLES))) if t is not None]
    return torch.bincount(torch.tensor(tokens), minlength=vocab).float()


@pytest.mark.parametrize("params", CASES, ids=["dense", "top-k"])
async def test_second_token_follows_penalized_target(tiny_llama_dir, tiny_llama_perturbed_dir, device, params):
    exact = exact_penalized_marginal(str(tiny_llama_dir), device, params)
    unpenalized = exact_second_token_marginal(str(tiny_llama_dir), device, params)
    stack = await start_stack(tiny_llama_dir, tiny_llama_perturbed_dir, k=2, device=device)
    try:
        counts = await penalized_second_token_counts(stack, params, exact.numel())
    finally:
        await stack.stop()
    tv = total_variation(counts, exact)
    assert tv < 2 * expected_sampling_tv(exact, int(counts.sum())), tv
    # The penalties matter: the samples lie outside the noise of sampling the unpenalized distribution.
    assert total_variation(counts, unpenalized) > 2 * expected_sampling_tv(unpenalized, int(counts.sum()))
