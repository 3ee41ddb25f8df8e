"""Suffix drafting on real services: repeats are proposed from earlier requests, and the output stays the target's.

Greedy through the whole stack as served (calibrated services, the default policy), with
target rows priced as if free: beside a draft far too dear to pay (sequential and
pipelined), and beside a cheap one, whose session must catch up after suffix rounds. A second pass over the same
prompts finds the first pass's outputs in the suffix index. Sampled through the loop
with a stand-in policy that verifies every suffix proposal, over a history built so the
index proposes a second token after most first tokens: the second token's empirical
distribution must match the target's exact marginal.
"""

from __future__ import annotations

import asyncio

import pytest

from harness import load, start_stack
from orchestrator.decoding.request import LoopConfig
from orchestrator.decoding.proposals import SUFFIX
from orchestrator.decoding.suffix_index import SuffixIndex
from parity import VerifyAll, assert_second_tokens_follow, exact_two_tokens, sample_first_two, target_greedy
from specmesh.server.metrics import OrchestratorMetrics
from specmesh.engine.sampling_params import SamplingParams
from specmesh.engine.step_costs import MEASURED_ROWS
from benchmarks.tiny_models import TINY_PROMPTS

MAX_TOKENS = 48


def _metric(metrics: OrchestratorMetrics, series: str, **labels) -> float:
    return sum(sample.value for family in metrics.registry.collect() for sample in family.samples
               if sample.name == series and all(sample.labels.get(k) == v for k, v in labels.items()))


@pytest.mark.parametrize("pipeline, draft_cost_scale", [("off", 1000.0), ("on", 1000.0), ("off", 0.01)],
                         ids=["no-draft", "no-draft-pipelined", "beside-a-cheap-draft"])
async def test_a_repeated_request_is_proposed_from_the_first_and_stays_the_targets_own(
        tiny_llama_dir, tiny_llama_perturbed_dir, device, pipeline, draft_cost_scale):
    metrics = OrchestratorMetrics()
    stack = await start_stack(tiny_llama_dir, tiny_llama_perturbed_dir, k=4, device=device, adaptive_k=True,
                              calibrate=True, draft_cost_scale=draft_cost_scale, metrics=metrics, pipeline=pipeline,
                              # suffix proposals alone; target-only rounds of one token, so that a cheap draft
                              # pays whatever a call costs on this host (decoding ahead amortises it: then not)
                              loop_options={"prompt_lookup": False, "decode_ahead": 0},
                              target_step_costs={rows: 0.01 for rows in MEASURED_ROWS})
    try:
        first = await asyncio.gather(*(stack.generate(prompt=p, max_tokens=MAX_TOKENS, temperature=0.0)
                                       for p in TINY_PROMPTS))
        again = [await stack.generate(prompt=p, max_tokens=MAX_TOKENS, temperature=0.0) for p in TINY_PROMPTS]
    finally:
        await stack.stop()
    for prompt, (tokens, _, _), (repeated, _, _) in zip(TINY_PROMPTS, first, again):
        expected = target_greedy(str(tiny_llama_dir), device, prompt, MAX_TOKENS)
        assert tuple(tokens) == expected and tuple(repeated) == expected, prompt
    stats = [last.stats for _, _, last in again]
    assert sum(s.lookup_tokens for s in stats) == 0
    if draft_cost_scale < 1:  # the draft paid on the first pass, and its session caught up after suffix rounds
        assert sum(last.stats.draft_tokens for _, _, last in first) > 0
    # Each repeat's continuation was in the index: most of its tokens came from it, in few rounds.
    assert sum(s.suffix_accepted_tokens for s in stats) > 0.5 * sum(s.completion_tokens for s in stats), stats
    assert all(s.suffix_accepted_tokens <= s.suffix_tokens for s in stats)
    assert sum(s.rounds for s in stats) < sum(s.completion_tokens for s in stats) / 3
    rounds = sum(s.rounds for _, _, last in first + again for s in [last.stats])
    assert _metric(metrics, "specmesh_proposer_rounds_total") == rounds
    suffixed = sum(s.suffix_accepted_tokens for _, _, last in first + again for s in [last.stats])
    assert _metric(metrics, "specmesh_proposer_accepted_tokens_total", proposer=SUFFIX) == suffixed


class FixedHistory:
    """The earlier requests only: the sampled requests' own sequences go elsewhere, so every proposal
    after (prompt v) is w."""

    def __init__(self):
        self.index, self.scratch = SuffixIndex(), SuffixIndex()

    def open(self, prompt=()):
        return self.scratch.open(prompt)

    def renamed_twin(self, document):
        return None

    def propose(self, sequence, limit):
        return self.index.propose(sequence, limit)


async def test_sampled_output_follows_the_target_with_suffix_proposals(tiny_llama_dir, device):
    model, tokenizer = load(str(tiny_llama_dir), device)
    prompt_ids = tokenizer.encode(TINY_PROMPTS[0])
    params = SamplingParams(1.0)
    first, second = exact_two_tokens(model, prompt_ids, params, tokenizer.eos_token_id)
    # Earlier requests said the prompt, then one of the likeliest first tokens v, then w, the target's
    # likeliest token after it: the index continues (prompt v) with w, often accepted and often rejected.
    follows = {v: int(second[v].argmax()) for v in first.argsort(descending=True)[:60].tolist()}
    history = FixedHistory()
    for v, w in follows.items():
        history.index.open().extend(list(prompt_ids) + [v, w])
    outcomes = await sample_first_two(tiny_llama_dir, device, prompt_ids, params, tokenizer.eos_token_id,
                                      VerifyAll(SUFFIX), LoopConfig(num_speculative_tokens=2, prompt_lookup=False),
                                      history)
    assert_second_tokens_follow(outcomes, first, second, follows, SUFFIX)
