"""What a round proposes (orchestrator.decoding.policy). One choice per round among proposers: the draft
model, prompt lookup, the suffix index, or none, by the batch's expected tokens per second, each with its
own learned acceptance. And the draft's own stop: a proposal ends after the first token whose run
probability (the product of the draft's probabilities of the proposal's tokens) falls below the request's
stop_below; the policy sets stop_below from its costs and acceptance, corrected by how well the draft's
probabilities have matched acceptance; and outputs stay the target's exactly, greedy and sampled."""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace
from types import SimpleNamespace

import grpc
import pytest
import torch

from benchmarks.tiny_models import TINY_PROMPTS
from harness import draft_stub, start_stack
from orchestrator.decoding.acceptance import ConfidenceMemory, DraftConfidence
from orchestrator.decoding.costs import BatchLoad, RoundCosts
from orchestrator.decoding.plan import RoundOutcome
from orchestrator.decoding.request import RoundTiming
from orchestrator.decoding.policy import MARGIN, DraftLength, Speculation, suffix_bucket
from orchestrator.decoding.proposals import LOOKUP, SUFFIX, FreeProposal
from parity import PROMPT, exact_second_token_marginal, expected_sampling_tv, target_greedy, total_variation
from policy_costs import cpu_target, plan
from specmesh.engine.distributions import decode_distribution
from specmesh.engine.sampling_params import SamplingParams
from specmesh.engine.step_costs import MEASURED_ROWS, StepCosts
from specmesh.v1 import common_pb2, draft_pb2

TARGET_S, TARGET_ROW_S, DRAFT_S = 0.3, 0.01, 0.05  # a target step, each row more, a draft step (seconds)
REPEAT = list(range(100, 132))  # a 32-token continuation found in an earlier request


def _table(seconds) -> StepCosts:
    return StepCosts({rows: seconds(rows) for rows in MEASURED_ROWS})


def _policy(draft_rate: float = 0.7, suffix_rate: float = 0.5, requests: int = 1, k_max: int = 7):
    """`requests` requests' policies over a target whose rows cost TARGET_ROW_S each and a draft step of
    DRAFT_S; the first has chosen its k for this round."""
    costs = RoundCosts(SimpleNamespace(target=_table(lambda rows: TARGET_S + TARGET_ROW_S * (rows - 1)),
                                       draft=_table(lambda rows: DRAFT_S)))
    shared = Speculation(costs=costs)
    shared.acceptance.prior, shared.suffix.prior = draft_rate, suffix_rate
    policies = [shared.for_request("code") for _ in range(requests)]
    for policy in policies:
        policy.arrive()
    ks = [plan(policy, k_max).k for policy in policies]
    return policies[0], ks[0], shared


def _offered(policy: DraftLength, *offers: FreeProposal) -> FreeProposal | None:
    """The free proposal the policy's next round (k_max 7) verifies out of `offers`, cut to its length."""
    return plan(policy, 7, offers=lambda: list(offers)).free


def _round_s(k: int, rows: int) -> float:
    return k * DRAFT_S + TARGET_S + TARGET_ROW_S * (rows - 1)


@pytest.mark.unit
def test_a_long_repeat_found_in_the_index_beats_the_draft_model():
    policy, k, shared = _policy(suffix_rate=0.95)
    assert k > 0  # the draft pays on its own
    chosen = _offered(policy, FreeProposal(SUFFIX, REPEAT, match_length=40))
    count = len(chosen.tokens)
    assert chosen.source == SUFFIX and count > k
    # Alone, a suffix round runs no draft step: it is priced as the target's step over 1 + count rows.
    acceptance = policy.suffix[suffix_bucket(40)]
    own = policy.acceptance.expected_tokens(k)
    assert policy._free_goodput(shared.rule(), acceptance.expected_tokens(count), own, count, k) == pytest.approx(
        acceptance.expected_tokens(count) / _round_s(0, 1 + count))


@pytest.mark.unit
def test_the_draft_model_keeps_the_round_when_the_index_is_rarely_right():
    policy, k, _ = _policy(suffix_rate=0.1)
    assert k > 0
    assert _offered(policy, FreeProposal(SUFFIX, REPEAT, match_length=4)) is None


