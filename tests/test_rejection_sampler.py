"""The rejection sampler: exact greedy cases, guards, seeded determinism, and statistics."""

from __future__ import annotations

import pytest
import torch

from specmesh.engine.sampling_params import SamplingParams
from specmesh.engine.sampling import logits_to_probs, make_generator, sample_token
from target_service.rejection_sampler import verify_greedy, verify_sampled


def one_hot_logits(argmaxes: list[int], vocab: int = 6) -> torch.Tensor:
    logits = torch.zeros(len(argmaxes), vocab)  # [k+1, V]
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 5.0
    return logits


@pytest.mark.unit
@pytest.mark.parametrize("target_argmax, draft, accepted, next_token, bonus", [
    ([3, 1, 4], [3, 1], 2, 4, True),  # all accepted: bonus from the last row
    ([3, 1, 4], [3, 2], 1, 1, False),  # rejected at 1: recovered = target argmax there
    ([3, 1, 4], [0, 1], 0, 3, False),  # rejected at 0, later matches do not count
    ([5], [], 0, 5, True),  # no draft: a plain decode step
    ([2, 2, 2, 2, 2], [2, 2, 2, 2], 4, 2, True),
])
def test_greedy_exact(target_argmax, draft, accepted, next_token, bonus):
    verdict = verify_greedy(one_hot_logits(target_argmax), torch.tensor(draft, dtype=torch.long))
    assert (verdict.accepted_count, verdict.next_token_id, verdict.bonus) == (accepted, next_token, bonus)


@pytest.mark.unit
def test_certain_target_always_accepts_point_masses():
    target = torch.zeros(3, 5)  # [k+1, V]
    target[0, 2] = target[1, 4] = target[2, 0] = 1.0
    for seed in range(20):
        verdict = verify_sampled(target, torch.tensor([2, 4]), None, make_generator(seed))
        assert (verdict.accepted_count, verdict.next_token_id, verdict.bonus) == (2, 0, True)


@pytest.mark.unit
def test_impossible_draft_token_is_never_accepted_nor_recovered():
    target = torch.full((2, 4), 0.25)
    target[0] = torch.tensor([0.5, 0.5, 0.0, 0.0])  # the draft proposes token 2, p = 0
    for seed in range(50):
        verdict = verify_sampled(target, torch.tensor([2]), None, make_generator(seed))
        assert verdict.accepted_count == 0 and verdict.next_token_id in (0, 1)


@pytest.mark.unit
def test_zero_draft_probability_is_never_accepted():
    target = torch.full((2, 4), 0.25)
    draft_probs = torch.tensor([[0.0, 0.5, 0.5, 0.0]])  # q(token 0) = 0: guarded, not divided by
    for seed in range(50):
        verdict = verify_sampled(target, torch.tensor([0]), draft_probs, make_generator(seed))
        assert verdict.accepted_count == 0


def test_sampled_token_frequencies_follow_the_distribution_and_skip_zeros():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.3, 0.0])  # unnormalised is fine: scaled below
    generator, draws = make_generator(0), 20_000
    counts = torch.bincount(torch.tensor([sample_token(probs * 3.0, generator) for _ in range(draws)]),
                            minlength=probs.numel())
    assert counts[probs == 0].sum() == 0
    # 5 standard deviations of a binomial count at most 0.5 x 0.5 x draws
    assert torch.all((counts / draws - probs).abs() <= 5 * (0.25 / draws) ** 0.5)


@pytest.mark.unit
def test_a_token_with_all_the_mass_is_drawn_whatever_the_seed():
    probs = torch.zeros(151_936)
    probs[-1] = 1e-30  # alone, however small, and last: the draw's upper edge
    assert {sample_token(probs, make_generator(seed)) for seed in range(50)} == {151_935}


@pytest.mark.unit
def test_seeded_draws_are_reproducible():
    probs = torch.softmax(torch.randn(1000, generator=torch.Generator().manual_seed(2)), -1)
    runs = [[sample_token(probs, make_generator(seed)) for seed in range(40)] for _ in range(2)]
    assert runs[0] == runs[1] and len(set(runs[0])) > 10


