"""Prometheus metrics agree with the per-request stats; the disagreement log holds the rejections."""

from __future__ import annotations

import asyncio
import json

import torch

from harness import load, metric, start_stack
from specmesh.server.metrics import OrchestratorMetrics
from target_service.disagreements import Disagreement, DisagreementLog
from benchmarks.tiny_models import TINY_PROMPTS


async def test_counters_agree_with_request_stats(tiny_llama_dir, tiny_llama_perturbed_dir, device):
    metrics = OrchestratorMetrics()
    stack = await start_stack(tiny_llama_dir, tiny_llama_perturbed_dir, k=3, device=device, metrics=metrics)
    requests = [dict(prompt=p, max_tokens=20, temperature=t, seed=i, prompt_class=c)
                for i, p in enumerate(TINY_PROMPTS) for t, c in ((0.0, "code"), (1.0, "chat"))]
    try:
        results = await asyncio.gather(*(stack.generate(**r) for r in requests))
    finally:
        await stack.stop()
    stats = [last.stats for _, _, last in results]
    r = metrics.registry
    drafted, accepted = metric(r, "specmesh_spec_decode_num_draft_tokens_total"), \
        metric(r, "specmesh_spec_decode_num_accepted_tokens_total")
    assert drafted == sum(s.draft_tokens for s in stats) > 0
    assert accepted == sum(s.accepted_tokens for s in stats) and accepted <= drafted
    per_position = metric(r, "specmesh_spec_decode_num_accepted_tokens_per_pos_total")
    assert per_position == accepted
    by_draft = {"draft_model": str(tiny_llama_perturbed_dir)}  # what a rollout's before/after compares
    assert metric(r, "specmesh_draft_model_draft_tokens_total", **by_draft) == drafted
    assert metric(r, "specmesh_draft_model_accepted_tokens_total", **by_draft) == accepted
    rounds = sum(s.rounds for s in stats)
    # every output token is an accepted draft token, one recovered/bonus token per round, or a first token
    assert metric(r, "specmesh_generation_tokens_total") == accepted + rounds + len(requests)
    assert metric(r, "specmesh_target_forward_passes_total") == rounds + len(requests)
    assert metric(r, "specmesh_requests_total") == len(requests)
    assert metric(r, "specmesh_time_to_first_token_seconds_count") == len(requests)
    assert metric(r, "specmesh_spec_decode_num_draft_tokens_total", prompt_class="code") == \
        sum(s.draft_tokens for s, req in zip(stats, requests) if req["prompt_class"] == "code")
    assert metric(r, "specmesh_requests_running") == metric(r, "specmesh_requests_waiting") == 0


def simulate_greedy_rejections(target_dir: str, draft_dir: str, device: str, prompt: str, k: int,
                               max_tokens: int) -> list[tuple[int, int, int]]:
    """Replay the greedy rounds with the models alone: (position, draft token, target token) per rejection."""
    target, tokenizer = load(target_dir, device)
    draft, _ = load(draft_dir, device)
    argmax = lambda model, ids: int(model(torch.tensor([ids], device=device)).logits[0, -1].argmax())  # noqa: E731
    prompt_ids = tokenizer.encode(prompt)
    rejections = []
    with torch.inference_mode():
        sequence = prompt_ids + [argmax(target, prompt_ids)]
        while len(sequence) - len(prompt_ids) < max_tokens:
            proposal = []
            for _ in range(min(k, max_tokens - (len(sequence) - len(prompt_ids)) - 1)):
                proposal.append(argmax(draft, sequence + proposal))
            accepted = []
            for token in proposal:
                expected = argmax(target, sequence + accepted)
                if token != expected:
                    rejections.append((len(sequence) + len(accepted), token, expected))
                    break
                accepted.append(token)
            sequence += accepted + [argmax(target, sequence + accepted)]
    return rejections


async def test_disagreement_log_holds_exactly_the_rejections(tmp_path, tiny_llama_dir, tiny_llama_perturbed_dir,
                                                              device):
    log_path = tmp_path / "disagreements.jsonl"
    log = DisagreementLog(log_path, max_per_second=1e6)
    stack = await start_stack(tiny_llama_dir, tiny_llama_perturbed_dir, k=4, device=device, disagreements=log)
    max_tokens = 40
    try:
        for prompt in TINY_PROMPTS:  # one after another, so the log's order is known
            await stack.generate(prompt=prompt, max_tokens=max_tokens, temperature=0.0)
    finally:
        await stack.stop()
        log.close()
    records = [json.loads(line) for line in log_path.read_text().splitlines()]
    logged = [(r["position"], r["draft_token_id"], r["target_token_id"]) for r in records]
    expected = [rejection for prompt in TINY_PROMPTS for rejection in simulate_greedy_rejections(
        str(tiny_llama_dir), str(tiny_llama_perturbed_dir), device, prompt, 4, max_tokens)]
    assert logged == expected and len(expected) > 3
    for record in records:
        assert record["target_prob_of_target_token"] >= record["target_prob_of_draft_token"]
        assert record["draft_prob_of_draft_token"] is None  # greedy drafts send ids only
        assert len(record["context_hash"]) == 16


def test_disagreement_log_is_rate_limited(tmp_path):
    now = [0.0]
    log = DisagreementLog(tmp_path / "log.jsonl", max_per_second=2, clock=lambda: now[0])
    record = Disagreement("r", 1, 5, "0" * 16, 1, 2, 0.1, 0.9, None, None)
    written = [log.record(record) for _ in range(5)]  # a burst of 2, then nothing
    now[0] = 1.0  # one second refills two
    written += [log.record(record) for _ in range(3)]
    log.close()
    assert written == [True, True, False, False, False, True, True, False]
    assert len((tmp_path / "log.jsonl").read_text().splitlines()) == 4 and log.dropped == 4


def test_prompt_class_labels_are_bounded():
    """A client inventing classes cannot grow the series without bound: past the limit they are "other"."""
    from specmesh.server.metrics import MAX_PROMPT_CLASS_LABELS, OrchestratorMetrics
    metrics = OrchestratorMetrics()
    labels = [metrics.prompt_class_label(f"class-{index}") for index in range(MAX_PROMPT_CLASS_LABELS + 8)]
    assert labels[:MAX_PROMPT_CLASS_LABELS] == [f"class-{index}" for index in range(MAX_PROMPT_CLASS_LABELS)]
    assert set(labels[MAX_PROMPT_CLASS_LABELS:]) == {"other"}
    assert metrics.prompt_class_label("class-0") == "class-0"  # one seen before keeps its own label