@pytest.mark.unit
def test_the_best_of_several_offers_and_how_many_of_its_tokens():
    policy, k, shared = _policy(draft_rate=0.05, suffix_rate=0.9)  # a draft that never pays: k = 0
    shared.lookup.prior = 0.3
    assert k == 0
    offers = [FreeProposal(LOOKUP, REPEAT[:8]), FreeProposal(SUFFIX, REPEAT, match_length=20)]
    chosen = _offered(policy, *offers)
    count = len(chosen.tokens)
    assert chosen.source == SUFFIX
    suffix = policy.suffix[suffix_bucket(20)]
    best = max(range(1, len(REPEAT) + 1), key=lambda m: suffix.expected_tokens(m) / _round_s(0, 1 + m))
    assert count == best
    assert suffix.expected_tokens(count) / _round_s(0, 1 + count) > (1 + MARGIN) * 1.0 / _round_s(0, 1)


@pytest.mark.unit
def test_nothing_to_offer_or_nothing_timed_keeps_the_draft():
    policy, k, _ = _policy()
    assert _offered(policy) is None
    fresh = Speculation().for_request("code")  # no step costs reported, no round timed
    fresh.arrive()
    assert _offered(fresh, FreeProposal(SUFFIX, REPEAT, match_length=40)) is None


@pytest.mark.unit
def test_suffix_acceptance_is_learned_by_match_length_apart_from_the_others():
    policy, k, shared = _policy(suffix_rate=0.9)
    draft_rates, lookup_rates = policy.acceptance.rates(), policy.lookup.rates()
    long_before = policy._acceptance_of(FreeProposal(SUFFIX, REPEAT, match_length=40)).rates()[0]
    short = FreeProposal(SUFFIX, REPEAT[:8], match_length=3)
    for _ in range(20):  # all rejected
        policy.learn(replace(plan(policy, 7), free=short), RoundOutcome(RoundTiming(draft_s=0.0, verify_s=0.3)))
    assert policy._acceptance_of(short).rates()[0] < 0.1
    assert policy._acceptance_of(FreeProposal(SUFFIX, REPEAT, match_length=40)).rates()[0] == pytest.approx(
        long_before)
    assert policy.lookup.rates() == pytest.approx(lookup_rates)
    assert policy.acceptance.rates() == pytest.approx(draft_rates)
    assert _offered(policy, short) is None


@pytest.mark.unit
def test_beside_requests_that_draft_a_suffix_round_still_pays_their_draft_steps():
    policy, k, shared = _policy(suffix_rate=0.95, requests=4)
    assert k > 0
    acceptance = policy._acceptance_of(FreeProposal(SUFFIX, REPEAT, match_length=40))
    rule = shared.rule()
    batch, own = rule.batch, policy.acceptance.expected_tokens(k)
    others = 3 * own  # three requests of its class, without rounds of their own yet
    # 4 sessions: the others' k draft steps, and a target step over their 3 (k + 1) rows and this one's 1 + m.
    assert policy._free_goodput(rule, acceptance.expected_tokens(10), own, 10, k) == pytest.approx(
        (others + acceptance.expected_tokens(10)) / shared.costs.round_s(k, batch, 10 - k))
    assert shared.costs.round_s(k, batch, 10 - k) > shared.costs.round_s(0, batch, 10)


# ---- the draft's own stop: where a proposal ends, how the policy sets it, and outputs that stay the target's


PROMPT_IDS = [5, 6, 7, 8, 9]


async def _propose(stub, request_id: str, num_tokens: int, stop_below: float) -> draft_pb2.ProposeResponse:
    await stub.OpenSession(draft_pb2.DraftOpenRequest(request_id=request_id, prompt_token_ids=PROMPT_IDS), timeout=30)
    return await stub.Propose(draft_pb2.ProposeRequest(request_id=request_id, round=1, position=len(PROMPT_IDS),
                                                       num_tokens=num_tokens, stop_below=stop_below), timeout=30)


def _runs(probabilities) -> list[float]:
    runs, run = [], 1.0
    for probability in probabilities:
        run *= probability
        runs.append(run)
    return runs


