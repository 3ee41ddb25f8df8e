"""Alternatives: the draft's second choices verified beside its tokens, as a tree of rows (greedy only).

An alternative row must see exactly what its draft would have seen, so its logits are those of a
fresh prefill of the sequence with the alternative in the draft's place; a verification that
commits an alternative and the token after it leaves both caches as a fresh prefill would, and
the output stays the target's own greedy sequence.
"""

from __future__ import annotations

import asyncio
import functools
import random
from typing import Callable

import grpc
import pytest
import torch

from draft_service.engine import CommitSpec, DraftEngine
from engine_helpers import commit_alone, feed_uncached, next_logits_cached, next_logits_fresh
from harness import GRAPH_STEPS, make_engine, start_stack
from orchestrator.decoding.plan import RoundOutcome
from orchestrator.decoding.policy import Speculation
from orchestrator.decoding.request import RoundTiming
from parity import MAX_TOKENS, target_greedy
from policy_costs import plan, speculation
from specmesh.engine.batching import Part
from specmesh.errors import InvalidArgument
from specmesh.engine.ragged import tree_ancestry
from specmesh.engine.sampling_params import SamplingParams
from specmesh.v1 import target_pb2
from target_service.alternatives import Alternative, taken_alternative, tree_parents
from target_service.engine import TargetEngine
from benchmarks.tiny_models import TINY_PROMPTS

GREEDY = SamplingParams(0.0)


def test_the_alternative_committed_is_the_one_at_the_rejection_with_the_targets_token_and_never_after_eos():
    alternatives = [Alternative(0, 50), Alternative(2, 70), Alternative(3, 80)]
    assert taken_alternative(alternatives, 2, 70, eos_token_ids={2}) == 1
    assert taken_alternative(alternatives, 2, 71, eos_token_ids={2}) is None  # the target chose another token
    assert taken_alternative(alternatives, 1, 70, eos_token_ids={2}) is None  # none at the rejected position
    assert taken_alternative(alternatives, 2, 70, eos_token_ids={70}) is None  # nothing follows an end


def test_a_tree_row_sees_its_ancestors_and_sits_at_its_depth():
    # tail of 1, drafts a b c (rows 1-3), an alternative for draft index 1 (row 4: after row 1)
    parents = tree_parents(1, 3, [Alternative(1, 99)])
    assert parents == (-1, 0, 1, 2, 1)
    sees, depths = tree_ancestry(parents)
    assert depths == [0, 1, 2, 3, 2]
    assert sees[4].tolist() == [True, True, False, False, True]  # not the draft it stands in for, nor after
    assert sees[3].tolist() == [True, True, True, True, False]
    with pytest.raises(ValueError):
        tree_ancestry((-1, 1))  # a parent must come earlier


@pytest.mark.parametrize("batched", [False, True], ids=["alone", "beside-another-session"])
def test_an_alternative_row_has_the_logits_of_a_sequence_with_it_in_the_drafts_place(tiny_llama_dir, device,
                                                                                       batched):
    engine = make_engine(tiny_llama_dir, device)
    prompt, drafts, alternative = [5, 17, 29, 41], [60, 61, 62], 99
    session = engine.new_session("a", prompt, GREEDY)
    session_b = engine.new_session("b", [7, 8, 9], GREEDY)
    feed_uncached(engine, session_b)  # b's cache: all three
    # a's whole sequence is uncached: the prompt's rows are the chain's start, the alternative after row 4
    tokens = prompt + drafts + [alternative]
    parents = tuple(range(-1, len(prompt) + len(drafts) - 1)) + (len(prompt),)
    part = Part(session, tokens, keep_rows=len(drafts) + 2, parents=parents)
    parts = [part, Part(session_b, [10, 11], keep_rows=2)] if batched else [part]
    logits = engine._run_step(parts)[0]
    rows_a = logits[0]  # [k + 2, V]: after the prompt, after each draft, after the alternative
    for row, prefix in enumerate([prompt, prompt + drafts[:1], prompt + drafts[:2], prompt + drafts]):
        assert torch.allclose(rows_a[row], next_logits_fresh(engine, prefix), atol=1e-4), row
    assert torch.allclose(rows_a[-1], next_logits_fresh(engine, prompt + drafts[:1] + [alternative]), atol=1e-4)
    if batched:
        assert torch.allclose(logits[1][-1], next_logits_fresh(engine, [7, 8, 9, 10, 11]), atol=1e-4)


def _reference(engine, sequence: list[int], length: int) -> list[int]:
    """The target's greedy sequence, extended to `length` tokens."""
    while len(sequence) < length:
        sequence.append(int(next_logits_fresh(engine, sequence).argmax()))
    return sequence


