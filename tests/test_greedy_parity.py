"""Greedy speculative output equals the target's own `generate`, token for token."""

from __future__ import annotations

import math

import pytest

from harness import start_stack
from benchmarks.tiny_models import TINY_PROMPTS
from parity import MAX_TOKENS, greedy_outputs_then_stop, target_greedy

CASES = [  # (target fixture, draft fixture, how the draft relates to the target)
    ("tiny_llama_dir", "tiny_llama_dir", "identical"),
    ("tiny_llama_dir", "tiny_llama_perturbed_dir", "partial"),
    ("tiny_llama_dir", "tiny_llama_unrelated_dir", "unrelated"),
    ("tiny_qwen2_dir", "tiny_qwen2_draft_dir", "partial"),
]


@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("target_name, draft_name, relation", CASES)
async def test_greedy_parity(request, device, k, target_name, draft_name, relation):
    target_dir = str(request.getfixturevalue(target_name))
    stack = await start_stack(target_dir, request.getfixturevalue(draft_name), k=k, device=device)
    results = await greedy_outputs_then_stop(stack)
    drafted = accepted = 0
    for prompt, (token_ids, _, last) in zip(TINY_PROMPTS, results):
        assert tuple(token_ids) == target_greedy(target_dir, device, prompt, MAX_TOKENS), prompt
        assert not last.stats.draft_fallback
        drafted += last.stats.draft_tokens
        accepted += last.stats.accepted_tokens
        if relation == "identical":
            assert last.stats.acceptance_rate == 1.0
            # k drafted + 1 bonus per round; only the last round may be shorter
            assert last.stats.rounds == math.ceil((len(token_ids) - 1) / (k + 1))
    if relation == "partial":  # the rate falls with k: late positions need every earlier one accepted
        assert 0 < accepted < drafted and (k > 2 or accepted / drafted > 0.2)
    if relation == "unrelated":
        assert accepted / drafted < 0.3


@pytest.mark.parametrize("k", [2, 5])
@pytest.mark.parametrize("target_name, draft_name, relation", CASES[1:])
async def test_greedy_parity_on_onednn_kernels(request, device, k, target_name, draft_name, relation):
    """Both services on oneDNN's linear (specmesh.loading.cpu_linear): still the target's own `generate`
    (torch's kernels), token for token."""
    if device != "cpu":
        pytest.skip("oneDNN linear is a CPU kernel")
    target_dir = str(request.getfixturevalue(target_name))
    stack = await start_stack(target_dir, request.getfixturevalue(draft_name), k=k, device=device,
                              cpu_linear="onednn")
    assert type(stack.target_engine.model.get_output_embeddings()).__name__ == "OneDnnLinear"
    results = await greedy_outputs_then_stop(stack)
    for prompt, (token_ids, _, last) in zip(TINY_PROMPTS, results):
        assert tuple(token_ids) == target_greedy(target_dir, device, prompt, MAX_TOKENS), prompt
        assert last.stats.draft_tokens > 0
