"""The default draft-length policy on real services: it never changes the output, and it follows the draft's cost.

Its choices on constructed costs and acceptance are tests/test_draft_length_policy.py."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import torch

from harness import WORK_TIMEOUT_S, load, make_engine, start_model_server, start_stack
from orchestrator.decoding.loop import SpeculativeGeneration
from orchestrator.decoding.request import GenerationRequest, LoopConfig
from orchestrator.decoding.policy import Speculation
from orchestrator.deployment.clients import DraftClient, TargetClient, open_channel
from test_greedy_parity import target_greedy
from test_sampling_parity import PROMPT, exact_second_token_marginal, expected_sampling_tv, total_variation
from specmesh.sampling import SamplingParams
from specmesh.step_costs import MEASURED_ROWS
from specmesh.v1 import generation_pb2
from tiny_models import TINY_PROMPTS

async def test_useless_draft_serves_target_only_with_identical_output(tiny_llama_dir, tiny_llama_unrelated_dir,
                                                                      device):
    """Set tables price the unrelated draft at a tenth of its target, so drafting pays until the draft's
    acceptance shows it useless. (The two tiny models are the same size: calibrated beside another test's
    load, their relative price, and so how long drafting was tried, was the host's timing.)"""
    stack = await start_stack(tiny_llama_dir, tiny_llama_unrelated_dir, k=4, device=device, adaptive_k=True,
                              calibrate=True, target_step_costs={rows: 0.01 for rows in MEASURED_ROWS},
                              draft_step_costs={rows: 0.001 for rows in MEASURED_ROWS})
    try:
        token_ids, _, last = await stack.generate(prompt=TINY_PROMPTS[0], max_tokens=64, temperature=0.0)
    finally:
        await stack.stop()
    assert tuple(token_ids) == target_greedy(str(tiny_llama_dir), device, TINY_PROMPTS[0], 64)
    # Mostly rounds without the draft model: target-only, or verifying prompt lookup's tokens (the tiny
    # model's greedy output repeats itself, and lookup finds it).
    assert last.stats.rounds > 20 and last.stats.draft_tokens < last.stats.rounds / 4


async def test_busy_draft_turns_speculation_off_then_back_on(tiny_llama_deep_dir, tiny_llama_dir, device):
    """Another tenant occupies the draft's worker: k drops to 0; once it leaves, probes bring k back.
    The draft agrees with its target on every token and costs a quarter of its step (tiny_llama_deep_dir):
    drafting pays clearly once the draft is free. (With the model as its own draft the two cost the same,
    and whether drafting paid was the host's timing: k drifted back to 0 in a CI run, and in one local run of six.)
    (Prompt lookup off: its tokens would make target-only rounds commit several tokens too.)"""
    stack = await start_stack(tiny_llama_deep_dir, tiny_llama_dir, k=4, device=device, adaptive_k=True,
                              loop_options={"prompt_lookup": False})
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
    assert tuple(token_ids) == target_greedy(str(tiny_llama_deep_dir), device, TINY_PROMPTS[1], max_tokens)
    assert switched_at is not None, rounds
    # Drafting again at the end, judged on the last rounds that had room for a full draft: in the last
    # few tokens k is capped by what is left, and a draft of one token may rightly not pay.
    left_before = [max_tokens - sum(rounds[:i]) for i in range(len(rounds))]
    roomy = [r for r, left in zip(rounds, left_before) if left > 5]
    assert max(rounds[switched_at:]) > 1 and max(roomy[-3:]) > 1, rounds


async def test_greedy_parity_with_adaptive_k(tiny_llama_dir, tiny_llama_perturbed_dir, device):
    """Served as in production: calibrated services, so rounds are priced from their step costs. The
    tiny draft is its target's size, so drafting could never pay; its table says it is ten times cheaper."""
    stack = await start_stack(tiny_llama_dir, tiny_llama_perturbed_dir, k=5, device=device, adaptive_k=True,
                              calibrate=True, draft_cost_scale=0.1)
    try:
        results = await asyncio.gather(*(stack.generate(prompt=p, max_tokens=48, temperature=0.0)
                                         for p in TINY_PROMPTS))
    finally:
        await stack.stop()
    for prompt, (token_ids, _, _) in zip(TINY_PROMPTS, results):
        assert tuple(token_ids) == target_greedy(str(tiny_llama_dir), device, prompt, 48), prompt
    assert sum(last.stats.draft_tokens for _, _, last in results) > 0  # the policy did draft


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


async def test_first_tokens_never_wait_for_the_drafts_prefill(tiny_llama_deep_dir, tiny_llama_dir, device):
    """The draft's worker is held: its session cannot open. Tokens stream target-only meanwhile; once the
    draft is free, rounds draft again, and the output is the target's own. (A cheaper draft that agrees
    on every token, and prompt lookup off, as above.)"""
    stack = await start_stack(tiny_llama_deep_dir, tiny_llama_dir, k=4, device=device, adaptive_k=True,
                              loop_options={"prompt_lookup": False})
    holding, gate = threading.Event(), threading.Event()

    def hold_the_draft() -> None:
        holding.set()
        gate.wait(60)

    held = asyncio.ensure_future(stack.draft_engine.run(hold_the_draft))
    max_tokens, token_ids, rounds = 64, [], []
    try:
        assert await asyncio.to_thread(holding.wait, WORK_TIMEOUT_S)
        request = generation_pb2.GenerateRequest(prompt=TINY_PROMPTS[2], max_tokens=max_tokens, temperature=0.0)
        responses = stack.stub.Generate(request, timeout=WORK_TIMEOUT_S)
        while len(rounds) < 6:  # the old loop waited for the draft's session from round 1 on
            response = await asyncio.wait_for(responses.read(), WORK_TIMEOUT_S)
            token_ids.extend(response.token_ids)
            rounds.append(len(response.token_ids))
        gate.set()
        while (response := await responses.read()) is not grpc.aio.EOF:
            token_ids.extend(response.token_ids)
            rounds.append(len(response.token_ids))
    finally:
        gate.set()
        await held
        await stack.stop()
    assert rounds[:6] == [1] * 6  # target-only while the draft could not open
    assert max(rounds[6:]) > 1, rounds  # then drafted: the identical draft's rounds commit several tokens
    assert tuple(token_ids) == target_greedy(str(tiny_llama_deep_dir), device, TINY_PROMPTS[2], max_tokens)


async def test_a_request_that_loses_its_draft_goes_on_target_only_beside_one_that_drafts(tiny_llama_dir, device):
    """Two requests share the policy, each on its own draft replica. One replica dies after its first
    drafting round: that request decodes target-only from then on, the other keeps drafting, and both
    outputs stay the target's own."""
    target_server, target_port = await start_model_server("target", make_engine(tiny_llama_dir, device, "target"))
    drafts = [await start_model_server("draft", make_engine(tiny_llama_dir, device, "draft")) for _ in range(2)]
    _, tokenizer = load(str(tiny_llama_dir), device)
    shared = Speculation()  # no reported costs: every request drafts until rounds are timed
    target = TargetClient(open_channel(f"127.0.0.1:{target_port}"))
    prompts, max_tokens = TINY_PROMPTS[:2], 40
    generations = [
        SpeculativeGeneration(
            GenerationRequest(request_id=f"r{index}", prompt_token_ids=tokenizer.encode(prompt), max_tokens=max_tokens,
                              sampling=SamplingParams(temperature=0.0), stop=[], num_speculative_tokens=3),
            target, DraftClient(open_channel(f"127.0.0.1:{port}")), {tokenizer.eos_token_id},
            LoopConfig(num_speculative_tokens=3), policy=shared.for_request(""))
        for index, (prompt, (_, port)) in enumerate(zip(prompts, drafts))]
    lost = generations[1]

    async def run(generation: SpeculativeGeneration) -> list[int]:
        tokens = []
        async for batch in generation.tokens():
            tokens.extend(batch)
            if generation is not lost:
                continue
            if generation.stats.draft_tokens and drafts[1][0] is not None:
                await drafts[1][0].stop(None)  # its draft replica dies after its first drafting round
                drafts[1] = (None, None)
        return tokens

    try:
        outputs = await asyncio.wait_for(asyncio.gather(*(run(g) for g in generations)), WORK_TIMEOUT_S)
    finally:
        for server, _ in drafts + [(target_server, target_port)]:
            if server is not None:
                await server.stop(None)
    for prompt, tokens in zip(prompts, outputs):
        assert tuple(tokens) == target_greedy(str(tiny_llama_dir), device, prompt, max_tokens), prompt
    assert lost.stats.draft_fallback and not generations[0].stats.draft_fallback
    assert generations[0].stats.draft_tokens > lost.stats.draft_tokens > 0
