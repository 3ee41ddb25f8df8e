"""Prompt lookup on real services: the output stays the target's own, greedy and sampled.

Greedy through the whole stack as served (calibrated services, the default policy): a
draft priced far too dear to pay, so every round is target-only and lookup is the only
speculation, and target rows priced as if free, so that lookup's always pay (on the tiny
model extra rows beside other sessions cost up to 4x the start-up table's growth, and
learned so, lookup there is a matter of the host's timing). Sampled through the loop with a stand-in policy that verifies everything
lookup finds, on a prompt built so that lookup proposes at the second token for most
first tokens: its empirical distribution must match the target's exact marginal.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from front_door import bad_request_fields
from harness import WORK_TIMEOUT_S, load, make_engine, start_model_server, start_stack
from orchestrator.decoding.proposals import LOOKUP
from orchestrator.decoding.request import LoopConfig
from orchestrator.serving.clients import TargetClient, open_channel
from parity import VerifyAll, assert_second_tokens_follow, exact_two_tokens, sample_first_two, target_greedy
from specmesh.server.metrics import OrchestratorMetrics
from specmesh.engine.sampling_params import SamplingParams
from specmesh.engine.step_costs import MEASURED_ROWS
from specmesh.v1 import target_pb2, target_pb2_grpc
from benchmarks.tiny_models import TINY_PROMPTS


@pytest.mark.parametrize("pipeline", ["off", "on"])
async def test_greedy_output_is_the_targets_own_with_lookup_under_load(tiny_llama_dir, tiny_llama_unrelated_dir,
                                                                      device, pipeline):
    metrics = OrchestratorMetrics()
    # Lookup is consulted every round: target-only rounds of one token (none decoded ahead, which would
    # pass over the tiny target's repeats in stretches of up to 32 tokens).
    stack = await start_stack(tiny_llama_dir, tiny_llama_unrelated_dir, k=4, device=device, adaptive_k=True,
                              calibrate=True, draft_cost_scale=1000.0, pipeline=pipeline, metrics=metrics,
                              target_step_costs={rows: 0.01 for rows in MEASURED_ROWS},
                              loop_options={"decode_ahead": 0})
    try:
        results = await asyncio.gather(*(stack.generate(prompt=p, max_tokens=64, temperature=0.0)
                                         for p in TINY_PROMPTS))
    finally:
        await stack.stop()
    for prompt, (token_ids, _, _) in zip(TINY_PROMPTS, results):
        assert tuple(token_ids) == target_greedy(str(tiny_llama_dir), device, prompt, 64), prompt
    stats = [last.stats for _, _, last in results]
    assert sum(s.draft_tokens for s in stats) == 0  # the draft never paid: lookup was the only speculation
    assert sum(s.lookup_accepted_tokens for s in stats) > 0  # the tiny target repeats itself; lookup found it
    assert all(s.lookup_accepted_tokens <= s.lookup_tokens for s in stats)
    assert sum(s.rounds for s in stats) < sum(len(t) - 1 for t, _, _ in results)  # fewer rounds than tokens
    for series, field in (("specmesh_lookup_tokens_total", "lookup_tokens"),
                          ("specmesh_lookup_accepted_tokens_total", "lookup_accepted_tokens")):
        counted = sum(sample.value for family in metrics.registry.collect() for sample in family.samples
                      if sample.name == series)
        assert counted == sum(getattr(s, field) for s in stats), series


def lookup_prompt(model, prompt_ids: list[int], rounds: int = 3) -> tuple[list[int], dict[int, int]]:
    """prompt_ids + (L v w) for the likeliest first tokens v, ending in L: after a first token v, the
    sequence ends in the 2-gram (L, v), which lookup continues with w (the target's likeliest next
    token, so that lookup is accepted often and rejected often). Built to a fixed point, since the
    triples change the distributions they are chosen from. Returns the ids and {v: w}."""
    last = prompt_ids[-1]
    ids, follows = list(prompt_ids), {}
    with torch.inference_mode():
        for _ in range(rounds):
            first = model(torch.tensor([ids], device=model.device)).logits[0, -1]
            likely = first.argsort(descending=True)[:60].tolist()
            after = torch.cat([torch.tensor(ids).repeat(len(likely), 1), torch.tensor(likely)[:, None]], dim=1)
            follows = dict(zip(likely, model(after.to(model.device)).logits[:, -1].argmax(-1).tolist()))
            ids = list(prompt_ids[:-1]) + [t for v, w in follows.items() for t in (last, v, w)] + [last]
    return ids, follows


async def test_sampled_output_follows_the_target_with_lookup(tiny_llama_dir, device):
    model, tokenizer = load(str(tiny_llama_dir), device)
    prompt_ids, follows = lookup_prompt(model, tokenizer.encode(TINY_PROMPTS[0]))
    params = SamplingParams(1.0)
    first, second = exact_two_tokens(model, prompt_ids, params, tokenizer.eos_token_id)
    outcomes = await sample_first_two(tiny_llama_dir, device, prompt_ids, params, tokenizer.eos_token_id,
                                      VerifyAll(LOOKUP), LoopConfig(num_speculative_tokens=2))
    assert_second_tokens_follow(outcomes, first, second, follows, "lookup")


async def test_an_unknown_draft_source_is_refused_naming_the_field(tiny_llama_dir, device):
    server, port = await start_model_server("target", make_engine(tiny_llama_dir, device, "target"))
    channel = open_channel(f"127.0.0.1:{port}")
    target = TargetClient(channel)
    try:
        await target.open("s", [5, 6, 7], SamplingParams(0.0), timeout=WORK_TIMEOUT_S, max_new_tokens=8)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await target_pb2_grpc.TargetServiceStub(channel).Verify(target_pb2.VerifyRequest(
                request_id="s", round=1, position=4, draft_token_ids=[9], draft_source=7), timeout=WORK_TIMEOUT_S)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert bad_request_fields(raised.value) == ["draft_source"]
        # The session is untouched: the same round verifies as prompt lookup's.
        verified = await target.verify("s", 1, 4, [9], [], timeout=WORK_TIMEOUT_S,
                                       draft_source=target_pb2.DRAFT_SOURCE_PROMPT_LOOKUP)
        assert verified.committed_length == 4 + verified.accepted_count + 1
    finally:
        await server.stop(None)
