"""`specmesh bench`'s suffix-drafting workloads: the repeat kind's order, the rewrite kind's bodies,
n > 1 in prompt files, and the clients counting every completion of an n > 1 request."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from harness import WORK_TIMEOUT_S, load, start_stack
from orchestrator.bench.clients import GrpcClient, HttpClient, RequestParams, _Timer, read_chunk
from orchestrator.bench.metrics import RequestRecord, aggregate
from orchestrator.prompts.sets import BUILTIN, BenchPrompt, load_jsonl, select_prompts
from orchestrator.prompts.workloads import SAMPLES_N
from orchestrator.decoding.request import LoopConfig
from orchestrator.control.build import OrchestratorOptions
from orchestrator.cli.main import main as specmesh_main
from orchestrator.serving.http_api import create_app, start_http_server, stop_http_server
from orchestrator.control.build import create_servicer
from specmesh.v1 import admin_pb2, admin_pb2_grpc


def askings(chosen: list[BenchPrompt]) -> dict[str, list[int]]:
    """Per task, the pool positions (its askings' order in the kind) in the order they were sent."""
    pool = BUILTIN["repeat"]
    seen: dict[str, list[int]] = {}
    for item in chosen:
        earlier = seen.setdefault(item.task, [])
        position = next(i for i, p in enumerate(pool)
                        if p.task == item.task and p.prompt == item.prompt and i not in earlier)
        earlier.append(position)
    return seen


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_repeat_sends_every_original_before_its_reaskings_spread_and_seeded(seed):
    pool = BUILTIN["repeat"]
    chosen = select_prompts(pool, 12, seed)
    assert chosen == select_prompts(pool, 12, seed)
    originals = {p.task: p.prompt for p in pool[::-1]}  # each task's first asking in the pool
    assert {p.prompt for p in chosen[:4]} == set(originals.values())  # the first wave: every original
    for task, positions in askings(chosen).items():
        assert len(positions) == 3 and positions == sorted(positions), task  # askings in the kind's order
    assert all(a.task != b.task for a, b in zip(chosen, chosen[1:]))  # no re-asking right after its task
    # --kinds code repeat: the interleaving keeps the repeat kind's own order
    mixed = [p for p in select_prompts(BUILTIN["code"] + pool, 24, seed) if p.kind == "repeat"]
    assert mixed[:12] == chosen


def test_repeat_reasks_tasks_with_other_names_and_exactly():
    pool = BUILTIN["repeat"]
    by_task: dict[str, list[str]] = {}
    for item in pool:
        by_task.setdefault(item.task, []).append(item.prompt)
    assert len(by_task) == 4 and all(item.prompt and item.temperature is None for item in pool)
    for task, texts in by_task.items():
        assert len(texts) == 4 and len(set(texts)) == 3, task  # two renamings and one exact repeat
        assert texts[1] != texts[0] and texts.count(texts[0]) == 2
    assert "class Pile" in by_task["stack"][1] and "def summed(values)" in by_task["total"][1]
    assert select_prompts(pool, 3, 0) != select_prompts(pool, 3, 5)  # the waves are shuffled by seed


def test_rewrite_prompts_give_back_a_15_to_40_line_body():
    assert len(BUILTIN["rewrite"]) >= 6
    for item in BUILTIN["rewrite"]:
        (message,) = item.messages
        body = re.search(r"```\n(.*?)```", message["content"], re.S).group(1)
        assert 15 <= len(body.splitlines()) <= 40, message["content"][:60]
        assert len(body) > 0.7 * len(message["content"])  # the answer copies most of the prompt


def test_prompt_files_carry_n_and_the_samples_kind_asks_for_several(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a", "n": 3}\n{"prompt": "b"}\n')
    assert [p.n for p in load_jsonl(path)] == [3, 1]
    assert all(p.n == SAMPLES_N > 1 and p.default_temperature() == 1.0 for p in BUILTIN["samples"])


def test_interleaved_completions_are_timed_and_counted_apart():
    """HTTP chunks of two completions, interleaved: TTFT at the first of any, ITL within each, the
    tokens and drafts of both summed, TPOT over the longer one; a missing completion is a failure."""
    record = RequestRecord(kind="samples", mode="on", index=0)
    timer = _Timer(record, 0.0, n=2)
    stats = {}
    for chunk in ({"choices": [{"index": 0, "text": "a"}]}, {"choices": [{"index": 1, "text": "b"}]},
                  {"choices": [{"index": 1, "text": "c"}]},
                  {"choices": [{"index": 0, "text": "d", "finish_reason": "length"}],
                   "stats": {"prompt_tokens": 4, "completion_tokens": 5, "draft_tokens": 6, "accepted_tokens": 3}},
                  {"choices": [{"index": 1, "text": "", "finish_reason": "stop"}],
                   "stats": {"prompt_tokens": 4, "completion_tokens": 2, "draft_tokens": 2, "accepted_tokens": 1}},
                  {"choices": [], "usage": {"completion_tokens": 7}}):
        read_chunk(chunk, timer, stats)
    timer.finish(stats)
    assert record.ok and record.n == 2 and record.completion_tokens == [5, 2] and record.output_tokens == 7
    assert (record.prompt_tokens, record.draft_tokens, record.accepted_tokens) == (4, 8, 4)
    assert len(record.itl_ms) == 2 and record.ttft_ms > 0  # a gap in each completion, none between them
    assert record.tpot_ms == pytest.approx((record.e2e_ms - record.ttft_ms) / 4)
    assert aggregate([record], 1.0)["output_throughput"] == 7
    short = RequestRecord(kind="samples", mode="on", index=1)
    _Timer(short, 0.0, n=3).finish({0: {"completion_tokens": 1}})
    assert not short.ok and short.error == "1 of 3 completions finished"


async def test_both_clients_count_every_completion_of_an_n_request(tiny_llama_dir, tiny_llama_perturbed_dir):
    """A tiny served pair: n = 3 seeded completions over gRPC and over HTTP, speculation on; each
    completion's tokens recorded (the same over both protocols: same seeds), all of them counted."""
    stack = await start_stack(tiny_llama_dir, tiny_llama_perturbed_dir, k=3)
    _, tokenizer = load(str(tiny_llama_dir), "cpu")
    servicer = await create_servicer(tokenizer, OrchestratorOptions(
        f"127.0.0.1:{stack.target_port}", f"127.0.0.1:{stack.draft_port}", LoopConfig(3, adaptive_k=False)))
    server, port, task = await start_http_server(create_app(servicer), "127.0.0.1", 0)
    item = BenchPrompt("samples", prompt="def add(a, b):", n=3)
    params = RequestParams(max_tokens=8, temperature=1.0, seed=11, speculation=True)
    records = {}
    try:
        clients = (("grpc", GrpcClient(f"127.0.0.1:{stack.port}")), ("http", HttpClient(f"127.0.0.1:{port}")))
        for name, client in clients:
            records[name] = RequestRecord(kind=item.kind, mode="on", index=0)
            try:
                await client.send(item, params, records[name], 0.0)
            finally:
                await client.close()
    finally:
        await stop_http_server(server, task)
        await stack.stop()
    for name, record in records.items():
        assert record.ok, (name, record.error)
        assert record.n == 3 and len(record.completion_tokens) == 3, name
        assert all(1 <= t <= 8 for t in record.completion_tokens) and record.output_tokens == sum(
            record.completion_tokens), name
        assert record.draft_tokens > 0 and record.prompt_tokens > 0 and record.ttft_ms > 0, name
        assert len(record.itl_ms) <= record.output_tokens - 3, name  # gaps within completions only
    assert records["grpc"].completion_tokens == records["http"].completion_tokens


async def test_bench_runs_the_workloads_beside_code(tmp_path, tiny_llama_dir, tiny_llama_perturbed_dir):
    """`--kinds code repeat samples` against a tiny served pair: a row per kind, and the samples kind's
    requests count their n completions' tokens (rewrite's bodies overflow the tiny models' 256-token window)."""
    stack = await start_stack(tiny_llama_dir, tiny_llama_perturbed_dir, k=3)
    try:
        code = await asyncio.to_thread(specmesh_main, [
            "bench", "--endpoint", f"127.0.0.1:{stack.port}", "--kinds", "code", "repeat", "samples",
            "--num-prompts", "8", "--max-tokens", "4", "--num-warmups", "0", "--no-progress",
            "--result-dir", str(tmp_path)])
    finally:
        await stack.stop()
    assert code == 0
    result = json.loads((tmp_path / "result.json").read_text())
    per_kind = result["configurations"][0]["modes"]["on"]["per_kind"]
    assert set(per_kind) == {"code", "repeat", "samples"}
    samples = [r for r in result["requests"] if r["kind"] == "samples"]
    assert samples and all(r["n"] == SAMPLES_N == len(r["completion_tokens"]) for r in samples)
    assert all(r["output_tokens"] == sum(r["completion_tokens"]) > 4 for r in samples)


async def test_the_bench_empties_the_suffix_index_before_each_pass(tmp_path, tiny_llama_dir, tiny_llama_perturbed_dir):
    """With --clear-suffix-index, a pass finds repeats only among its own requests: after the run the index
    holds the last pass's requests alone (the last configuration's "off"), not its "on" nor the first's too."""
    stack = await start_stack(tiny_llama_dir, tiny_llama_perturbed_dir, k=3, adaptive_k=True)
    try:
        code = await asyncio.to_thread(specmesh_main, [
            "bench", "--endpoint", f"127.0.0.1:{stack.port}", "--kinds", "repeat", "--ab", "--clear-suffix-index",
            "--max-concurrency", "1", "2", "--num-prompts", "4", "--max-tokens", "4", "--num-warmups", "0",
            "--no-progress", "--result-dir", str(tmp_path)])
        admin = admin_pb2_grpc.AdminStub(stack.channel)
        state = await admin.ClearSuffixIndex(admin_pb2.ClearSuffixIndexRequest(), timeout=WORK_TIMEOUT_S)
    finally:
        await stack.stop()
    assert code == 0
    assert state.enabled and state.cleared_documents == 4 and state.documents == 0 and state.bytes == 0
