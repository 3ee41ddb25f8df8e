"""The cost-aware adaptive draft length: its choices, and that it never changes the output."""

from __future__ import annotations

import asyncio
import random
import time

import torch

from harness import start_stack
from orchestrator.decoding.loop import RoundTiming
from orchestrator.decoding.policy import AdaptiveSpeculation, PolicyConfig, expected_tokens
from test_greedy_parity import target_greedy
from test_sampling_parity import PROMPT, exact_second_token_marginal, expected_sampling_tv, total_variation
from specmesh.sampling import SamplingParams
from specmesh.v1 import generation_pb2
from tiny_models import TINY_PROMPTS

K_MAX = 6


def run_rounds(policy, rounds: int, draft_per_token_s: float, verify_s, acceptance: float, rng: random.Random):
    """Feed the policy simulated rounds; return the k it chose in each."""
    chosen = []
    for _ in range(rounds):
        k = policy.choose(K_MAX)
        accepted = next((j for j in range(k) if rng.random() >= acceptance), k)
        policy.observe(RoundTiming(draft_s=k * draft_per_token_s, verify_s=verify_s(k + 1)), k, accepted)
        chosen.append(k)
    return chosen


def cpu_like_verify(rows: int) -> float:
    """Our 2-core CPUs: 1 row 0.46 s, 2-3 rows one weight pass each, 4-8 rows about two."""
    return {1: 0.46, 2: 0.97, 3: 1.45}.get(rows, 0.9 + 0.01 * rows)


def test_expected_tokens():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 5) == 6.0
    assert abs(expected_tokens(0.5, 2) - 1.75) < 1e-9


def test_useless_draft_goes_to_zero_and_comes_back_when_useful():
    policy = AdaptiveSpeculation().for_request("code")
    rng = random.Random(0)
    useless = run_rounds(policy, 20, 0.09, cpu_like_verify, acceptance=0.0, rng=rng)
    assert useless[0] == K_MAX and useless[-8:].count(0) >= 7  # probes aside, target-only
    useful = run_rounds(policy, 60, 0.09, cpu_like_verify, acceptance=0.9, rng=rng)
    assert all(k >= 4 for k in useful[-20:]), useful


def test_slow_draft_goes_to_zero_and_fast_draft_comes_back():
    policy = AdaptiveSpeculation().for_request("")
    rng = random.Random(1)
    slow = run_rounds(policy, 20, 2.0, cpu_like_verify, acceptance=0.9, rng=rng)
    assert slow[-8:].count(0) >= 7
    fast = run_rounds(policy, 60, 0.05, cpu_like_verify, acceptance=0.9, rng=rng)
    assert all(k > 0 for k in fast[-20:])


def test_picks_the_cheap_verification_shape():
    """Where 3 verified rows cost more than 4 (MKL's shape cliff), k = 2 is never kept."""
    policy = AdaptiveSpeculation().for_request("")
    chosen = run_rounds(policy, 80, 0.09, cpu_like_verify, acceptance=0.8, rng=random.Random(2))
    assert chosen[-30:].count(2) == 0 and min(chosen[-30:]) >= 3


def test_hysteresis_does_not_flap_near_break_even():
    """Costs jitter by 10% around a point where two draft lengths tie: k changes rarely."""
    policy = AdaptiveSpeculation(config=PolicyConfig()).for_request("")
    rng = random.Random(3)
    chosen = [policy.choose(K_MAX)]
    for _ in range(300):
        k = chosen[-1]
        jitter = 1 + rng.uniform(-0.1, 0.1)
        accepted = next((j for j in range(k) if rng.random() >= 0.7), k)
        policy.observe(RoundTiming(draft_s=k * 0.05 * jitter, verify_s=(0.5 + 0.05 * (k + 1)) * jitter), k,
                       accepted)
        chosen.append(policy.choose(K_MAX))
    switches = sum(a != b for a, b in zip(chosen, chosen[1:]))
    assert switches <= 12, (switches, chosen)


