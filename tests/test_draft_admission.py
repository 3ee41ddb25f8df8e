"""A draft that refuses a session for now (RESOURCE_EXHAUSTED: its prefill queue or its KV room full) is not a
draft that failed: the request goes on target-only for a few tokens, then opens its draft session again and
drafts, with the target's own output. Real grpc.aio servers over tiny models; the draft's worker is held busy
so that a burst's prefill fills its queue, as many requests opening their drafts at once do on a slow host."""

from __future__ import annotations

import asyncio
import threading

from harness import WORK_TIMEOUT_S, eventually, load, make_engine, start_model_server
from orchestrator.serving.clients import TargetClient, open_channel
from orchestrator.serving.failover import PooledDraftClient
from parity import target_greedy
from pools import MAX_TOKENS, PROMPT, Replicas, generation
from specmesh.v1 import draft_pb2, draft_pb2_grpc

BURST_ROWS = 120  # prompt rows queued ahead on the draft: at 10 rows a second, past any open's deadline


async def test_a_session_the_draft_refused_for_now_is_opened_again_and_drafts(tiny_llama_dir, tiny_llama_perturbed_dir,
                                                                             device):
    draft_engine = make_engine(tiny_llama_perturbed_dir, device, "draft")
    draft_server, draft_port = await start_model_server("draft", draft_engine)
    drafts = Replicas("draft", {"draft-0": draft_server}, {"draft-0": f"127.0.0.1:{draft_port}"})
    target_server, target_port = await start_model_server("target", make_engine(tiny_llama_dir, device, "target"))
    gate = threading.Event()
    held = asyncio.ensure_future(draft_engine.run(gate.wait, 30))  # the draft's worker is busy: prefills queue
    try:
        await drafts.pool.wait_serving(1, timeout=WORK_TIMEOUT_S)
        (replica,) = drafts.pool.replicas.values()
        draft = PooledDraftClient(drafts.pool)
        async with open_channel(f"127.0.0.1:{draft_port}") as channel:
            burst = asyncio.ensure_future(draft_pb2_grpc.DraftServiceStub(channel).OpenSession(
                draft_pb2.DraftOpenRequest(request_id="burst", prompt_token_ids=list(range(5, 5 + BURST_ROWS)),
                                           max_new_tokens=8), timeout=60))
            await eventually(lambda: draft_engine.queued_prefill_rows(), BURST_ROWS - 1)
            draft_engine.prefill_rate.observe(prefill_rows=10, seconds=1.0)  # as measured: 10 prompt rows a second
            _, tokenizer = load(str(tiny_llama_dir), device)
            gen = generation(tokenizer, TargetClient(open_channel(f"127.0.0.1:{target_port}")), draft, k=3)
            tokens = []
            async for batch in gen.tokens():
                tokens += batch
                if gen.stats.rounds == 1:  # its first round found its session refused
                    assert gen.stats.draft_tokens == 0 and gen.stats.draft_fallback
                    # nothing was made on the replica, so nothing holds a place in the pool there
                    assert gen.session_id not in draft.sessions and replica.routed == 0
                    gate.set()
                    await burst  # the draft is free again
        assert tuple(tokens) == target_greedy(str(tiny_llama_dir), device, PROMPT, MAX_TOKENS)
        assert gen.draft is not None and gen.stats.draft_tokens > 0  # opened again, and drafted
    finally:
        gate.set()
        await held
        await drafts.stop_all()
        await drafts.pool.stop()
        await target_server.stop(None)
