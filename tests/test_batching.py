"""Continuous batching: ragged steps equal solo forwards, concurrent requests stay lossless, and a
long prompt is chunked between the steps of running streams."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import threading
import time

import grpc
import pytest
import torch

from engine_helpers import next_logits_fresh, session_over
from harness import WORK_TIMEOUT_S, eventually, load, make_engine, start_stack
from parity import target_greedy
from specmesh.engine.batching import Part
from benchmarks.tiny_models import TINY_PROMPTS

MAX_ABS_LOGIT_DELTA = 1e-4  # fp32: batched kernels reorder sums, nothing more (measured 6.2e-6: docs/design/continuous-batching.md)


@pytest.mark.parametrize("model_fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
@pytest.mark.parametrize("row_multiple", [1, 4], ids=["unpadded", "rows-padded-to-4"])
def test_a_ragged_step_equals_each_session_alone(request, model_fixture, device, row_multiple):
    """Both tiny models have grouped-query attention (4 query heads over 2 key/value heads), which
    the segmented attention packs rather than repeats."""
    engine = make_engine(request.getfixturevalue(model_fixture), device, row_multiple=row_multiple)
    assert engine.ragged
    sequences = [list(range(5, 30)), list(range(40, 47)), list(range(60, 61)), list(range(70, 110))]
    sessions = [session_over(engine, seq, cached) for seq, cached in zip(sequences, (20, 6, 0, 33))]
    new_rows = [seq[s.cached_length:] + [7, 8] for seq, s in zip(sequences, sessions)]  # tails plus two drafts
    keeps = [len(rows) for rows in new_rows]
    keeps[3] = 0  # a prefill chunk that is not the last: no logits
    solo = [copy.deepcopy(s) for s in sessions]
    batched, _ = engine._run_step([Part(s, rows, keep) for s, rows, keep in zip(sessions, new_rows, keeps)])
    for alone, rows, keep, logits in zip(solo, new_rows, keeps, batched):
        if keep == 0:
            assert logits is None
            continue
        expected = engine.forward(alone, rows, keep)[0]  # [keep, V]
        assert logits.shape == expected.shape
        assert (logits - expected).abs().max() < MAX_ABS_LOGIT_DELTA
        assert torch.equal(logits.argmax(-1), expected.argmax(-1))
    # Each session's cache grew by exactly its own rows, with its own keys: the next token's
    # logits equal a fresh forward over the whole sequence.
    for session, seq in zip(sessions, sequences):
        whole = seq + [7, 8]
        assert session.cached_length == len(whole)
        after, _ = engine.forward(session, [9], 1)  # [1, V]
        assert (after[0] - next_logits_fresh(engine, whole + [9])).abs().max() < MAX_ABS_LOGIT_DELTA


def test_an_engine_on_cuda_takes_attention_off_cudnn(tiny_llama_dir, device):
    """cuDNN attention plans every new attention shape, and decoding meets one every step (specmesh.engine.ragged:
    3x slower steps on an H100): an engine on CUDA turns it off for its process; on a CPU nothing changes."""
    torch.backends.cuda.enable_cudnn_sdp(True)
    make_engine(tiny_llama_dir, device)
    assert torch.backends.cuda.cudnn_sdp_enabled() == (device == "cpu")


def test_a_step_that_fails_midway_leaves_every_cache_as_it_was(tiny_llama_dir, device):
    """Attention appends each layer's new keys and values to the sessions' caches as the forward
    goes; a failure in a later layer must not leave the earlier layers a step ahead."""
    engine = make_engine(tiny_llama_dir, device)
    sequences = [list(range(5, 30)), list(range(40, 47))]
    sessions = [session_over(engine, seq, len(seq) - 1) for seq in sequences]
    before = [s.cached_length for s in sessions]

    def fail(*_):
        raise RuntimeError("layer 1 failed")
    hook = engine.model.model.layers[1].register_forward_pre_hook(fail)
    try:
        with pytest.raises(RuntimeError, match="layer 1 failed"):
            engine._run_step([Part(s, s.uncached_tail + [7], 2) for s in sessions])
    finally:
        hook.remove()
    for session, seq, cached in zip(sessions, sequences, before):
        assert [layer.keys.shape[-2] for layer in session.cache.layers] == [cached] * len(session.cache.layers)
        after, _ = engine.forward(session, session.uncached_tail + [7], 1)  # the same step, now whole
        assert (after[0] - next_logits_fresh(engine, seq + [7])).abs().max() < MAX_ABS_LOGIT_DELTA


async def test_a_batch_given_to_the_engine_runs_as_one_ragged_step(tiny_llama_dir, device):
    """ModelEngine.submit_all: a part per session boards one step, and each session gets its own logits."""
    engine = make_engine(tiny_llama_dir, device)
    sequences = [list(range(5, 30)), list(range(40, 47)), list(range(60, 70))]
    sessions = [session_over(engine, seq, len(seq) - 1) for seq in sequences]
    stepped = []
    engine.scheduler.observers.append(lambda parts, ns: stepped.append([part.session.request_id for part in parts]))
    futures = engine.submit_all([(session, engine.feed_tail(session, [7], keep_rows=1)) for session in sessions])
    results = await asyncio.wait_for(asyncio.gather(*futures), 60)
    assert stepped == [[session.request_id for session in sessions]]
    for seq, (logits, _) in zip(sequences, results):
        assert (logits[0] - next_logits_fresh(engine, seq + [7])).abs().max() < MAX_ABS_LOGIT_DELTA


@pytest.mark.parametrize("cpu_linear", ["torch", "onednn"])
async def test_concurrent_mixed_requests_are_lossless_and_batched(tiny_llama_dir, tiny_llama_perturbed_dir, device,
                                                                  cpu_linear):
    """Greedy requests of mixed prompts, lengths and draft lengths, with seeded sampled ones among
    them: each greedy output is the target's own generate (torch's kernels); each seeded one is what
    it was alone. On either CPU linear kernel (specmesh.loading.cpu_linear)."""
    if cpu_linear == "onednn" and device != "cpu":
        pytest.skip("oneDNN linear is a CPU kernel")
    stack = await start_stack(tiny_llama_dir, tiny_llama_perturbed_dir, k=3, device=device, cpu_linear=cpu_linear)
    try:
        def request(i: int) -> dict:
            greedy = i % 4 != 3
            return dict(prompt=TINY_PROMPTS[i % len(TINY_PROMPTS)], max_tokens=12 + (i * 7) % 37,
                        num_speculative_tokens=1 + i % 6, temperature=0.0 if greedy else 0.9,
                        **({} if greedy else {"seed": 1000 + i}))
        requests = [request(i) for i in range(32)]
        sampled = {i: await stack.generate(**r) for i, r in enumerate(requests) if r["temperature"] > 0}
        results = await asyncio.gather(*(stack.generate(**r) for r in requests))
    finally:
        await stack.stop()
    for i, (r, (token_ids, _, _)) in enumerate(zip(requests, results)):
        if r["temperature"] == 0:
            assert tuple(token_ids) == target_greedy(str(tiny_llama_dir), device, r["prompt"], r["max_tokens"]), i
        else:
            assert token_ids == sampled[i][0], i  # reproducible whatever shared its steps
    assert stack.target_engine.scheduler.batched_steps > 0 and stack.draft_engine.scheduler.batched_steps > 0


async def test_a_long_prompt_is_chunked_between_steps_of_running_streams(tiny_llama_dir, tiny_llama_perturbed_dir,
                                                                         device):
    stack = await start_stack(tiny_llama_dir, tiny_llama_perturbed_dir, k=2, device=device)
    target = stack.target_engine
    target.config = dataclasses.replace(target.config, prefill_chunk=8)
    tokenizer = load(str(tiny_llama_dir), device)[1]
    long_prompt = tokenizer.decode(tokenizer.encode(" ".join(TINY_PROMPTS * 4))[:180])  # of the 256-token window
    steps = []  # per step: (rows fed for the long prompt's session, rows of other sessions)

    def observe(parts: list[Part], _ns: int) -> None:
        long_rows = sum(len(p.token_ids) for p in parts if p.session.output_start > 100)
        steps.append((long_rows, sum(len(p.token_ids) for p in parts) - long_rows))
    target.scheduler.observers.append(observe)
    try:
        running = [asyncio.ensure_future(stack.generate(prompt=p, max_tokens=150, temperature=0.0))
                   for p in TINY_PROMPTS[:3]]
        # the streams are decoding: open, their prompts in (on a loaded machine a session can be open
        # with its prompt still queued, and four new prompts go in together, unchunked)
        await eventually(lambda: len(sessions := list(target.sessions.values())) == 3
                         and all(s.cached_length >= s.output_start - 1 for s in sessions))
        # The target's worker is held while the long prompt arrives, so that the streams are still decoding
        # when it goes in: on a loaded machine they could otherwise finish first. Released once the prompt's
        # prefill waits for it, with a stream's round.
        holding, gate = threading.Event(), threading.Event()
        held = asyncio.ensure_future(target.run(lambda: holding.set() or gate.wait(WORK_TIMEOUT_S)))
        try:
            assert await asyncio.to_thread(holding.wait, WORK_TIMEOUT_S)
            long_run = asyncio.ensure_future(stack.generate(prompt=long_prompt, max_tokens=4, temperature=0.0))
            # a stream's round waits beside the prompt: it arrived, or it was mid-job when the worker stopped
            await eventually(lambda: any(s.output_start > 100 for s in target.sessions.values())
                             and target.scheduler.arrived + (target.scheduler.queued_rows > 0) >= 2)
        finally:
            gate.set()
            await held
        long_ids, _, _ = await long_run
        await asyncio.gather(*running)
    finally:
        await stack.stop()
    prefill_steps = [(long_rows, others) for long_rows, others in steps if long_rows > 0]
    shared = [(long_rows, others) for long_rows, others in prefill_steps if others > 0]
    assert len(prefill_steps) > 2, prefill_steps  # the prompt went in over several steps ...
    assert shared and all(long_rows <= 8 + 3 for long_rows, _ in shared), shared  # ... in chunks, beside the streams
    assert tuple(long_ids) == target_greedy(str(tiny_llama_dir), device, long_prompt, 4)


@pytest.mark.parametrize("per_token_s, finishes", [(1.0, True), (0.0, False)], ids=["grows", "fixed"])
async def test_a_prefill_gets_a_deadline_that_grows_with_the_prompt(tiny_llama_dir, device, per_token_s, finishes):
    """A busy target takes longer than one call's deadline to reach a prefill; the prompt's own
    allowance covers it (a long prompt fed in chunks between other streams' steps is the real case)."""
    stack = await start_stack(tiny_llama_dir, None, device=device,
                              loop_options=dict(target_timeout_s=0.5, prefill_timeout_per_token_s=per_token_s))
    busy = asyncio.ensure_future(stack.target_engine.run(time.sleep, 1.5))  # the worker, busy for 3 call deadlines
    try:
        if finishes:
            token_ids, _, _ = await stack.generate(prompt=TINY_PROMPTS[0], max_tokens=4, temperature=0.0)
            assert tuple(token_ids) == target_greedy(str(tiny_llama_dir), device, TINY_PROMPTS[0], 4)
        else:
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await stack.generate(prompt=TINY_PROMPTS[0], max_tokens=4, temperature=0.0)
            assert failed.value.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)
    finally:
        await busy
        await stack.stop()
