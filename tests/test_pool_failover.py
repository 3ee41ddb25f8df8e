"""Sessions over replica pools survive a lost replica (no Ray: real servers at fixed addresses).

The loop's token stream is an async generator, so a test can stop a replica
between two rounds at an exact point and check what the next round does.
"""

from __future__ import annotations

import time
from dataclasses import replace

import grpc
import pytest
import torch

from harness import WORK_TIMEOUT_S, load
from orchestrator.decoding.costs import RoundCosts
from orchestrator.decoding.plan import FixedLength, RoundAsk, RoundPlan
from orchestrator.serving.clients import UpstreamError
from orchestrator.decoding.loop import SpeculativeGeneration
from orchestrator.decoding.pipelined import PipelinedGeneration
from orchestrator.control.ray_cli import replica_device
from orchestrator.serving.failover import PooledDraftClient, PooledTargetClient
from parity import target_greedy
from pools import MAX_TOKENS, PROMPT, Replicas, generation, placed
from specmesh.loading import models

ALTERNATIVES_PROMPT = "def fibonacci(n):"  # where the draft's second choice is sometimes the target's token


class EveryAlternative(FixedLength):
    """A stand-in for the default policy that drafts the request's k every round and offers every
    alternative: pricing is not the subject here, what a moved session keeps of rounds that committed
    alternatives is."""

    def __init__(self):
        super().__init__(RoundCosts())

    def plan(self, ask: RoundAsk) -> RoundPlan:
        return replace(super().plan(ask), row_rate=0.0)  # any chance of a token is worth a row


@pytest.mark.parametrize("alternatives, round_calls", [(False, "unary"), (True, "unary"), (False, "stream"),
                                                     (False, "batch")],
                         ids=["drafts", "drafts-and-alternatives", "drafts-on-round-streams", "drafts-in-batches"])
async def test_lost_target_and_draft_replicas_change_nothing(tiny_llama_dir, tiny_llama_perturbed_dir, alternatives,
                                                             round_calls):
    targets = await Replicas.start("target", tiny_llama_dir, 2, round_calls)
    drafts = await Replicas.start("draft", tiny_llama_perturbed_dir, 2, round_calls)
    target, draft = PooledTargetClient(targets.pool), PooledDraftClient(drafts.pool)
    _, tokenizer = load(str(tiny_llama_dir), "cpu")
    prompt = ALTERNATIVES_PROMPT if alternatives else PROMPT
    expected = list(target_greedy(str(tiny_llama_dir), "cpu", prompt, MAX_TOKENS))
    assert len(expected) > 12, "the prompt must run long enough to lose replicas mid-generation"
    gen = generation(tokenizer, target, draft, policy=EveryAlternative() if alternatives else None, prompt=prompt)
    tokens, moved, target_lost_at = [], [], 0
    try:
        async for batch in gen.tokens():
            tokens.extend(batch)
            # the target at round 2 (with alternatives: once one was committed, which the new replica must
            # be given too), the draft two rounds later
            if not moved and (gen.stats.alternative_accepted_tokens if alternatives else gen.stats.rounds >= 2):
                moved.append(placed(target, gen))
                await targets.stop(moved[-1])
                target_lost_at = gen.stats.rounds
            elif len(moved) == 1 and gen.stats.rounds == target_lost_at + 2:
                moved.append(placed(draft, gen))
                await drafts.stop(moved[-1])
        assert tokens == expected
        assert (gen.stats.alternative_accepted_tokens > 0) == alternatives
        assert target.failovers == 1 and draft.failovers == 1
        assert not gen.stats.draft_fallback  # the draft session moved rather than being dropped
        assert placed(target, gen) != moved[0] and placed(draft, gen) != moved[1]
    finally:
        await targets.stop_all()
        await drafts.stop_all()
        await targets.pool.stop()
        await drafts.pool.stop()


@pytest.mark.parametrize("loop", [SpeculativeGeneration, PipelinedGeneration])
async def test_speculation_comes_back_mid_request_when_the_draft_does(tiny_llama_dir, tiny_llama_perturbed_dir,
                                                                      loop):
    """The only draft replica dies: target-only rounds, the same output; back, it drafts again."""
    targets = await Replicas.start("target", tiny_llama_dir, 1)
    drafts = await Replicas.start("draft", tiny_llama_perturbed_dir, 1)
    target, draft = PooledTargetClient(targets.pool), PooledDraftClient(drafts.pool, acquire_timeout_s=0.0)
    _, tokenizer = load(str(tiny_llama_dir), "cpu")
    expected = list(target_greedy(str(tiny_llama_dir), "cpu", PROMPT, MAX_TOKENS))
    assert len(expected) > 30, "the prompt must run long enough for the draft to leave and come back"
    gen, tokens, drafted_when_back = generation(tokenizer, target, draft, loop=loop), [], None
    try:
        async for batch in gen.tokens():
            tokens.extend(batch)
            if gen.stats.rounds == 2 and drafts.servers:
                await drafts.stop("draft-0")
            elif gen.stats.rounds == 4 and drafted_when_back is None:
                assert gen.stats.draft_fallback  # rounds 3 and 4 ran target-only
                await drafts.restart("draft-0", tiny_llama_perturbed_dir)
                await drafts.pool.wait_serving(1, timeout=WORK_TIMEOUT_S)
                drafted_when_back = gen.stats.draft_tokens
        assert tokens == expected
        assert gen.stats.draft_tokens > drafted_when_back  # speculating again within the same request
    finally:
        await targets.stop_all()
        await drafts.stop_all()
        await targets.pool.stop()
        await drafts.pool.stop()


async def test_a_request_that_loses_replicas_repeatedly_is_failed(tiny_llama_dir):
    targets = await Replicas.start("target", tiny_llama_dir, 3)
    target = PooledTargetClient(targets.pool, max_replica_failures=2)
    _, tokenizer = load(str(tiny_llama_dir), "cpu")
    gen = generation(tokenizer, target, None, k=0)
    try:
        with pytest.raises(UpstreamError) as raised:
            async for _ in gen.tokens():
                await targets.stop(placed(target, gen))  # every replica it lands on dies
        assert raised.value.code == grpc.StatusCode.ABORTED
        assert "lost 2 target replicas" in str(raised.value)
        assert len(targets.servers) == 1  # the third replica was never taken down
    finally:
        await targets.stop_all()
        await targets.pool.stop()


async def test_no_healthy_target_is_unavailable_within_the_wait(tiny_llama_dir):
    targets = await Replicas.start("target", tiny_llama_dir, 1)
    target = PooledTargetClient(targets.pool, acquire_timeout_s=1.0)
    _, tokenizer = load(str(tiny_llama_dir), "cpu")
    try:
        await targets.stop_all()
        started = time.monotonic()
        with pytest.raises(UpstreamError) as raised:
            async for _ in generation(tokenizer, target, None).tokens():
                pass
        assert raised.value.code == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - started < 5.0
    finally:
        await targets.pool.stop()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_a_sharded_target_needs_gpus(tiny_llama_dir):
    assert replica_device("cpu", 2) == "auto" and replica_device("cpu", 1) == "cuda"
    assert replica_device("cuda:1", 0) == "cuda:1"
    with pytest.raises(ValueError, match="no CUDA device"):
        models.load_model(str(tiny_llama_dir), device="auto")
