"""Log-probabilities are the target's own, exact: equal with speculation on and off, and to log_softmax of logits."""

from __future__ import annotations

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from harness import load, start_stack
from specmesh.v1 import generation_pb2
from benchmarks.tiny_models import TINY_PROMPTS

MAX_TOKENS = 20
TOP = 5


@pytest.fixture
async def llama_stack(tiny_llama_dir, tiny_llama_perturbed_dir, device):
    stack = await start_stack(tiny_llama_dir, tiny_llama_perturbed_dir, k=3, device=device)
    yield stack
    await stack.stop()


async def generate_with_logprobs(stack, **fields) -> tuple[list[int], list, generation_pb2.GenerateResponse]:
    """(token ids, one TokenLogprob per token, last response)."""
    token_ids, logprobs, last = [], [], None
    request = generation_pb2.GenerateRequest(**{"max_tokens": MAX_TOKENS, "logprobs": True, "top_logprobs": TOP,
                                                **fields})
    async for response in stack.stub.Generate(request, timeout=120):
        assert len(response.logprobs) == len(response.token_ids)
        token_ids.extend(response.token_ids)
        logprobs.extend(response.logprobs)
        last = response
    return token_ids, logprobs, last


def direct_logprobs(model_dir: str, device: str, prompt_ids: list[int], generated: list[int],
                    repetition_penalty: float = 1.0) -> torch.Tensor:
    """log_softmax of the model's logits at each generated position, in one forward -> [n, V]."""
    model, _ = load(model_dir, device)
    sequence = torch.tensor([prompt_ids + generated], device=model.device)
    with torch.inference_mode():
        logits = model(sequence).logits[0, len(prompt_ids) - 1:-1].float().cpu()  # [n, V]
    if repetition_penalty != 1.0:
        penalty = RepetitionPenaltyLogitsProcessor(repetition_penalty)
        logits = torch.cat([penalty(sequence[:, :len(prompt_ids) + i].cpu(), logits[i:i + 1])
                            for i in range(len(generated))])
    return torch.log_softmax(logits, dim=-1)


def assert_matches(logprobs: list, token_ids: list[int], expected: torch.Tensor) -> None:
    """Each entry's logprob and top alternatives equal expected [n, V] within fp32 noise."""
    assert len(logprobs) == len(token_ids) == expected.shape[0]
    for row, (entry, token_id) in enumerate(zip(logprobs, token_ids)):
        assert entry.token_id == token_id
        assert abs(entry.logprob - float(expected[row, token_id])) < 1e-5
        top_values, top_ids = torch.topk(expected[row], TOP)
        assert list(entry.top_token_ids) == top_ids.tolist()
        torch.testing.assert_close(torch.tensor(list(entry.top_logprobs)), top_values, rtol=0, atol=1e-5)


@pytest.mark.parametrize("extra", [{}, {"repetition_penalty": 1.5}], ids=["plain", "repetition-penalty"])
async def test_logprobs_equal_with_speculation_on_and_off(llama_stack, tiny_llama_dir, device, extra):
    prompt = TINY_PROMPTS[0]
    on_ids, on_logprobs, on_last = await generate_with_logprobs(llama_stack, prompt=prompt, temperature=0.0,
                                                                 **extra)
    off_ids, off_logprobs, _ = await generate_with_logprobs(llama_stack, prompt=prompt, temperature=0.0,
                                                             speculation=False, **extra)
    assert on_last.stats.accepted_tokens > 0 and on_ids == off_ids
    for on, off in zip(on_logprobs, off_logprobs, strict=True):
        assert on.token_id == off.token_id and abs(on.logprob - off.logprob) < 1e-5
        assert on.top_token_ids == off.top_token_ids
    _, tokenizer = load(str(tiny_llama_dir), device)
    expected = direct_logprobs(str(tiny_llama_dir), device, tokenizer.encode(prompt), on_ids,
                               extra.get("repetition_penalty", 1.0))
    assert_matches(on_logprobs, on_ids, expected)


async def test_sampled_tokens_report_the_models_temperature_one_logprobs(llama_stack, tiny_llama_dir, device):
    prompt = TINY_PROMPTS[2]
    token_ids, logprobs, last = await generate_with_logprobs(llama_stack, prompt=prompt, temperature=0.7, seed=11)
    assert last.stats.draft_tokens > 0
    _, tokenizer = load(str(tiny_llama_dir), device)
    assert_matches(logprobs, token_ids, direct_logprobs(str(tiny_llama_dir), device, tokenizer.encode(prompt),
                                                        token_ids))


async def test_no_logprobs_unless_asked(llama_stack):
    request = generation_pb2.GenerateRequest(prompt=TINY_PROMPTS[0], max_tokens=8, temperature=0.0)
    responses = [r async for r in llama_stack.stub.Generate(request, timeout=60)]
    assert sum(len(r.token_ids) for r in responses) > 0
    assert all(not r.logprobs for r in responses)
    token_ids, logprobs, _ = await generate_with_logprobs(llama_stack, prompt=TINY_PROMPTS[0], temperature=0.0,
                                                          top_logprobs=0)
    assert len(logprobs) == len(token_ids) and all(not entry.top_token_ids for entry in logprobs)


async def test_pipelined_logprobs_are_the_targets(tiny_llama_dir, tiny_llama_perturbed_dir, device):
    """Drafting ahead changes which proposal a round verifies, never the logprobs of what it commits."""
    stack = await start_stack(tiny_llama_dir, tiny_llama_perturbed_dir, k=3, device=device, pipeline="on",
                              extra_branches=2)
    try:
        token_ids, logprobs, last = await generate_with_logprobs(stack, prompt=TINY_PROMPTS[1], temperature=0.0,
                                                                 frequency_penalty=0.5)
    finally:
        await stack.stop()
    assert last.stats.accepted_tokens > 0
    _, tokenizer = load(str(tiny_llama_dir), device)
    prompt_ids = tokenizer.encode(TINY_PROMPTS[1])
    expected = direct_logprobs(str(tiny_llama_dir), device, prompt_ids, token_ids)
    penalized = expected.clone()  # log_softmax shifts by a constant per row: subtract the penalty, renormalise
    for row in range(len(token_ids)):
        counts = torch.bincount(torch.tensor(token_ids[:row], dtype=torch.long), minlength=expected.shape[1])
        penalized[row] = torch.log_softmax(expected[row] - 0.5 * counts[:expected.shape[1]], dim=-1)
    assert not torch.allclose(penalized, expected), "the output must repeat tokens for the penalty to show"
    assert_matches(logprobs, token_ids, penalized)
