"""Speculation controls: the server-wide kill switch (Admin RPC), effective within one round."""

from __future__ import annotations

import contextlib

import grpc

from harness import load, start_stack
from orchestrator.serving.clients import DraftClient, TargetClient, open_channel
from orchestrator.decoding.loop import SpeculativeGeneration
from orchestrator.decoding.request import GenerationRequest, LoopConfig, SpeculationSwitch
from parity import target_greedy
from specmesh.engine.sampling_params import SamplingParams
from specmesh.v1 import admin_pb2, admin_pb2_grpc
from benchmarks.tiny_models import TINY_PROMPTS


async def test_switch_changes_the_very_next_round(tiny_llama_dir, device):
    k, prompt = 3, TINY_PROMPTS[4]
    stack = await start_stack(tiny_llama_dir, tiny_llama_dir, k=k, device=device)  # identical draft
    _, tokenizer = load(str(tiny_llama_dir), device)
    switch = SpeculationSwitch()
    request = GenerationRequest("switch", tokenizer.encode(prompt), 40, SamplingParams(0.0), [], k)
    generation = SpeculativeGeneration(
        request, TargetClient(open_channel(f"127.0.0.1:{stack.target_port}")),
        DraftClient(open_channel(f"127.0.0.1:{stack.draft_port}")), set(),
        LoopConfig(decode_ahead=0), switch=switch)  # a target-only round a token: the sizes show the switch
    sizes, tokens = [], []
    try:
        async with contextlib.aclosing(generation.tokens()) as batches:
            async for batch in batches:  # the generator is paused between batches: no round runs ahead
                sizes.append(len(batch))
                tokens += batch
                switch.enabled = not (4 <= len(sizes) < 8)  # off for rounds 4-7, on again after
    finally:
        await stack.stop()
    assert sizes[1:4] == [k + 1] * 3  # an identical draft: every token accepted, plus the bonus
    assert sizes[4:8] == [1, 1, 1, 1]  # off: target-only from the next round on
    assert sizes[8] == k + 1  # on again: the draft catches up through its commit
    assert tuple(tokens) == target_greedy(str(tiny_llama_dir), device, prompt, 40)


async def test_admin_rpc_turns_speculation_off_and_on(tiny_llama_dir, tiny_llama_perturbed_dir, device):
    stack = await start_stack(tiny_llama_dir, tiny_llama_perturbed_dir, k=3, device=device)
    admin = admin_pb2_grpc.AdminStub(grpc.aio.insecure_channel(f"127.0.0.1:{stack.port}"))
    try:
        assert (await admin.GetSpeculation(admin_pb2.GetSpeculationRequest(), timeout=5)).enabled
        off = await admin.SetSpeculation(admin_pb2.SetSpeculationRequest(enabled=False), timeout=5)
        token_ids, _, last_off = await stack.generate(prompt=TINY_PROMPTS[0], max_tokens=16, temperature=0.0)
        on = await admin.SetSpeculation(admin_pb2.SetSpeculationRequest(enabled=True), timeout=5)
        again, _, last_on = await stack.generate(prompt=TINY_PROMPTS[0], max_tokens=16, temperature=0.0)
    finally:
        await stack.stop()
    assert not off.enabled and on.enabled
    assert last_off.stats.draft_tokens == 0 and last_off.stats.target_forward_passes == len(token_ids)
    assert last_on.stats.draft_tokens > 0 and again == token_ids
