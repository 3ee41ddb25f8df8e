"""Graph steps over preallocated KV (specmesh/engine/: graph_steps, slot_cache), checked eagerly on the CPU.

On CUDA the same static steps are captured and replayed (`pytest --device cuda` runs these there);
what these tests hold on any device is the layout: writes in place at each session's length,
padding that touches no session, rollback as a length change, slots that come back. Rounds of propose,
verify and rollback over slots: tests/test_rollback.py.
"""

from __future__ import annotations

import asyncio
import copy
import gc
import random

import pytest
import torch
from transformers import DynamicCache

from engine_helpers import feed_uncached, next_logits_fresh
from harness import GRAPH_STEPS, eventually, make_engine, start_stack
from parity import MAX_TOKENS, target_greedy
from specmesh.engine.batching import Part
from specmesh.errors import CapacityExhausted, InvalidArgument
from specmesh.engine.graph_steps import MAX_ROWS, slot_shape
from specmesh.engine.kv_budget import KVCacheMemory
from specmesh.engine.sampling_params import SamplingParams
from specmesh.engine.slot_cache import SlotCache
from benchmarks.tiny_models import TINY_PROMPTS


def graph_engine(model_dir, device, role_name="target", **config):
    engine = make_engine(model_dir, device, role_name, **{**GRAPH_STEPS, **config})
    assert engine.graph is not None
    return engine


def test_slot_shape_gives_every_session_a_slot_as_long_as_the_budget_allows():
    assert slot_shape(200_000, 8, 32768) == (10, 20_000)  # 8 sessions + 2 spare
    assert slot_shape(10**9, 8, 2048) == (10, 2048 + MAX_ROWS)  # never past the model's window
    assert slot_shape(5000, 8, 32768) == (4, 1024)  # a small budget: fewer, not shorter, slots
    with pytest.raises(ValueError, match="kv-cache-memory"):
        slot_shape(1500, 8, 32768)


def test_context_window_leaves_room_for_a_padded_step(tiny_llama_dir, device):
    engine = graph_engine(tiny_llama_dir, device)
    assert engine.context_window == engine.graph.pool.slot_length - MAX_ROWS
    with pytest.raises(InvalidArgument, match="prompt_token_ids"):
        engine.new_session("long", [5] * engine.context_window, SamplingParams(0.0))


def test_one_step_of_many_sessions_gives_each_its_solo_logits(tiny_llama_dir, device):
    """Sessions of different lengths and row counts (1..9, so rows and sessions are padded to buckets)."""
    engine = graph_engine(tiny_llama_dir, device)
    rng = random.Random(0)
    parts, expected = [], []
    for index in range(5):
        prompt = [rng.randrange(3, 300) for _ in range(rng.randrange(2, 40))]
        session = engine.new_session(f"s{index}", prompt, SamplingParams(0.0))
        feed_uncached(engine, session)  # the prompt, eagerly, into the session's slot
        rows = [rng.randrange(3, 300) for _ in range(rng.choice([1, 2, 5, 9]))]
        keep = rng.randrange(1, len(rows) + 1)
        parts.append(Part(session, rows, keep))
        expected.append(next_logits_rows(engine, prompt + rows, keep))
    logits, _ = engine._run_step(parts)
    for part, got, wanted in zip(parts, logits, expected):
        assert got.shape == wanted.shape
        assert torch.allclose(got, wanted, atol=1e-4)
        assert part.session.cached_length == len(part.session.token_ids) + len(part.token_ids)


def next_logits_rows(engine, token_ids, keep):
    """Logits [keep, V] of the last `keep` positions of a fresh prefill of token_ids."""
    session = engine.new_session("fresh", token_ids[:1], SamplingParams(0.0))
    try:
        return engine.forward(session, token_ids, keep)[0]
    finally:
        engine.close("fresh")


def test_closed_sessions_give_their_slots_back(tiny_llama_dir, device):
    engine = graph_engine(tiny_llama_dir, device)
    pool = engine.graph.pool
    free = pool.free
    for index in range(3 * pool.slots):  # many more sessions than slots, one after another
        session = engine.new_session(f"s{index}", [5, 6, 7], SamplingParams(0.0))
        feed_uncached(engine, session)
        engine.close(f"s{index}")
    del session
    assert pool.free == free


def test_a_fork_copies_its_tokens_and_without_a_free_slot_still_works(tiny_llama_dir, device):
    engine = graph_engine(tiny_llama_dir, device)
    session = engine.new_session("s", [5, 6, 7, 8, 9], SamplingParams(0.0))
    feed_uncached(engine, session)
    held = [engine.graph.pool.new_cache() for _ in range(engine.graph.pool.free - 1)]
    in_slot = copy.deepcopy(session.cache)  # the last free slot
    in_memory = copy.deepcopy(session.cache)  # none left
    assert isinstance(in_slot, SlotCache) and isinstance(in_memory, DynamicCache)
    with pytest.raises(CapacityExhausted):
        engine.graph.pool.new_cache()
    continued = []
    for fork in (in_slot, in_memory):  # each continues [5..9] with 10, as the session would have
        session.cache = fork
        continued.append(engine.forward(session, [10], 1)[0][-1])
    del held, in_slot, fork
    wanted = next_logits_fresh(engine, [5, 6, 7, 8, 9, 10])
    assert all(torch.allclose(logits, wanted, atol=1e-4) for logits in continued)