@pytest.mark.parametrize("row_multiple, kv", [(1, {}), (4, {}), (1, GRAPH_STEPS)],
                         ids=["unpadded", "rows-padded-to-4", "graph-steps-ignore-them"])
@pytest.mark.parametrize("seed", range(3))
async def test_committed_alternatives_keep_the_output_and_the_caches_exact(tiny_llama_dir, tiny_llama_perturbed_dir,
                                                                          device, seed, row_multiple, kv):
    rng = random.Random(seed)
    target = TargetEngine(make_engine(tiny_llama_dir, device, row_multiple=row_multiple, **kv))
    draft = DraftEngine(make_engine(tiny_llama_perturbed_dir, device, role_name="draft", row_multiple=row_multiple,
                                    **kv))
    prompt = [rng.randrange(3, 300) for _ in range(rng.randrange(1, 12))]
    opened = await target.open("r", prompt, GREEDY)
    await draft.open("r", prompt, GREEDY)
    sequence, agreed, taken = prompt + [opened.token_id], len(prompt), 0
    reference = list(sequence)
    for round_number in range(1, 12):
        proposal = await draft.propose("r", round_number, CommitSpec(agreed, tuple(sequence[agreed:])),
                                       len(sequence), rng.randrange(1, 7))
        assert len(proposal.alternative_token_ids) == len(proposal.token_ids)
        truth = _reference(target.engine, reference, len(sequence) + len(proposal.token_ids) + 2)[len(sequence):]
        alternatives = _alternatives(rng, proposal, truth)
        result = await target.verify("r", round_number, len(sequence), proposal.token_ids, [],
                                     alternatives=alternatives)
        accepted = result.verdict.accepted_count
        agreed = len(sequence) + accepted
        sequence += proposal.token_ids[:accepted] + [result.verdict.next_token_id] + result.after
        taken += bool(result.after)
        assert result.committed_length == len(sequence)
        assert sequence == reference[:len(sequence)]
    await commit_alone(draft, "r", 99, CommitSpec(agreed, tuple(sequence[agreed:])))
    for engine in (target.engine, draft.engine):
        assert engine.get("r").token_ids == sequence
        assert torch.allclose(next_logits_cached(engine, "r"), next_logits_fresh(engine, sequence), atol=1e-4)
    if kv:  # static graph steps' slots are not cropped like a DynamicCache: the drafts are verified alone
        assert not target.engine.verifies_trees and taken == 0
    else:
        assert taken > 0


def _alternatives(rng: random.Random, proposal, truth: list[int]) -> list[target_pb2.DraftAlternative]:
    """At each position, mostly: the target's own token where the draft's is wrong (so that some are
    committed), else the draft's second choice; some positions get none."""
    alternatives = []
    for index, token in enumerate(proposal.token_ids):
        choice = truth[index] if token != truth[index] and rng.random() < 0.7 else proposal.alternative_token_ids[index]
        if rng.random() < 0.8 and choice != token:
            alternatives.append(target_pb2.DraftAlternative(index=index, token_id=choice))
    rng.shuffle(alternatives)  # any order: the target sorts them by position
    return alternatives


@pytest.mark.parametrize("sampling, alternatives, message", [
    (SamplingParams(1.0, seed=1), [(0, 50)], "greedy"),
    (SamplingParams(0.0, repetition_penalty=1.3), [(0, 50)], "penalties"),
    (GREEDY, [(2, 50)], "past the 2 draft tokens"),
    (GREEDY, [(0, 50), (0, 51)], "twice"),
    (GREEDY, [(1, 61)], "draft token itself"),
    (GREEDY, [(0, 10**6)], ""),
], ids=["sampled", "penalized", "index-past-drafts", "index-twice", "same-as-draft", "id-outside-vocab"])
async def test_unsound_alternatives_are_refused_naming_the_field_and_the_session_goes_on(
        tiny_llama_dir, device, sampling, alternatives, message):
    target = TargetEngine(make_engine(tiny_llama_dir, device))
    opened = await target.open("r", [5, 6, 7], sampling)
    with pytest.raises(InvalidArgument) as refused:
        await target.verify("r", 1, 4, [60, 61], [], alternatives=[
            target_pb2.DraftAlternative(index=i, token_id=t) for i, t in alternatives])
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "alternatives" in str(refused.value) and message in str(refused.value)
    result = await target.verify("r", 1, 4, [60, 61], [])
    assert result.committed_length == 4 + result.verdict.accepted_count + 1
    assert target.engine.get("r").token_ids[:4] == [5, 6, 7, opened.token_id]


