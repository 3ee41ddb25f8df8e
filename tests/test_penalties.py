"""Penalties and logit biases: greedy parity with transformers' own logits processors.

Both speculative output (draft and target applying the penalties, the target over
the draft tokens it verifies) and the target's own `generate` with the matching
logits processors must give the same tokens. Values are exact in float32, so the
wire's float32 fields carry them unchanged.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from draft_service.server import create_server as create_draft_server
from harness import load, make_engine, start_stack
from orchestrator.decoding.loop import SpeculativeGeneration
from orchestrator.decoding.request import GenerationRequest, LoopConfig
from orchestrator.serving.clients import DraftClient, open_channel
from orchestrator.serving.failover import PooledTargetClient
from parity import reference_processors
from pools import Replicas
from specmesh.engine.penalties import penalize_logits
from specmesh.engine.sampling_params import SamplingParams
from benchmarks.tiny_models import TINY_PROMPTS

MAX_TOKENS = 24


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


@settings(max_examples=60, deadline=None)
@given(history=st.lists(st.integers(0, 39), min_size=1, max_size=12),
       drafts=st.lists(st.integers(0, 39), max_size=5),
       repetition=st.sampled_from([1.0, 0.5, 1.7]), presence=st.floats(-2, 2), frequency=st.floats(-2, 2),
       bias=st.dictionaries(st.integers(0, 45), st.floats(-100, 100), max_size=3), data=st.data())
def test_verification_rows_see_the_draft_tokens_before_them(history, drafts, repetition, presence, frequency,
                                                            bias, data):
    """Row j of a verification equals the single-row penalty after history + draft[:j]."""
    output_start = data.draw(st.integers(0, len(history)))
    logits = torch.randn(len(drafts) + 1, 40, generator=torch.Generator().manual_seed(len(history)))  # [k+1, V]
    params = SamplingParams(repetition_penalty=repetition, presence_penalty=presence, frequency_penalty=frequency,
                            logit_bias=tuple(bias.items()))  # ids >= 40: a larger model's, dropped here
    rows = penalize_logits(logits, history, output_start, params, drafts)  # [k+1, V]
    for j in range(len(drafts) + 1):
        alone = penalize_logits(logits[j:j + 1], history + drafts[:j], output_start, params)
        torch.testing.assert_close(rows[j:j + 1], alone, rtol=0, atol=0)


def test_no_penalties_leave_logits_untouched():
    logits = torch.randn(2, 10)
    assert penalize_logits(logits, [1, 2], 1, SamplingParams(repetition_penalty=1.0)) is logits


@pytest.mark.parametrize("fields", [ALL_PENALTIES, {"frequency_penalty": -1.0}, {"presence_penalty": 2.0}])
async def test_a_resumed_target_session_keeps_penalties_and_logprobs(tiny_llama_dir, tiny_llama_perturbed_dir,
                                                                     fields):
    """After failover the new replica counts only the generated tokens as output (output_start)."""
    targets = await Replicas.start("target", tiny_llama_dir, 2)
    target = PooledTargetClient(targets.pool)
    draft_server, draft_port, _ = await create_draft_server(make_engine(tiny_llama_perturbed_dir, role_name="draft"))
    _, tokenizer = load(str(tiny_llama_dir), "cpu")
    sampling = replace(checked_sampling(fields, len(tokenizer.encode(TINY_PROMPTS[0]))), logprobs=0)
    request = GenerationRequest(request_id="r", prompt_token_ids=tokenizer.encode(TINY_PROMPTS[0]),
                                max_tokens=MAX_TOKENS, sampling=sampling, stop=[], num_speculative_tokens=2)
    gen = SpeculativeGeneration(request, target, DraftClient(open_channel(f"127.0.0.1:{draft_port}")),
                                {tokenizer.eos_token_id}, LoopConfig(num_speculative_tokens=2))
    tokens = []
    try:
        async for batch in gen.tokens():
            tokens.extend(batch)
            if gen.stats.rounds == 2 and not target.failovers:
                await targets.stop(target.sessions[gen.session_id].replica.name)
    finally:
        await targets.stop_all()
        await targets.pool.stop()
        await draft_server.stop(None)
    assert target.failovers == 1
    assert tokens == target_greedy_with(str(tiny_llama_dir), "cpu", TINY_PROMPTS[0], fields)
    assert [entry.token_id for entry in gen.logprobs] == tokens


def checked_sampling(fields: dict, prompt_length: int) -> SamplingParams:
    """Greedy sampling params carrying `fields` as the orchestrator's validation builds them."""
    return SamplingParams(temperature=0.0, output_start=prompt_length,
                          logit_bias=tuple(fields.get("logit_bias", {}).items()),
                          **{k: v for k, v in fields.items() if k != "logit_bias"})