async def test_a_proposal_stops_after_the_first_token_whose_run_probability_falls_below(
        tiny_llama_dir, tiny_llama_perturbed_dir, device):
    stack = await start_stack(tiny_llama_dir, tiny_llama_perturbed_dir, k=2, device=device)
    stub = draft_stub(stack)
    try:
        full = await _propose(stub, "full", 8, 0.0)
        assert len(full.token_ids) == len(full.probabilities) == 8  # no stop asked: every token drafted
        assert all(0.0 < p <= 1.0 for p in full.probabilities)
        runs = _runs(full.probabilities)
        cut = 3  # a stop between the third and the fourth token's run probabilities
        stop = math.sqrt(runs[cut - 2] * runs[cut - 1]) if runs[cut - 1] < runs[cut - 2] else runs[cut - 1] * 1.000001
        expected = next(i + 1 for i, run in enumerate(runs) if run < stop)
        stopped = await _propose(stub, "stopped", 8, stop)
        assert 1 <= expected < 8
        assert list(stopped.token_ids) == list(full.token_ids[:expected])  # the doubtful token itself is proposed
        assert stopped.probabilities == pytest.approx(full.probabilities[:expected])
    finally:
        await stack.stop()


async def test_a_sampled_proposal_reports_the_peak_of_each_distribution_it_drew_from(
        tiny_llama_dir, tiny_llama_perturbed_dir, device):
    """When sampling, the draft's confidence at a token is the largest probability of the distribution the
    token was drawn from (not the drawn token's own), so the run probability does not carry the draw's luck."""
    stack = await start_stack(tiny_llama_dir, tiny_llama_perturbed_dir, k=2, device=device)
    stub = draft_stub(stack)
    try:
        await stub.OpenSession(draft_pb2.DraftOpenRequest(
            request_id="sampled", prompt_token_ids=PROMPT_IDS,
            sampling=common_pb2.SamplingParams(temperature=1.0, seed=7)), timeout=30)
        proposal = await stub.Propose(draft_pb2.ProposeRequest(request_id="sampled", round=1, position=len(PROMPT_IDS),
                                                               num_tokens=6), timeout=30)
        vocab = stack.draft_engine.vocab_size
        distributions = [decode_distribution(d, vocab) for d in proposal.distributions]
        assert len(distributions) == len(proposal.token_ids) == len(proposal.probabilities) == 6
        assert proposal.probabilities == pytest.approx([float(q.max()) for q in distributions], rel=1e-5)
        drawn = [float(q[token]) for q, token in zip(distributions, proposal.token_ids)]
        assert any(own < peak * 0.999 for own, peak in zip(drawn, proposal.probabilities))  # some draw was no argmax
    finally:
        await stack.stop()


@pytest.mark.parametrize("stop_below", [-0.1, 1.5, float("nan")])
async def test_a_stop_outside_zero_to_one_is_refused_naming_the_field(tiny_llama_dir, tiny_llama_perturbed_dir,
                                                                      device, stop_below):
    stack = await start_stack(tiny_llama_dir, tiny_llama_perturbed_dir, k=2, device=device)
    stub = draft_stub(stack)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await _propose(stub, "bad", 4, stop_below)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "stop_below" in raised.value.details()
        fine = await stub.Propose(draft_pb2.ProposeRequest(request_id="bad", round=2, position=len(PROMPT_IDS),
                                                           num_tokens=4), timeout=30)
        assert len(fine.token_ids) == 4  # the session and the server carry on
    finally:
        await stack.stop()


def _timed_policy(acceptance_rounds: int = 20) -> tuple[Speculation, DraftLength]:
    """A policy whose costs come from injected round timings (the CPU target's table, a draft step of
    30 ms a token) and whose acceptance from injected outcomes: 3 of 4 accepted a round."""
    shared = Speculation()
    policy = shared.for_request("code")
    for _ in range(acceptance_rounds):
        planned = plan(policy, 7)
        k = planned.k
        policy.learn(planned, RoundOutcome(RoundTiming(draft_s=0.03 * k, verify_s=cpu_target(k + 1)), k, min(k, 3)))
    return shared, policy