@pytest.mark.unit
def test_seeded_verification_is_reproducible():
    target = torch.softmax(torch.randn(5, 10, generator=torch.Generator().manual_seed(0)), -1)
    draft = torch.softmax(torch.randn(4, 10, generator=torch.Generator().manual_seed(1)), -1)
    ids = torch.tensor([1, 2, 3, 4])
    runs = [[verify_sampled(target, ids, draft, make_generator(seed)) for seed in range(30)] for _ in range(2)]
    assert runs[0] == runs[1]
    assert len({(v.accepted_count, v.next_token_id) for v in runs[0]}) > 1


def output_marginals(target_probs, draft_probs, draft_point_mass, samples, seed):
    """Empirical distribution of each output position of one round, over many rounds.

    The target here is context-free (row j is the distribution at position j
    whatever came before), so position j of the output must be distributed as
    target_probs[j] whenever a round reaches it.
    """
    k_plus_1, vocab = target_probs.shape
    counts = torch.zeros(k_plus_1, vocab)
    generator = make_generator(seed)
    for _ in range(samples):
        draft_ids = torch.multinomial(draft_probs, 1, generator=generator).flatten()  # [k]
        verdict = verify_sampled(target_probs, draft_ids, None if draft_point_mass else draft_probs, generator)
        output = draft_ids[: verdict.accepted_count].tolist() + [verdict.next_token_id]
        counts[torch.arange(len(output)), torch.tensor(output)] += 1
    return counts


def total_variation(counts: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    empirical = counts / counts.sum(-1, keepdim=True).clamp(min=1)
    return 0.5 * (empirical - probs).abs().sum(-1)  # [k+1]


def expected_sampling_tv(counts: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """E[TV(empirical, probs)] for n draws from probs: 0.5 * sum_v sqrt(2 p (1 - p) / (pi n))."""
    n = counts.sum(-1).clamp(min=1)  # [k+1]
    return 0.5 * torch.sqrt(2 * probs * (1 - probs) / torch.pi).sum(-1) / torch.sqrt(n)


SETTINGS = [SamplingParams(1.0), SamplingParams(0.7, top_k=4), SamplingParams(1.3, top_p=0.8),
            SamplingParams(0.9, top_k=5, top_p=0.9)]


@pytest.mark.parametrize("params", SETTINGS, ids=str)
@pytest.mark.parametrize("draft_point_mass", [False, True], ids=["with-probs", "ids-only"])
def test_output_matches_target_distribution(params, draft_point_mass):
    k, vocab = 3, 8
    logits = torch.randn(k + 1, vocab, generator=torch.Generator().manual_seed(7)) * 1.5
    target_probs = logits_to_probs(logits, params)  # [k+1, V]
    draft_logits = logits[:k] + torch.randn(k, vocab, generator=torch.Generator().manual_seed(8))
    draft_probs = logits_to_probs(draft_logits, params)  # [k, V]: a different, overlapping q
    few_counts = output_marginals(target_probs, draft_probs, draft_point_mass, 150, 1)
    many_counts = output_marginals(target_probs, draft_probs, draft_point_mass, 4000, 2)
    few, many = total_variation(few_counts, target_probs), total_variation(many_counts, target_probs)
    # Within sampling noise of the target distribution at every position ...
    assert (many < 2.5 * expected_sampling_tv(many_counts, target_probs)).all(), many
    # ... shrinking like 1/sqrt(N) (27x the samples: ~5x closer) ...
    assert many[0] < few[0] / 2.5
    # ... while far from other distributions, however many samples.
    references = torch.softmax(torch.randn(5, k + 1, vocab, generator=torch.Generator().manual_seed(9)), -1)
    to_references = torch.stack([total_variation(many_counts, ref) for ref in references])  # [5, k+1]
    assert (to_references.min(0).values > 3 * many).all()
