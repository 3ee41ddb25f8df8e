"""Target-only rounds that decode ahead (VerifyRequest.decode_ahead): the same tokens, draws and logprobs as
one step a call, the KV cache a fresh prefill's, stops at EOS; the rule that sizes them; served over a link."""

from __future__ import annotations

import math

import grpc
import pytest
import torch

from benchmarks.links import DelayLine, LinkSpec
from engine_helpers import next_logits_cached, next_logits_fresh
from harness import load, make_engine, start_model_server, start_stack
from orchestrator.decoding.costs import BatchLoad, RoundCosts
from orchestrator.decoding.decode_ahead import AHEAD_SHARE
from orchestrator.decoding.loop import SpeculativeGeneration
from orchestrator.decoding.plan import FixedLength, RoundAsk, RoundPlan
from orchestrator.decoding.request import GenerationRequest, LoopConfig
from orchestrator.decoding.suffix_index import SuffixIndex
from orchestrator.serving.clients import TargetClient, open_channel
from parity import target_greedy
from specmesh.errors import InvalidArgument
from specmesh.roles import MAX_DECODE_AHEAD
from specmesh.engine.sampling_params import SamplingParams
from specmesh.v1 import target_pb2, target_pb2_grpc
from target_service.engine import TargetEngine

PROMPT_IDS = [5, 17, 42, 9, 88, 23]
SAMPLINGS = {
    "greedy": SamplingParams(0.0, logprobs=2),
    "seeded": SamplingParams(1.0, seed=11, logprobs=2),
    "penalized": SamplingParams(0.8, seed=3, repetition_penalty=1.3),
}


async def _decode(target: TargetEngine, sampling: SamplingParams, calls: list[int]) -> tuple[list[int], list]:
    """Open a session, then one target-only Verify per entry of `calls`, each decoding that many ahead."""
    opened = await target.open("r", PROMPT_IDS, sampling)
    tokens, logprobs = [opened.token_id], [opened.logprob] if opened.logprob is not None else []
    for round_number, ahead in enumerate(calls, start=1):
        result = await target.verify("r", round_number, len(PROMPT_IDS) + len(tokens), [], [], decode_ahead=ahead)
        tokens += [result.verdict.next_token_id, *result.after]
        logprobs += result.logprobs
        assert result.committed_length == len(PROMPT_IDS) + len(tokens)
    return tokens, logprobs


@pytest.mark.parametrize("name", sorted(SAMPLINGS))
async def test_decoding_ahead_gives_the_tokens_of_one_step_a_call(tiny_llama_dir, device, name):
    sampling = SAMPLINGS[name]
    one_by_one = TargetEngine(make_engine(tiny_llama_dir, device))
    ahead = TargetEngine(make_engine(tiny_llama_dir, device))
    expected, expected_logprobs = await _decode(one_by_one, sampling, [0] * 20)
    tokens, logprobs = await _decode(ahead, sampling, [4, 0, 7, 5])  # 5 + 1 + 8 + 6 = 20 tokens after the first
    assert tokens == expected
    assert [(p.token_id, round(p.logprob, 4)) for p in logprobs] == [
        (p.token_id, round(p.logprob, 4)) for p in expected_logprobs]
    assert len(logprobs) == (len(tokens) if sampling.logprobs is not None else 0)
    session = ahead.engine.get("r")
    assert session.token_ids == PROMPT_IDS + tokens
    assert session.cached_length == len(session.token_ids) - 1  # all but the newest token, as after any round
    assert torch.allclose(next_logits_cached(ahead.engine, "r"), next_logits_fresh(ahead.engine, session.token_ids),
                          atol=1e-4)


async def test_decoding_ahead_stops_after_an_eos_token(tiny_llama_dir, device):
    expected, _ = await _decode(TargetEngine(make_engine(tiny_llama_dir, device)), SAMPLINGS["greedy"], [0] * 10)
    target = TargetEngine(make_engine(tiny_llama_dir, device))
    eos = expected[4]
    target.engine.eos_token_ids = [eos]  # as if the model's EOS were the fifth token it makes
    await target.open("r", PROMPT_IDS, SAMPLINGS["greedy"])
    result = await target.verify("r", 1, len(PROMPT_IDS) + 1, [], [], decode_ahead=9)
    committed = [result.verdict.next_token_id, *result.after]
    assert committed == expected[1: expected.index(eos) + 1]


@pytest.mark.parametrize("drafts, alternatives, ahead", [
    ([7], [], 2), ([], [], MAX_DECODE_AHEAD + 1),
], ids=["with-draft-tokens", "too-many"])
async def test_decode_ahead_refused_where_it_does_not_apply(tiny_llama_dir, device, drafts, alternatives, ahead):
    target = TargetEngine(make_engine(tiny_llama_dir, device))
    await target.open("r", PROMPT_IDS, SAMPLINGS["greedy"])
    with pytest.raises(InvalidArgument, match="decode_ahead"):
        await target.verify("r", 1, len(PROMPT_IDS) + 1, drafts, [], alternatives=alternatives, decode_ahead=ahead)
    result = await target.verify("r", 1, len(PROMPT_IDS) + 1, [], [], decode_ahead=1)  # the session is untouched
    assert result.committed_length == len(PROMPT_IDS) + 3


