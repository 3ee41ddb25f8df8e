"""Pipelined speculation: the draft drafts round r+1 while the target verifies round r.

Greedy output equals the target's own generate, sampled output follows the
target's distribution and equals the sequential loop's under a seed, a dying
draft changes nothing, and stale pre-drafts are never used.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from draft_service.engine import DraftEngine
from harness import WORK_TIMEOUT_S, draft_stub, load, metric, start_stack
from parity import expected_sampling_tv, target_greedy, total_variation
from specmesh.server.metrics import OrchestratorMetrics
from specmesh.engine.sampling_params import SamplingParams
from specmesh.engine.sampling import logits_to_probs
from specmesh.v1 import draft_pb2
from orchestrator.decoding.timing import PARTS
from benchmarks.tiny_models import TINY_PROMPTS

MAX_TOKENS = 32
GREEDY_CASES = [  # (draft fixture, k, extra branches: None = from measured costs)
    ("tiny_llama_dir", 3, 0),  # identical draft: every round all-accepted, the bonus guess always right
    ("tiny_llama_perturbed_dir", 2, None),
    ("tiny_llama_unrelated_dir", 3, 1),  # rejects at nearly every position
]


@pytest.mark.parametrize("draft_name, k, extra", GREEDY_CASES)
async def test_pipelined_greedy_parity(request, tiny_llama_dir, device, draft_name, k, extra):
    metrics = OrchestratorMetrics()
    stack = await start_stack(tiny_llama_dir, request.getfixturevalue(draft_name), k=k, device=device,
                              pipeline="on", extra_branches=extra, metrics=metrics)
    try:
        results = await asyncio.gather(*(stack.generate(prompt=p, max_tokens=MAX_TOKENS, temperature=0.0)
                                         for p in TINY_PROMPTS))
        assert await stack.wait_sessions_freed() == (0, 0)
    finally:
        await stack.stop()
    for prompt, (token_ids, _, last) in zip(TINY_PROMPTS, results):
        assert tuple(token_ids) == target_greedy(str(tiny_llama_dir), device, prompt, MAX_TOKENS), prompt
        assert not last.stats.draft_fallback
    hits = metric(metrics.registry, "specmesh_predraft_hits_total")
    misses = metric(metrics.registry, "specmesh_predraft_misses_total")
    rounds = sum(last.stats.rounds for _, _, last in results)
    assert hits + misses > rounds / 2  # most rounds after the first were pipelined
    if draft_name == "tiny_llama_dir":
        assert misses == 0 and hits > 0
    if draft_name == "tiny_llama_unrelated_dir":
        assert misses > 4 * hits
    parts = {p: metric(metrics.registry, "specmesh_round_time_seconds_count", part=p) for p in PARTS}
    assert set(parts.values()) == {rounds}
    assert metric(metrics.registry, "specmesh_round_time_seconds_sum", part="overlap") > 0


async def test_seeded_sampling_is_identical_sequential_and_pipelined(tiny_llama_dir, tiny_llama_perturbed_dir,
                                                                     device):
    requests = [dict(prompt=p, max_tokens=16, temperature=t, top_k=top_k, seed=seed)
                for p, seed in zip(TINY_PROMPTS[:4], range(10, 20)) for t, top_k in ((1.0, 0), (0.8, 12))]
    outputs = {}
    for pipeline, extra in (("off", None), ("on", 1)):
        stack = await start_stack(tiny_llama_dir, tiny_llama_perturbed_dir, k=3, device=device,
                                  pipeline=pipeline, extra_branches=extra)
        try:
            results = await asyncio.gather(*(stack.generate(**fields) for fields in requests))
        finally:
            await stack.stop()
        outputs[pipeline, extra] = [token_ids for token_ids, _, _ in results]
    assert outputs["on", 1] == outputs["off", None]


def exact_token_marginal(model_dir: str, device: str, prompt: str, params: SamplingParams, n: int) -> torch.Tensor:
    """P(x_n) over generations that reach an n-th token, summing over every prefix x_1..x_n-1."""
    model, tokenizer = load(model_dir, device)
    eos = tokenizer.eos_token_id

    def next_probs(prefixes: torch.Tensor) -> torch.Tensor:  # [m, len] -> [m, V]
        with torch.inference_mode():
            logits = model(prefixes.to(model.device), logits_to_keep=1).logits[:, -1].cpu()
        return logits_to_probs(logits.clone(), params)  # a clone outside inference mode can be edited
    prefixes, weights = torch.tensor([tokenizer.encode(prompt)]), torch.ones(1)  # [m, len], [m]
    for _ in range(n - 1):
        joint = weights[:, None] * next_probs(prefixes)  # [m, V]
        joint[:, eos] = 0.0  # a generation that ends early has no n-th token
        rows, tokens = joint.nonzero(as_tuple=True)  # top-k keeps these few
        prefixes, weights = torch.cat([prefixes[rows], tokens[:, None]], 1), joint[rows, tokens]
    return (weights / weights.sum()) @ next_probs(prefixes)  # [V]


async def test_pipelined_sampling_follows_target_distribution(tiny_llama_dir, tiny_llama_perturbed_dir, device):
    """k=1, five tokens: the fourth is decided by a round that may have been pre-drafted (all-accepted
    branch after round 1 accepted its token, or a rejection branch after it did not)."""
    # top-k keeps the exact marginal's support (and its computation) small.
    prompt, params, samples = "def add(a, b):", SamplingParams(1.0, top_k=12), 500
    exact = exact_token_marginal(str(tiny_llama_dir), device, prompt, params, n=4)
    metrics = OrchestratorMetrics()
    stack = await start_stack(tiny_llama_dir, tiny_llama_perturbed_dir, k=1, device=device, pipeline="on",
                              extra_branches=2, metrics=metrics)
    limit = asyncio.Semaphore(24)

    async def fourth(seed: int) -> int | None:
        async with limit:
            token_ids, _, _ = await stack.generate(prompt=prompt, max_tokens=5, temperature=params.temperature,
                                                   top_k=params.top_k, seed=seed, num_speculative_tokens=1)
        return token_ids[3] if len(token_ids) > 3 else None
    try:
        tokens = [t for t in await asyncio.gather(*(fourth(seed) for seed in range(samples))) if t is not None]
    finally:
        await stack.stop()
    assert metric(metrics.registry, "specmesh_predraft_hits_total") > samples / 10  # branches were used
    counts = torch.bincount(torch.tensor(tokens), minlength=exact.numel()).float()
    tv = total_variation(counts, exact)
    assert tv < 2 * expected_sampling_tv(exact, int(counts.sum())), tv
    references = torch.softmax(torch.randn(5, exact.numel(), generator=torch.Generator().manual_seed(3)) * 2, -1)
    assert min(total_variation(counts, ref) for ref in references) > 4 * tv


async def test_draft_dying_mid_pipelined_round_completes_identically(
        monkeypatch, tiny_llama_dir, tiny_llama_perturbed_dir, device):
    entered = asyncio.Event()
    branches = DraftEngine.predraft_branches
    started = []

    async def held_branches(self, *args):
        started.append(args)
        if len(started) >= 2:  # hold the second pre-draft mid-round until its server dies
            entered.set()
            await asyncio.sleep(3600)
        async for branch in branches(self, *args):
            yield branch
    monkeypatch.setattr(DraftEngine, "predraft_branches", held_branches)
    stack = await start_stack(tiny_llama_dir, tiny_llama_perturbed_dir, k=2, device=device, pipeline="on")
    prompt = TINY_PROMPTS[1]
    try:
        generation = asyncio.ensure_future(stack.generate(prompt=prompt, max_tokens=40, temperature=0.0))
        await asyncio.wait_for(entered.wait(), WORK_TIMEOUT_S)
        await stack.servers.pop("draft").stop(None)
        token_ids, _, last = await asyncio.wait_for(generation, WORK_TIMEOUT_S)
    finally:
        await stack.stop()
    assert tuple(token_ids) == target_greedy(str(tiny_llama_dir), device, prompt, 40)
    assert last.stats.draft_fallback and last.stats.draft_tokens > 0


async def test_stale_rounds_are_refused(tiny_llama_dir, tiny_llama_perturbed_dir, device):
    stack = await start_stack(tiny_llama_dir, tiny_llama_perturbed_dir, k=2, device=device)
    stub = draft_stub(stack)
    try:
        await stub.OpenSession(draft_pb2.DraftOpenRequest(request_id="s", prompt_token_ids=[5, 6, 7]), timeout=10)
        proposal = await stub.Propose(draft_pb2.ProposeRequest(request_id="s", round=5, position=3, num_tokens=2),
                                      timeout=10)
        stale = draft_pb2.PreDraftRequest(request_id="s", round=4, position=3,
                                          assumed_token_ids=proposal.token_ids, num_tokens=2)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            [branch async for branch in stub.PreDraft(stale, timeout=10)]
        assert raised.value.code() == grpc.StatusCode.ABORTED
        ahead = draft_pb2.PreDraftRequest(request_id="s", round=6, position=3,
                                          assumed_token_ids=proposal.token_ids, num_tokens=2, extra_branches=1)
        branches = [branch async for branch in stub.PreDraft(ahead, timeout=10)]
        assert len(branches) == 2 and branches[0].accepted_count == 2 and branches[0].position == 6
        rejection = branches[1]
        assert rejection.accepted_count < 2 and rejection.position == 3 + rejection.accepted_count + 1
        assert (branches[0].planned_accepted_counts, branches[0].planned_next_token_ids) == (
            [rejection.accepted_count], [rejection.next_token_id])
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await stub.Propose(draft_pb2.ProposeRequest(request_id="s", round=5, position=3, num_tokens=2),
                               timeout=10)
        assert raised.value.code() == grpc.StatusCode.ABORTED
    finally:
        await stack.stop()