FLAT_TARGET = {rows: 0.01 for rows in (1, 2, 4, 8, 16, 32, 64)}  # extra rows free: every alternative is worth one
ALTERNATIVES_SEEN = 150  # alternatives verified before their acceptance is judged (about 1 in 10 accepted)


@pytest.mark.parametrize("target_name, draft_name", [("tiny_llama_dir", "tiny_llama_perturbed_dir"),
                                                     ("tiny_qwen2_dir", "tiny_qwen2_draft_dir")])
async def test_served_greedy_output_is_the_targets_own_with_alternatives_committed(request, device, target_name,
                                                                                 draft_name):
    target_dir = str(request.getfixturevalue(target_name))
    # Target-only rounds of one token, priced as before decoding ahead: the draft and its target are the same
    # tiny size, and target-only rounds that decode ahead would win over drafting, the subject here. No suffix
    # index: the passes below repeat the prompts, and it would draft the repeats.
    stack = await start_stack(target_dir, request.getfixturevalue(draft_name), k=4, device=device, adaptive_k=True,
                              calibrate=True, target_step_costs=FLAT_TARGET,
                              loop_options={"decode_ahead": 0, "suffix_index": False})
    # Passes over the prompts, all at once (trees meet other sessions' rows in steps), until ALTERNATIVES_SEEN
    # alternatives were verified: how many a pass offers depends on the rule's timings (fewer on a loaded
    # host), and about one in ten is accepted, so that none accepted is a failure, not bad luck.
    stats, passes = [], 0
    try:
        while sum(s.alternative_tokens for s in stats) < ALTERNATIVES_SEEN and passes < 10:
            results = await asyncio.gather(*(stack.generate(prompt=p, max_tokens=MAX_TOKENS, temperature=0.0)
                                             for p in TINY_PROMPTS))
            for prompt, (token_ids, _, last) in zip(TINY_PROMPTS, results):
                assert tuple(token_ids) == target_greedy(target_dir, device, prompt, MAX_TOKENS), prompt
                assert last.stats.alternative_accepted_tokens <= last.stats.alternative_tokens
            stats += [last.stats for _, _, last in results]
            passes += 1
    finally:
        await stack.stop()
    assert sum(s.alternative_tokens for s in stats) > 0
    assert sum(s.alternative_accepted_tokens for s in stats) > 0
    rounds, committed = sum(s.rounds for s in stats), sum(s.completion_tokens - 1 for s in stats)
    accepted = sum(s.accepted_tokens + s.lookup_accepted_tokens + s.suffix_accepted_tokens
                   + s.alternative_accepted_tokens for s in stats)
    assert committed <= rounds + accepted  # each round: its accepted tokens, one of the target's, one per alternative


def _offering(target_costs) -> Callable[[list[float], list[float]], list[int]]:
    """The alternatives a request's next round offers, priced by reports (a draft step of 50 ms), having
    seen 3 of 4 drafts accepted."""
    shared = speculation(target_costs, lambda rows: 0.05)
    policy = shared.for_request("code")
    for _ in range(20):
        planned = plan(policy, 4)
        k = planned.k
        policy.learn(planned, RoundOutcome(RoundTiming(draft_s=0.05 * k, verify_s=target_costs(k + 1)), k, min(k, 3)))
    assert policy.confidence.factor == 1.0
    return functools.partial(plan(policy, 4).alternatives, policy.costs)


def test_alternatives_are_offered_by_chance_while_one_is_worth_its_row():
    probabilities, alternatives = [0.9, 0.8, 0.6, 0.5], [0.05, 0.15, 0.3, 0.4]
    # chances (factor 1): 0.05, 0.135, 0.216, 0.173; a row here costs 5 ms until the step at 9 rows
    stepped = _offering(lambda rows: 0.30 + 0.005 * rows if rows <= 8 else 0.50)
    assert stepped(probabilities, alternatives) == [2, 3, 1]  # a 9th row costs more than 0.05 earns
    assert _offering(lambda rows: 0.30)(probabilities, alternatives) == [2, 3, 1, 0]  # rows free
    dear = _offering(lambda rows: 0.30 + 0.05 * rows)  # 50 ms a row: only a likely alternative pays
    assert dear(probabilities, alternatives) == []
    assert dear([0.99, 0.95], [0.01, 0.6]) == [1]
    assert stepped(probabilities, []) == []  # sampled: the draft sends none


def test_before_any_round_is_priced_no_alternative_is_offered():
    policy = Speculation().for_request("")
    assert plan(policy, 4).alternatives(policy.costs, [0.5], [0.5]) == []