@pytest.mark.unit
def test_the_plan_asks_for_k_max_and_stops_where_one_more_token_costs_more_than_it_earns():
    shared, policy = _timed_policy()
    planned = plan(policy, 7)
    k, asked, stop = planned.k, planned.ask, planned.stop_below
    assert 0 < k < 7
    batch = BatchLoad(requests=1)
    per_token_s = (shared.costs.round_s(7, batch) - shared.costs.round_s(1, batch)) / 6
    assert asked == 7
    assert stop == pytest.approx(shared.rule().goodput(k) * per_token_s / policy.confidence.factor)
    assert 0.0 < stop < 1.0
    assert policy._draft_request(shared.rule(), 0, 1.0) == (0, 0.0)  # a target-only round stays one


@pytest.mark.unit
def test_before_any_timed_round_the_plan_is_k_exactly():
    planned = plan(Speculation().for_request(""), 5)
    assert (planned.ask, planned.stop_below) == (planned.k, 0.0)


@pytest.mark.unit
def test_an_overconfident_draft_is_stopped_sooner():
    _, calibrated = _timed_policy()
    _, overconfident = _timed_policy()
    for _ in range(50):  # the draft was sure of 4 tokens a round; the target took 1
        overconfident.confidence.observe([0.99] * 4, accepted=1)
    factor = overconfident.confidence.factor
    assert factor < 0.5
    mine, over = plan(calibrated, 7), plan(overconfident, 7)
    k = mine.k
    assert over.k == k  # same costs and acceptance: only the confidence differs
    (asked, stop), (asked_over, stop_over) = (mine.ask, mine.stop_below), (over.ask, over.stop_below)
    assert asked == 7 and 0 < stop < 1
    assert stop_over == pytest.approx(min(1.0, stop / factor)) or (asked_over, stop_over) == (k, 0.0)
    assert stop_over > stop or asked_over == k  # a higher bar, or no run past k at all


@pytest.mark.unit
def test_sampled_requests_learn_their_confidence_and_acceptance_apart_from_greedy_ones():
    """Under sampling the draft's confidence maps to acceptance otherwise than under greedy: rounds of one
    regime move neither the other's calibration nor, beyond a shared prior, its prompt class's acceptance."""
    shared, greedy = _timed_policy()
    sampled = shared.for_request("code", sampled=True)
    assert sampled.confidence is not greedy.confidence
    assert sampled.confidence.parent is shared.for_request("chat", sampled=True).confidence.parent  # the regime's
    greedy_factor, greedy_expected = greedy.confidence.factor, greedy.acceptance.expected_tokens(4)
    for _ in range(50):  # sampled rounds: the draft's peaks said 0.3 a token, the target took all 4
        sampled.learn(plan(sampled, 7), RoundOutcome(RoundTiming(draft_s=0.12, verify_s=cpu_target(5)), 4, 4,
                                                     probabilities=[0.3] * 4))
    assert sampled.confidence.factor > 2.0
    assert greedy.confidence.factor == greedy_factor
    # only through the deployment-wide prior the two share, which a class's own history outweighs
    moved = shared.for_request("code").acceptance.expected_tokens(4) - greedy_expected
    assert abs(moved) < 0.25 * (shared.for_request("code", sampled=True).acceptance.expected_tokens(4) - greedy_expected)


@pytest.mark.unit
def test_each_prompt_class_learns_its_own_confidence_from_its_regimes():
    """One draft can be overconfident on one kind of text and underconfident on another: a class's factor
    starts at its regime's and follows its own rounds, so its stop bar moves and the other class's stays."""
    shared, code = _timed_policy()
    chat = shared.for_request("chat")
    for _ in range(200):  # chat: the draft said 0.3 a token, the target took all 4
        chat.confidence.observe([0.3] * 4, accepted=4)
    for _ in range(200):  # code: the draft was sure of 4 tokens, the target took 1
        code.confidence.observe([0.99] * 4, accepted=1)
    assert chat.confidence.factor > 2.0 and code.confidence.factor < 0.5
    regime = chat.confidence.parent.factor
    assert code.confidence.factor < regime < chat.confidence.factor  # the regime's pools both
    newcomer = shared.for_request("creative").confidence
    assert newcomer.factor == pytest.approx(regime)  # a class without rounds of its own: its regime's
    assert shared.for_request("chat").confidence is chat.confidence  # kept for the class's next request
    assert shared.for_request("chat", sampled=True).confidence.factor == 1.0  # the sampled regime: untouched