async def test_a_bad_decode_ahead_is_invalid_argument_over_grpc(tiny_llama_dir, device):
    server, port = await start_model_server("target", make_engine(tiny_llama_dir, device))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = target_pb2_grpc.TargetServiceStub(channel)
            await stub.OpenSession(target_pb2.TargetOpenRequest(request_id="r", prompt_token_ids=PROMPT_IDS),
                                   timeout=30)
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await stub.Verify(target_pb2.VerifyRequest(request_id="r", round=1, position=len(PROMPT_IDS) + 1,
                                                           decode_ahead=MAX_DECODE_AHEAD + 1), timeout=30)
            assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "decode_ahead" in raised.value.details()
            served = await stub.Verify(target_pb2.VerifyRequest(request_id="r", round=1, position=len(PROMPT_IDS) + 1,
                                                                decode_ahead=3), timeout=30)
            assert len(served.after_token_ids) == 3 and served.committed_length == len(PROMPT_IDS) + 5
    finally:
        await server.stop(None)


def test_the_rule_asks_for_as_many_tokens_as_keep_the_call_a_tenth_of_the_steps():
    rule = RoundCosts()
    assert rule.tokens_ahead(BatchLoad(), 100) == 0  # nothing measured yet: one token a call
    rule.observe(0, 0.0, 0.010, BatchLoad(), verify_forward_s=0.006)  # a 4 ms call around a 6 ms step
    per_call = rule.tokens_ahead(BatchLoad(), 100) + 1
    assert per_call == 7 and 0.004 / per_call <= AHEAD_SHARE * 0.006 < 0.004 / (per_call - 1)
    assert rule.tokens_ahead(BatchLoad(), 3) == 3  # no more than the request may still make
    for _ in range(8):
        rule.observe(0, 0.0, 0.0062, BatchLoad(), verify_forward_s=0.006)
    assert rule.tokens_ahead(BatchLoad(), 100) == 0  # a cheap call (beside the target): tokens stream one by one
    capped = RoundCosts(decode_ahead=2)
    capped.observe(0, 0.0, 0.030, BatchLoad(), verify_forward_s=0.006)
    assert capped.tokens_ahead(BatchLoad(), 100) == 2
    unbunched = RoundCosts(decode_ahead=0)
    unbunched.observe(0, 0.0, 0.030, BatchLoad(), verify_forward_s=0.006)
    assert unbunched.tokens_ahead(BatchLoad(), 100) == 0


def test_the_rule_reads_the_latency_of_drafting_rounds_too():
    costs = RoundCosts()
    costs.observe(3, 0.020, 0.010, BatchLoad(), verify_forward_s=0.006)  # no target-only round seen yet
    assert costs.tokens_ahead(BatchLoad(), 100) > 0  # the call's latency is the same whatever the round drafted


def test_a_round_that_decoded_ahead_is_priced_as_one_step():
    costs = RoundCosts()
    costs.observe(0, 0.0, 0.050, BatchLoad(), verify_forward_s=0.040, target_steps=5)
    assert costs.target_latency.value == pytest.approx(0.010)  # the call's latency, once
    assert costs.wall_by_k[0].value == pytest.approx(0.018)  # its latency and one step of 8 ms
    assert costs.undrafted_s == pytest.approx(0.050)  # the time spent target-only is the whole round's


def test_the_steps_of_a_call_that_decoded_ahead_are_not_taken_for_the_calls_latency():
    """A service's own work around each step (3 ms here) grows with the steps a call decodes ahead. Taken as
    the call's latency it would price a one-step drafting round with all of it, and ask for ever more tokens
    ahead (a longer latency asks for more, which shows a longer one)."""
    costs = RoundCosts()
    costs.observe(0, 0.0, 0.010, BatchLoad(), verify_forward_s=0.006)  # one step: a 4 ms call around a 6 ms step
    for _ in range(40):
        per_call = costs.tokens_ahead(BatchLoad(), 100) + 1
        costs.observe(0, 0.0, 0.010 + (per_call - 1) * 0.009, BatchLoad(), verify_forward_s=0.006 * per_call,
                      target_steps=per_call)
    assert costs.target_latency.value == pytest.approx(0.004)
    assert costs.target_step_overhead.value == pytest.approx(0.003)
    per_call = costs.tokens_ahead(BatchLoad(), 100) + 1
    assert per_call == math.ceil(0.004 / (AHEAD_SHARE * 0.009)) < MAX_DECODE_AHEAD
    assert costs.target_only_s(BatchLoad()) == pytest.approx((0.010 + (per_call - 1) * 0.009) / per_call)
    assert costs.round_s(0, BatchLoad()) == pytest.approx(0.010)  # a drafting round's Verify: one step, one call


