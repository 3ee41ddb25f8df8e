"""int8 draft weights (specmesh.loading.precision): close to the layer they replace, every row independent of
the others in a step, and served losslessly (the target still decides every token)."""

from __future__ import annotations

import asyncio
import copy

import grpc
import pytest
import torch

from engine_helpers import session_over
from harness import make_engine, start_model_server, start_stack
from orchestrator.bench.peer import PeerPair
from parity import target_greedy
from specmesh.engine.batching import Part
from specmesh.loading.precision import (Int8WeightLinear, Precision, int8_if_faster, load_model_in, loaded_as,
                                        native_bf16, one_row_step_s, quantize_int8_weights, resolve_precision)
from specmesh.v1 import common_pb2, target_pb2_grpc
from benchmarks.tiny_models import TINY_PROMPTS


def bf16_linear(inputs: int, outputs: int, bias: bool = True) -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(inputs, outputs, bias=bias).to(torch.bfloat16)


def bf16_ulp(magnitude: torch.Tensor) -> float:
    """The spacing of bfloat16 numbers at `magnitude` (8 significant bits)."""
    return 2.0 ** (torch.floor(torch.log2(magnitude)).item() - 7)


@pytest.mark.parametrize("bias", [True, False])
def test_an_int8_layer_stays_close_to_the_layer_it_replaces(bias):
    linear = bf16_linear(64, 96, bias)
    quantized = Int8WeightLinear(linear)
    assert quantized.qweight.dtype == torch.int8 and quantized.qweight.shape == (96, 64)
    x = torch.randn(2, 5, 64, dtype=torch.bfloat16)  # [batch, rows, in]
    expected, got = linear(x).float(), quantized(x).float()  # [2, 5, 96]
    assert got.shape == expected.shape
    relative = (got - expected).norm() / expected.norm()
    assert 0 < relative < 0.02  # quantized (not a copy), and per-channel scales keep it close


def test_an_int8_layer_computes_each_row_as_if_alone():
    quantized = Int8WeightLinear(bf16_linear(64, 96))
    rows = torch.randn(9, 64, dtype=torch.bfloat16)
    together = quantized(rows)  # [9, 96]
    for i in (0, 4, 8):
        assert torch.equal(quantized(rows[i: i + 1])[0], together[i])


def test_quantizing_a_model_replaces_every_linear_layer_and_keeps_the_embedding(tiny_llama_dir):
    model, _ = load_model_in(str(tiny_llama_dir), "cpu", "bfloat16")
    embedding = model.get_input_embeddings().weight.detach().clone()
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert quantize_int8_weights(model) == linears > 0
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert torch.equal(model.get_input_embeddings().weight, embedding)


def test_precision_names():
    assert resolve_precision("float32", "cpu") == Precision(torch.float32)
    assert resolve_precision("bfloat16", "cpu") == Precision(torch.bfloat16)
    assert resolve_precision("int8", "cpu") == Precision(torch.bfloat16, int8_weights=True)
    # auto: int8 weights where the CPU computes bf16 natively; elsewhere timed against float32 at load
    assert resolve_precision("auto", "cpu").int8_weights == (True if native_bf16("cpu") else None)
    with pytest.raises(ValueError, match="CPU only"):
        resolve_precision("int8", "cuda")


def test_a_ragged_step_of_an_int8_model_gives_each_session_its_solo_logits(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, "cpu", "draft", dtype="int8")
    assert engine.ragged and engine.vocab_size == engine.model.config.vocab_size
    sequences = [list(range(5, 30)), list(range(40, 47)), list(range(60, 61))]
    sessions = [session_over(engine, seq, cached) for seq, cached in zip(sequences, (20, 6, 0))]
    new_rows = [seq[s.cached_length:] + [7, 8] for seq, s in zip(sequences, sessions)]
    solo = [copy.deepcopy(s) for s in sessions]
    batched, _ = engine._run_step([Part(s, rows, len(rows)) for s, rows in zip(sessions, new_rows)])
    for alone, rows, logits in zip(solo, new_rows, batched):
        expected = engine.forward(alone, rows, len(rows))[0]  # [rows, V]
        # bf16 attention in a batched step (query heads packed per key/value head) rounds a little
        # differently (an unquantized bf16 model differs by one unit in the last place here too);
        # the int8 weights add nothing
        assert (logits - expected).abs().max() <= 2 * bf16_ulp(expected.abs().max())
        assert torch.equal(logits.argmax(-1), expected.argmax(-1))