@pytest.mark.unit
def test_confidence_classes_are_bounded():
    memory = ConfidenceMemory(max_classes=3)
    classes = [memory.for_class(name) for name in ("a", "b", "c")]
    memory.for_class("a")  # used again: "b" is now the least recently used
    memory.for_class("d")
    assert list(memory.classes) == ["c", "a", "d"]
    assert memory.for_class("a") is classes[0]


@pytest.mark.unit
def test_draft_confidence_is_the_accepted_count_over_the_drafts_own_expectation():
    confidence = DraftConfidence()
    assert confidence.factor == 1.0  # calibrated until shown otherwise
    for _ in range(2000):
        confidence.observe([0.5, 0.5], accepted=1)  # expected 0.5 + 0.25 = 0.75 a round, 1 accepted
    assert confidence.factor == pytest.approx(1 / 0.75, rel=0.01)
    confidence.observe([], accepted=0)  # a round without draft probabilities tells nothing
    assert confidence.factor == pytest.approx(1 / 0.75, rel=0.01)


@pytest.fixture
def stop_often(monkeypatch):
    """The policy forced to draft every round, asking for k_max tokens with a stop at run probability 0.6:
    the draft's stop is the subject, not the pricing (a tiny draft as costly as its target never pays)."""
    monkeypatch.setattr(DraftLength, "_rule_k", lambda self, rule: self.k_max)
    monkeypatch.setattr(DraftLength, "_worth_opening", lambda self, rule, k, catch_up, tokens_left: k > 0)
    monkeypatch.setattr(DraftLength, "_draft_request",
                        lambda self, rule, k, factor: (self.k_max, 0.6) if k > 0 else (0, 0.0))


async def test_greedy_output_is_the_targets_when_the_draft_stops_on_its_own(
        stop_often, tiny_llama_dir, tiny_llama_perturbed_dir, device):
    stack = await start_stack(tiny_llama_dir, tiny_llama_perturbed_dir, k=6, device=device, adaptive_k=True,
                              loop_options={"prompt_lookup": False, "suffix_index": False})
    try:
        results = await asyncio.gather(*(stack.generate(prompt=p, max_tokens=40, temperature=0.0)
                                         for p in TINY_PROMPTS))
    finally:
        await stack.stop()
    for prompt, (token_ids, _, _) in zip(TINY_PROMPTS, results):
        assert tuple(token_ids) == target_greedy(str(tiny_llama_dir), device, prompt, 40), prompt
    stats = [last.stats for _, _, last in results]
    drafted, rounds = sum(s.draft_tokens for s in stats), sum(s.rounds for s in stats)
    assert 0 < drafted < 5 * rounds  # the draft drafted, and stopped short of k_max in many rounds


async def test_sampled_output_follows_the_target_when_the_draft_stops_on_its_own(
        stop_often, tiny_llama_dir, tiny_llama_perturbed_dir, device):
    params_exact = exact_second_token_marginal(str(tiny_llama_dir), device, SamplingParams(1.0))
    stack = await start_stack(tiny_llama_dir, tiny_llama_perturbed_dir, k=3, device=device, adaptive_k=True,
                              loop_options={"prompt_lookup": False, "suffix_index": False})
    limit = asyncio.Semaphore(24)

    async def generate():
        async with limit:
            return await stack.generate(prompt=PROMPT, max_tokens=4, temperature=1.0)
    try:
        results = await asyncio.gather(*(generate() for _ in range(600)))
    finally:
        await stack.stop()
    tokens = [token_ids[1] for token_ids, _, _ in results if len(token_ids) > 1]
    counts = torch.bincount(torch.tensor(tokens), minlength=params_exact.numel()).float()
    assert total_variation(counts, params_exact) < 2 * expected_sampling_tv(params_exact, len(tokens))
    short = sum(1 for _, _, last in results if 0 < last.stats.draft_tokens < last.stats.rounds * 2)
    assert short > 30  # many first rounds stopped after one of their two draft tokens