def test_the_policy_prices_a_target_only_round_as_the_rule_decodes_it():
    for most, per_call in ((MAX_DECODE_AHEAD, 7), (0, 1)):
        costs = RoundCosts(decode_ahead=most)
        costs.observe(0, 0.0, 0.010, BatchLoad(), verify_forward_s=0.006)  # a 4 ms call around a 6 ms step
        assert costs.target_only_s(BatchLoad()) == pytest.approx(0.006 + 0.004 / per_call)
        assert costs.round_s(0, BatchLoad()) == pytest.approx(0.010)  # one Verify of one token


async def test_served_target_only_over_a_link_decodes_ahead_with_the_targets_own_output(tiny_llama_dir, device):
    stack = await start_stack(tiny_llama_dir, None, device=device, link=LinkSpec(rtt_ms=10.0))
    try:
        for prompt, max_tokens in (("The quick brown fox", 24), ("def add(a, b):", 9)):
            tokens, _, last = await stack.generate(prompt=prompt, max_tokens=max_tokens, temperature=0.0)
            assert tuple(tokens) == target_greedy(str(tiny_llama_dir), device, prompt, max_tokens)
            # a 10 ms round trip around a step of a few ms: the rule asks for tokens ahead (one pass: the prefill)
            assert last.stats.target_forward_passes > last.stats.rounds + 1
    finally:
        await stack.stop()


async def test_served_seeded_sampling_is_the_same_with_and_without_decoding_ahead(tiny_llama_dir, device):
    outputs = []
    for options, link in (({"decode_ahead": 0}, None), ({}, LinkSpec(rtt_ms=10.0))):
        stack = await start_stack(tiny_llama_dir, None, device=device, loop_options=options, link=link)
        try:
            tokens, _, last = await stack.generate(prompt="The quick brown fox", max_tokens=24, temperature=1.0,
                                                   seed=5)
            outputs.append((tokens, last.stats.target_forward_passes > last.stats.rounds + 1))
        finally:
            await stack.stop()
    (one_by_one, ahead_then), (decoded_ahead, ahead_now) = outputs
    assert not ahead_then and ahead_now
    assert decoded_ahead == one_by_one


class PassesUpOffers(FixedLength):
    """Target-only rounds that look at the free proposals on offer and verify none, as the default policy plans
    where none is worth its rows: pricing is not the subject here, what the loop sends then is."""

    def __init__(self):
        super().__init__(RoundCosts())
        self.offered = self.rounds = 0

    def plan(self, ask: RoundAsk) -> RoundPlan:
        self.rounds += 1
        self.offered += bool(ask.offers())
        return RoundPlan(batch=BatchLoad(1, ask.context))


async def test_a_round_that_passes_up_a_free_proposal_still_decodes_ahead(tiny_llama_dir, device):
    """A repeated request finds its earlier answer on offer every round; where the plan verifies none of it, the
    round is target-only like any other, and across a link it decodes ahead, with the target's own output."""
    prompt, max_tokens = "The quick brown fox", 24
    expected = target_greedy(str(tiny_llama_dir), device, prompt, max_tokens)
    tokenizer = load(str(tiny_llama_dir), device)[1]
    prompt_ids = tokenizer.encode(prompt)
    history = SuffixIndex()
    history.open().extend(prompt_ids + list(expected))  # the earlier answer: proposed at every position
    server, port = await start_model_server("target", make_engine(tiny_llama_dir, device, "target"))
    link = await DelayLine(("127.0.0.1", port), LinkSpec(rtt_ms=10.0), name="target").start()
    try:
        policy = PassesUpOffers()
        generation = SpeculativeGeneration(
            GenerationRequest(request_id="again", prompt_token_ids=prompt_ids, max_tokens=max_tokens,
                              sampling=SamplingParams(0.0), stop=[], num_speculative_tokens=4),
            TargetClient(open_channel(f"127.0.0.1:{link.port}")), None, {tokenizer.eos_token_id}, LoopConfig(num_speculative_tokens=4),
            policy=policy, history=history)
        tokens = [token for batch in [batch async for batch in generation.tokens()] for token in batch]
    finally:
        await link.stop()
        await server.stop(None)
    assert tuple(tokens) == expected
    # the answer was on offer at every round (but a last one of one token, which has none to propose) ...
    assert policy.offered >= policy.rounds - 1 and policy.offered >= 1
    stats = generation.stats
    assert stats.suffix_tokens == 0 and stats.target_forward_passes > stats.rounds + 1  # ... and rounds decoded ahead