async def test_an_int8_draft_is_lossless_under_batching(tiny_llama_dir, tiny_llama_perturbed_dir):
    """Greedy outputs under batching equal the target's own generate; a seeded sampled request
    reproduces when run again alone. (Beside other requests it may not, bit for bit: the draft's
    bf16 attention rounds by layout, as an unquantized bf16 draft's does. docs/design/cpu-kernels-and-precision.md.)"""
    stack = await start_stack(tiny_llama_dir, tiny_llama_perturbed_dir, k=3, draft_dtype="int8")
    assert isinstance(stack.draft_engine.model.get_output_embeddings(), Int8WeightLinear)
    try:
        requests = [dict(prompt=TINY_PROMPTS[i % len(TINY_PROMPTS)], max_tokens=10 + (i * 7) % 23,
                         num_speculative_tokens=1 + i % 4, temperature=0.0) for i in range(12)]
        results = await asyncio.gather(*(stack.generate(**r) for r in requests))
        seeded = dict(prompt=TINY_PROMPTS[1], max_tokens=24, temperature=0.9, seed=2024)
        first, again = await stack.generate(**seeded), await stack.generate(**seeded)
    finally:
        await stack.stop()
    accepted = 0
    for i, (r, (token_ids, _, response)) in enumerate(zip(requests, results)):
        assert tuple(token_ids) == target_greedy(str(tiny_llama_dir), "cpu", r["prompt"], r["max_tokens"]), i
        accepted += response.stats.accepted_tokens
    assert accepted > 0  # the int8 draft's proposals were used, not only the target's
    assert stack.draft_engine.scheduler.batched_steps > 0
    assert first[0] == again[0] and first[2].stats.draft_tokens > 0


@pytest.mark.parametrize("float32_s, int8_s, picked", [(0.100, 0.060, "int8"), (0.100, 0.095, "float32"),
                                                       (0.060, 0.100, "float32")])
def test_auto_without_native_bf16_keeps_whichever_runs_a_step_faster(tiny_llama_dir, float32_s, int8_s, picked):
    """Timings injected: int8 weights only for a step at least 10 % faster than float32 (a smaller gap is noise)."""
    model, _ = load_model_in(str(tiny_llama_dir), "cpu", "float32")

    def step_s(candidate) -> float:
        return int8_s if isinstance(candidate.get_output_embeddings(), Int8WeightLinear) else float32_s

    chosen = int8_if_faster(model, "torch", "cpu", step_s)
    is_int8 = any(isinstance(m, Int8WeightLinear) for m in chosen.modules())
    assert is_int8 == (picked == "int8")
    assert (chosen is model) == (picked == "float32")  # the float32 model itself, not a copy
    if is_int8:
        assert not any(isinstance(m, torch.nn.Linear) for m in chosen.modules())
        assert chosen.get_input_embeddings().weight.dtype == torch.bfloat16


def test_a_one_row_step_is_timed_on_the_real_model(tiny_llama_dir):
    model, _ = load_model_in(str(tiny_llama_dir), "cpu", "float32")
    assert 0 < one_row_step_s(model, repeats=2) < 10


@pytest.mark.parametrize("dtype, cpu_linear", [("float32", "torch"), ("float32", "onednn"), ("bfloat16", "torch"),
                                               ("int8", "torch")])
async def test_a_service_reports_what_it_runs_and_the_peer_loaded_from_the_report_runs_the_same(
        tiny_llama_dir, dtype, cpu_linear):
    """ModelInfo's precision and cpu_linear name what the model runs once `auto` is resolved; the bench's peer,
    loaded from them, runs the same weights on the same kernels."""
    engine = make_engine(tiny_llama_dir, dtype=dtype, cpu_linear=cpu_linear)
    server, port = await start_model_server("target", engine)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            info = await target_pb2_grpc.TargetServiceStub(channel).GetModelInfo(common_pb2.ModelInfoRequest(), timeout=30)
    finally:
        await server.stop(None)
    assert (info.precision, info.cpu_linear) == (dtype, cpu_linear)
    peer = PeerPair.load(str(tiny_llama_dir), str(tiny_llama_dir), "cpu", None, info.precision, "float32",
                         info.cpu_linear, "onednn")
    assert loaded_as(peer.target) == (dtype, cpu_linear)
    assert loaded_as(peer.draft) == ("float32", "onednn")  # each model its own kernel