async def test_useless_draft_serves_target_only_with_identical_output(tiny_llama_dir, tiny_llama_unrelated_dir,
                                                                      device):
    stack = await start_stack(tiny_llama_dir, tiny_llama_unrelated_dir, k=4, device=device, adaptive_k=True)
    try:
        token_ids, _, last = await stack.generate(prompt=TINY_PROMPTS[0], max_tokens=64, temperature=0.0)
    finally:
        await stack.stop()
    assert tuple(token_ids) == target_greedy(str(tiny_llama_dir), device, TINY_PROMPTS[0], 64)
    assert last.stats.rounds > 40 and last.stats.draft_tokens < last.stats.rounds  # mostly target-only rounds


async def test_busy_draft_turns_speculation_off_then_back_on(tiny_llama_dir, device):
    """Another tenant occupies the draft's worker: k drops to 0; once it leaves, probes bring k back."""
    stack = await start_stack(tiny_llama_dir, tiny_llama_dir, k=4, device=device, adaptive_k=True)
    busy = True

    async def noisy_neighbour():
        while busy:
            await stack.draft_engine.run(time.sleep, 0.2)

    neighbour = asyncio.ensure_future(noisy_neighbour())
    token_ids, rounds, switched_at, max_tokens = [], [], None, 220
    try:
        request = generation_pb2.GenerateRequest(prompt=TINY_PROMPTS[1], max_tokens=max_tokens, temperature=0.0)
        async for response in stack.stub.Generate(request, timeout=120):
            token_ids.extend(response.token_ids)
            rounds.append(len(response.token_ids))  # identical draft: a round with k drafts commits k + 1
            if switched_at is None and rounds[-6:] == [1] * 6:  # target-only for 6 rounds: the tenant leaves
                busy, switched_at = False, len(rounds)
    finally:
        busy = False
        await neighbour
        await stack.stop()
    assert tuple(token_ids) == target_greedy(str(tiny_llama_dir), device, TINY_PROMPTS[1], max_tokens)
    assert switched_at is not None, rounds
    assert max(rounds[switched_at:]) > 1 and rounds[-2] > 1, rounds


async def test_greedy_parity_with_adaptive_k(tiny_llama_dir, tiny_llama_perturbed_dir, device):
    stack = await start_stack(tiny_llama_dir, tiny_llama_perturbed_dir, k=5, device=device, adaptive_k=True)
    try:
        results = await asyncio.gather(*(stack.generate(prompt=p, max_tokens=48, temperature=0.0)
                                         for p in TINY_PROMPTS))
    finally:
        await stack.stop()
    for prompt, (token_ids, _, _) in zip(TINY_PROMPTS, results):
        assert tuple(token_ids) == target_greedy(str(tiny_llama_dir), device, prompt, 48), prompt


async def test_sampling_parity_with_adaptive_k(tiny_llama_dir, tiny_llama_perturbed_dir, device):
    """Unseeded requests (seeded ones keep a fixed k) whose k the policy picks from shared, changing costs."""
    params = SamplingParams(1.0)
    exact = exact_second_token_marginal(str(tiny_llama_dir), device, params)
    stack = await start_stack(tiny_llama_dir, tiny_llama_perturbed_dir, k=3, device=device, adaptive_k=True)
    limit = asyncio.Semaphore(24)

    async def second_token() -> int | None:
        async with limit:
            token_ids, _, _ = await stack.generate(prompt=PROMPT, max_tokens=3, temperature=1.0)
        return token_ids[1] if len(token_ids) > 1 else None
    try:
        tokens = [t for t in await asyncio.gather(*(second_token() for _ in range(1000))) if t is not None]
    finally:
        await stack.stop()
    counts = torch.bincount(torch.tensor(tokens), minlength=exact.numel()).float()
    assert total_variation(counts, exact) < 2 * expected_sampling_tv(exact, len(tokens))


def test_rounds_without_the_draft_leave_k_alone_until_a_draft_round_is_timed():
    """A request whose draft was away from the start has timed only target-only rounds."""
    policy = AdaptiveSpeculation().for_request("")
    assert policy.choose(K_MAX) == K_MAX  # nothing measured yet: the most
    for _ in range(3):  # the loop ran these target-only (draft unreachable); the policy only observes them
        policy.observe(RoundTiming(draft_s=0.0, verify_s=0.5), 0, 0)
    assert policy.choose(K_MAX) == K_MAX  # no draft cost known: nothing to weigh k against yet
