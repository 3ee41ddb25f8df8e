"""After any sequence of propose / verify / commit, both KV caches equal a fresh prefill."""

from __future__ import annotations

import random

import pytest
import torch

from draft_service.engine import CommitSpec, DraftEngine
from engine_helpers import commit_alone, feed_uncached, next_logits_cached, next_logits_fresh
from harness import GRAPH_STEPS, make_engine
from specmesh.engine.commit import committed_sequence, committed_tokens
from specmesh.engine.sampling_params import SamplingParams
from target_service.engine import TargetEngine

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("row_multiple, kv", [(1, {}), (4, {}), (1, GRAPH_STEPS)],
                         ids=["unpadded", "rows-padded-to-4", "graph-steps-over-kv-slots"])
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("temperature", [0.0, 1.0])
async def test_caches_match_fresh_prefill(tiny_llama_dir, tiny_llama_perturbed_dir, device, seed, temperature,
                                          row_multiple, kv):
    rng = random.Random(seed)
    target = TargetEngine(make_engine(tiny_llama_dir, device, row_multiple=row_multiple, **kv))
    draft = DraftEngine(make_engine(tiny_llama_perturbed_dir, device, role_name="draft", row_multiple=row_multiple,
                                    **kv))
    sampling = SamplingParams(temperature, seed=seed)
    prompt = [rng.randrange(3, 300) for _ in range(rng.randrange(1, 12))]
    opened = await target.open("r", prompt, sampling)
    await draft.open("r", prompt, sampling)
    sequence, agreed = prompt + [opened.token_id], len(prompt)
    for round_number in range(1, 12):
        commit = CommitSpec(agreed, tuple(sequence[agreed:]))
        if rng.random() < 0.3:  # a stand-alone commit, then a proposal without one
            await commit_alone(draft, "r", round_number, commit)
            commit = None
        proposal = await draft.propose("r", round_number, commit, len(sequence), rng.randrange(1, 7))
        result = await target.verify("r", round_number, len(sequence), proposal.token_ids,
                                     proposal.distributions)
        accepted = result.verdict.accepted_count
        agreed = len(sequence) + accepted
        sequence += proposal.token_ids[:accepted] + [result.verdict.next_token_id]
        assert result.committed_length == len(sequence)
    await commit_alone(draft, "r", 99, CommitSpec(agreed, tuple(sequence[agreed:])))
    for engine in (target.engine, draft.engine):
        assert engine.get("r").token_ids == sequence
        assert torch.allclose(next_logits_cached(engine, "r"), next_logits_fresh(engine, sequence), atol=1e-4)


async def test_rollback_to_earlier_position(tiny_llama_dir, device):
    engine = make_engine(tiny_llama_dir, device, row_multiple=4)
    session = engine.new_session("r", [5, 6, 7, 8, 9, 10], SamplingParams(0.0))
    feed_uncached(engine, session)  # caches all six
    engine.rollback(session, 3, [42, 43])
    assert session.token_ids == [5, 6, 7, 42, 43]
    assert session.cached_length == 3  # positions below 3 kept, the newest token never cached
    assert torch.allclose(feed_uncached(engine, session)[0][-1], next_logits_fresh(engine, [5, 6, 7, 42, 43]),
                          atol=1e-4)


async def test_rollback_keeps_the_accepted_drafts_cached(tiny_llama_dir, device):
    """A verification cached its drafts 8, 9, 10 after [5, 6, 7]; two were accepted, then 42 recovered:
    the next forward feeds 42 alone, and its logits are a fresh run's."""
    engine = make_engine(tiny_llama_dir, device)
    session = engine.new_session("r", [5, 6, 7, 8, 9, 10], SamplingParams(0.0))
    feed_uncached(engine, session)
    engine.rollback(session, 3, [8, 9, 42], cached=2)
    assert session.token_ids == [5, 6, 7, 8, 9, 42]
    assert session.cached_length == 5 and session.uncached_tail == [42]
    assert torch.allclose(feed_uncached(engine, session)[0][-1], next_logits_fresh(engine, [5, 6, 7, 8, 9, 42]),
                          atol=1e-4)


async def test_padded_forward_equals_unpadded(tiny_llama_dir, device):
    padded, plain = make_engine(tiny_llama_dir, device, row_multiple=4), make_engine(tiny_llama_dir, device)
    sessions = [engine.new_session("r", [5, 6, 7], SamplingParams(0.0)) for engine in (padded, plain)]
    steps = [([8, 9], None), ([10], None), ([11, 12, 13, 14, 15], None),  # 2 -> 4 rows, 1 row, 5 -> 8 rows
             ([16, 17, 18], 2), ([19, 20, 21, 22, 23, 24], 1), ([25, 26], 2)]  # and only the last rows' logits
    for new_tokens, keep in steps:
        (padded_logits, _), (plain_logits, _) = (padded.forward(sessions[0], new_tokens, keep),
                                                 plain.forward(sessions[1], new_tokens))
        plain_logits = plain_logits[-(keep or len(new_tokens)):]
        assert padded_logits.shape == plain_logits.shape == (keep or len(new_tokens), padded.vocab_size)
        assert torch.allclose(padded_logits, plain_logits, atol=1e-4)
        assert sessions[0].cached_length == sessions[1].cached_length


@pytest.mark.parametrize("drafts, accepted, next_token, after, expected", [
    ([7, 8, 9], 1, 5, [], [7, 5]),  # rejected at the second draft: the recovered token follows the accepted one
    ([7, 8, 9], 3, 4, [], [7, 8, 9, 4]),  # all accepted: the bonus token
    ([], 0, 6, [1, 2], [6, 1, 2]),  # target-only, two tokens decoded ahead
    ([7, 8], 0, 3, [11], [3, 11]),  # an alternative taken at the first draft, and its follower
], ids=["recovered", "bonus", "decoded-ahead", "alternative"])
def test_the_commit_rule(drafts, accepted, next_token, after, expected):
    committed = committed_tokens(drafts, accepted, next_token, after)
    assert committed == expected
    sequence = [1, 2, 3, 70, 80]  # two draft tokens past the committed length 3, left by an earlier proposal
    assert committed_sequence(sequence, 3, committed) == [1, 2, 3, *expected]
    assert sequence == [1, 2, 3, 70, 80]  # the argument is left as it was
