"""Penalties and logit biases: greedy parity with transformers' own logits processors.

Both speculative output (draft and target applying the penalties, the target over
the draft tokens it verifies) and the target's own `generate` with the matching
logits processors must give the same tokens. Values are exact in float32, so the
wire's float32 fields carry them unchanged.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (LogitsProcessor, LogitsProcessorList, RepetitionPenaltyLogitsProcessor,
                          SequenceBiasLogitsProcessor)

from harness import load, start_stack
from specmesh.penalties import penalize_logits
from specmesh.sampling import SamplingParams
from tiny_models import TINY_PROMPTS

MAX_TOKENS = 24


class OpenAIPenalties(LogitsProcessor):
    """Reference for OpenAI's presence/frequency penalties: counts over the generated tokens only."""

    def __init__(self, prompt_length: int, presence: float, frequency: float):
        self.prompt_length, self.presence, self.frequency = prompt_length, presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        counts = torch.zeros_like(scores)  # [1, V]
        for token_id in input_ids[0, self.prompt_length:].tolist():
            counts[0, token_id] += 1
        return scores - self.frequency * counts - self.presence * (counts > 0)


def reference_processors(fields: dict, prompt_length: int) -> LogitsProcessorList:
    processors = []
    if "repetition_penalty" in fields:
        processors.append(RepetitionPenaltyLogitsProcessor(fields["repetition_penalty"]))
    if "presence_penalty" in fields or "frequency_penalty" in fields:
        processors.append(OpenAIPenalties(prompt_length, fields.get("presence_penalty", 0.0),
                                          fields.get("frequency_penalty", 0.0)))
    if "logit_bias" in fields:
        processors.append(SequenceBiasLogitsProcessor([[[t], b] for t, b in fields["logit_bias"].items()]))
    return LogitsProcessorList(processors)


def target_greedy_with(model_dir: str, device: str, prompt: str, fields: dict) -> list[int]:
    model, tokenizer = load(model_dir, device)
    prompt_ids = tokenizer.encode(prompt)
    with torch.inference_mode():
        output = model.generate(torch.tensor([prompt_ids], device=model.device), max_new_tokens=MAX_TOKENS,
                                do_sample=False, pad_token_id=tokenizer.pad_token_id,
                                logits_processor=reference_processors(fields, len(prompt_ids)))
    generated = output[0, len(prompt_ids):].tolist()
    eos = tokenizer.eos_token_id
    return generated[: generated.index(eos) + 1] if eos in generated else generated


def frequent_tokens(model_dir: str, device: str) -> dict[int, float]:
    """A bias that bans the target's most common greedy tokens and lifts a rare one: output must change."""
    plain = target_greedy_with(model_dir, device, TINY_PROMPTS[0], {})
    common = max(set(plain), key=plain.count)
    return {common: -100.0, 7: 2.5}


CASES = {
    "repetition": {"repetition_penalty": 1.5},
    "repetition-below-one": {"repetition_penalty": 0.75},
    "presence-frequency": {"presence_penalty": 0.5, "frequency_penalty": 1.25},
    "negative-frequency": {"frequency_penalty": -1.0},
    "logit-bias": None,  # built from the model's own output
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("k", [1, 4])
async def test_greedy_parity_with_transformers_processors(tiny_llama_dir, tiny_llama_perturbed_dir, device,
                                                          case, k):
    fields = CASES[case] or {"logit_bias": frequent_tokens(str(tiny_llama_dir), device)}
    stack = await start_stack(tiny_llama_dir, tiny_llama_perturbed_dir, k=k, device=device)
    changed = 0
    try:
        for prompt in TINY_PROMPTS[:3]:
            expected = target_greedy_with(str(tiny_llama_dir), device, prompt, fields)
            changed += expected != target_greedy_with(str(tiny_llama_dir), device, prompt, {})
            token_ids, _, last = await stack.generate(prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                                                      **fields)
            assert token_ids == expected, (case, prompt)
            assert last.stats.draft_tokens > 0
    finally:
        await stack.stop()
    assert changed, "the penalty must change the output, or parity proves nothing"


ALL_PENALTIES = {"repetition_penalty": 1.5, "presence_penalty": 0.5, "frequency_penalty": 1.25,
                 "logit_bias": {5: 4.0}}


@pytest.mark.parametrize("extra_branches", [0, 3])
async def test_pipelined_greedy_parity_with_penalties(tiny_llama_dir, tiny_llama_perturbed_dir, device,
                                                      extra_branches):
    """Pre-drafted branches (the draft's guesses after assumed tokens) keep the output exact."""
    stack = await start_stack(tiny_llama_dir, tiny_llama_perturbed_dir, k=3, device=device, pipeline="on",
                              extra_branches=extra_branches)
    try:
        for prompt in TINY_PROMPTS[:3]:
            token_ids, _, _ = await stack.generate(prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                                                   **ALL_PENALTIES)
            assert token_ids == target_greedy_with(str(tiny_llama_dir), device, prompt, ALL_PENALTIES), prompt
    finally:
        await stack.stop()


async def test_draft_applies_the_same_penalties(tiny_llama_dir, device):
    """A draft identical to the target proposes exactly the target's tokens, penalties included."""
    fields = ALL_PENALTIES
    stack = await start_stack(tiny_llama_dir, tiny_llama_dir, k=4, device=device)
    try:
        token_ids, _, last = await stack.generate(prompt=TINY_PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0.0,
                                                  **fields)
    finally:
        await stack.stop()
    assert token_ids == target_greedy_with(str(tiny_llama_dir), device, TINY_PROMPTS[1], fields)
    assert last.stats.draft_tokens > 0 and last.stats.acceptance_rate == 1.0


def test_verification_rows_see_the_draft_tokens_before_them():
    """Row j of a verification equals the single-row penalty after history + draft[:j]."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=generator)  # [k+1, V]
    history, drafts = [3, 9, 9, 4, 3], [4, 11, 4]
    params = SamplingParams(repetition_penalty=1.7, presence_penalty=0.3, frequency_penalty=0.9,
                            logit_bias=((11, -2.0), (49, 1.0)))
    rows = penalize_logits(logits, history, 2, params, drafts)  # [4, V]
    for j in range(4):
        alone = penalize_logits(logits[j:j + 1], history + drafts[:j], 2, params)
        torch.testing.assert_close(rows[j:j + 1], alone, rtol=0, atol=0)
    assert not torch.equal(rows[3], penalize_logits(logits[3:], history, 2, params)[0])


def test_no_penalties_leave_logits_untouched():
    logits = torch.randn(2, 10)
    assert penalize_logits(logits, [1, 2], 1, SamplingParams(repetition_penalty=1.0)) is logits