@pytest.mark.parametrize("k", [1, 4, 8])
async def test_served_greedy_output_is_the_targets_generate(tiny_qwen2_dir, tiny_qwen2_draft_dir, device, k):
    stack = await start_stack(tiny_qwen2_dir, tiny_qwen2_draft_dir, device=device, k=k, engine_config=GRAPH_STEPS)
    try:  # all prompts at once: several sessions in each static step
        assert stack.target_engine.graph is not None and stack.draft_engine.graph is not None
        results = await asyncio.gather(*(stack.generate(prompt=p, max_tokens=MAX_TOKENS, temperature=0.0)
                                         for p in TINY_PROMPTS[:4]))
        assert stack.target_engine.graph.steps > 0 and stack.draft_engine.graph.steps > 0
    finally:
        await stack.stop()
    for prompt, (token_ids, _, _) in zip(TINY_PROMPTS, results):
        assert tuple(token_ids) == target_greedy(str(tiny_qwen2_dir), device, prompt, MAX_TOKENS), prompt


async def test_pipelined_rounds_with_forked_branches_stay_lossless(tiny_llama_dir, tiny_llama_perturbed_dir, device):
    """Pre-drafts fork the draft's cache for guessed rejections (each fork a slot, or memory once slots run out)."""
    stack = await start_stack(tiny_llama_dir, tiny_llama_perturbed_dir, device=device, k=3, pipeline="on",
                              extra_branches=2, engine_config=GRAPH_STEPS)
    try:
        results = await asyncio.gather(*(stack.generate(prompt=p, max_tokens=MAX_TOKENS, temperature=0.0)
                                         for p in TINY_PROMPTS[:3]))
        assert await stack.wait_sessions_freed() == (0, 0)
        # Every slot back, sessions and forks alike. A pre-draft's forks go back when its job ends, which may
        # be a step after its session was closed (the job learns of the close at its next step).
        for engine in (stack.target_engine, stack.draft_engine):
            await eventually(lambda: free_slots(engine), engine.graph.pool.slots)
    finally:
        await stack.stop()
    for prompt, (token_ids, _, _) in zip(TINY_PROMPTS, results):
        assert tuple(token_ids) == target_greedy(str(tiny_llama_dir), device, prompt, MAX_TOKENS), prompt


def free_slots(engine) -> int:
    gc.collect()  # a fork's slot goes back with its cache
    return engine.graph.pool.free


def test_a_feed_past_the_slot_fails_cleanly_and_keeps_the_cache(tiny_llama_dir, device):
    engine = graph_engine(tiny_llama_dir, device)
    prompt = [5] * (engine.context_window - 1)
    session = engine.new_session("s", prompt, SamplingParams(0.0))
    feed_uncached(engine, session)
    logits, _ = engine._run_step([Part(session, [6] * MAX_ROWS, 1)])  # the slot's last rows: still a static step
    assert logits[0].shape[0] == 1 and session.cached_length == len(prompt) + MAX_ROWS
    with pytest.raises(CapacityExhausted, match="slot"):
        engine._run_step([Part(session, [6] * MAX_ROWS, 1)])
    assert session.cached_length == len(prompt) + MAX_ROWS


def test_a_shape_whose_capture_fails_runs_eagerly_with_the_same_logits(tiny_llama_dir, device, caplog):
    """Capture needs CUDA: asked for on a CPU it fails, is logged once per shape, and the step still runs."""
    if device != "cpu":
        pytest.skip("capturing succeeds on CUDA")
    engine = graph_engine(tiny_llama_dir, device)
    session = engine.new_session("s", [5, 6, 7, 8], SamplingParams(0.0))
    feed_uncached(engine, session)
    engine.graph.capture = True
    for _ in range(2):
        logits, _ = engine._run_step([Part(session, [9, 10, 11], 3)])
        session.cache.crop(-3)  # the same step again
    assert engine.graph.captured == {(1, 4, 256): None}  # tried once, then eager
    assert sum("capturing a step" in record.message for record in caplog.records) == 1
    assert torch.allclose(logits[0], next_logits_rows(engine, [5, 6, 7, 8, 9, 10, 11], 3), atol=1e-4)


async def test_sessions_beyond_the_slots_wait_for_one_to_close(tiny_llama_dir, device):
    engine = graph_engine(tiny_llama_dir, device, kv_cache_memory=KVCacheMemory(bytes=2**20))
    slots = engine.kv.capacity // engine.graph.pool.slot_length
    assert slots < engine.config.max_sessions  # the budget, not the session limit, is what runs out
    for index in range(slots):
        await engine.admit(f"s{index}", [5, 6, 7], SamplingParams(0.0), caller=f"c{index}", max_new_tokens=4)
    waiting = asyncio.ensure_future(engine.admit("late", [5, 6, 7], SamplingParams(0.0), caller="late",
                                                 max_new_tokens=4))
    await eventually(lambda: engine.kv.waiting, 1)
    assert not waiting.done()  # a whole slot each, whatever max_new_tokens says
    engine.close("s0")
    session = await asyncio.wait_for(waiting, 10)
    assert isinstance(session.cache, SlotCache)


def test_the_setting_turns_graph_steps_on_where_it_can(tiny_llama_dir, device):
    engine = make_engine(tiny_llama_dir, device)  # auto
    assert (engine.graph is not None) == device.startswith("cuda")
    assert make_engine(tiny_llama_dir, device, graph_steps="off").graph is None
    with pytest.raises(ValueError, match="graph steps: 'sometimes'"):
        make_engine(tiny_llama_dir, device, graph_steps="sometimes")
