"""specmesh.loading.cpu_linear: oneDNN's linear computes what torch's does, and the kernel choice is the service's."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest
import torch

from specmesh.loading import cpu_linear
from specmesh.loading.cpu_linear import CHUNK_ROWS, OneDnnLinear, choose_cpu_linear, onednn_usable, time_kernels
from specmesh.loading.precision import load_model_in, quantize_int8_weights

pytestmark = pytest.mark.skipif(not onednn_usable("cpu"), reason="this torch has no oneDNN")


@pytest.mark.unit
@pytest.mark.parametrize("bias", [True, False])
def test_onednn_linear_computes_what_torch_linear_does(bias):
    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 80, bias=bias)
    onednn = OneDnnLinear(linear)
    # one row, a step's rows, [batch, positions, hidden], more rows than the weight is packed for
    for shape in [(1, 48), (5, 48), (2, 3, 48), (40, 48)]:
        x = torch.randn(*shape)
        with torch.inference_mode():
            got, want = onednn(x), linear(x)
        assert got.shape == want.shape and got.dtype == torch.float32
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    strided = torch.randn(48, 6).t()  # [6, 48], not contiguous (a slice of a wider hidden state)
    with torch.inference_mode():
        assert torch.allclose(onednn(strided), linear(strided), atol=1e-5, rtol=1e-5)


@pytest.mark.unit
def test_onednn_linear_runs_few_row_counts_whatever_it_is_fed(monkeypatch):
    """oneDNN builds and caches a primitive per row count: a layer fed every count from 1 to 300 (what
    ragged steps feed) runs only a bounded few, and still computes what torch's layer does."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 80)
    onednn, ran = OneDnnLinear(linear), set()

    def recording(rows, packed_weight, bias):
        ran.add(rows.shape[0])
        return linear_pointwise(rows, packed_weight, bias)
    linear_pointwise = cpu_linear.linear_pointwise
    monkeypatch.setattr(cpu_linear, "linear_pointwise", recording)
    with torch.inference_mode():
        for rows in range(1, 301):
            x = torch.randn(rows, 48)
            assert torch.allclose(onednn(x), linear(x), atol=1e-5, rtol=1e-5), rows
    assert max(ran) <= CHUNK_ROWS and len(ran) <= 15, sorted(ran)


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads the resident set from /proc")
def test_onednn_layers_fed_ragged_row_counts_keep_their_memory_flat():
    """Fed a different row count each call, as served steps are, the process's memory stays flat
    (unbounded, oneDNN's per-shape caches grew it by hundreds of MB)."""
    random.seed(0)
    layers = [OneDnnLinear(torch.nn.Linear(264, 1032)), OneDnnLinear(torch.nn.Linear(1032, 264))]

    def step(rows: int) -> None:
        layers[1](layers[0](torch.randn(rows, 264)))
    with torch.inference_mode():
        for rows in range(1, CHUNK_ROWS + 1):  # every shape a layer runs, cached
            step(rows)
        before = _resident_mb()
        for _ in range(400):
            step(random.randint(1, 300))
    assert _resident_mb() - before < 64


def _resident_mb() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 / 2**20


def _logits(model, ids):
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0]  # [positions, vocab]


@pytest.mark.unit
def test_onednn_model_keeps_logits_and_greedy_output(tiny_qwen2_dir):
    reference, _ = load_model_in(str(tiny_qwen2_dir), "cpu", "float32")
    model, _ = load_model_in(str(tiny_qwen2_dir), "cpu", "float32")
    assert choose_cpu_linear(model, "onednn", "cpu") == "onednn"
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert not linears and isinstance(model.get_output_embeddings(), OneDnnLinear)
    ids = [3, 17, 5, 42, 8, 9, 11]
    assert (_logits(model, ids) - _logits(reference, ids)).abs().max().item() < 1e-4
    with torch.inference_mode():
        prompt = torch.tensor([ids])
        want = reference.generate(prompt, max_new_tokens=12, do_sample=False)
        got = model.generate(prompt, max_new_tokens=12, do_sample=False)
    assert got.tolist() == want.tolist()


@pytest.mark.unit
def test_torch_kernel_leaves_the_model_alone(tiny_qwen2_dir):
    model, _ = load_model_in(str(tiny_qwen2_dir), "cpu", "float32")
    before = [type(m) for m in model.modules()]
    assert choose_cpu_linear(model, "torch", "cpu") == "torch"
    assert [type(m) for m in model.modules()] == before


@pytest.mark.unit
def test_only_float32_linear_layers_change(tiny_qwen2_dir):
    """int8 layers (and other dtypes) keep their own kernels: there is nothing for oneDNN to take."""
    model, _ = load_model_in(str(tiny_qwen2_dir), "cpu", "float32")
    quantize_int8_weights(model)
    assert choose_cpu_linear(model, "onednn", "cpu") == "torch"
    assert not any(isinstance(m, OneDnnLinear) for m in model.modules())


@pytest.mark.unit
def test_auto_times_both_kernels_and_keeps_a_working_model(tiny_qwen2_dir, caplog):
    model, _ = load_model_in(str(tiny_qwen2_dir), "cpu", "float32")
    reference, _ = load_model_in(str(tiny_qwen2_dir), "cpu", "float32")
    totals = time_kernels(model)
    assert set(totals) == {"torch", "onednn"} and all(seconds > 0 for seconds in totals.values())
    with caplog.at_level(logging.INFO, logger="specmesh.loading.cpu_linear"):
        chosen = choose_cpu_linear(model, "auto", "cpu")
    assert "one pass at rows" in caplog.text
    assert chosen == ("onednn" if isinstance(model.get_output_embeddings(), OneDnnLinear) else "torch")
    ids = [1, 2, 3, 4]
    assert (_logits(model, ids) - _logits(reference, ids)).abs().max().item() < 1e-4


@pytest.mark.unit
def test_bad_kernel_names_and_devices_are_refused(tiny_qwen2_dir):
    model, _ = load_model_in(str(tiny_qwen2_dir), "cpu", "float32")
    with pytest.raises(ValueError, match="one of auto, onednn, torch"):
        choose_cpu_linear(model, "mkl", "cpu")
    with pytest.raises(ValueError, match="needs a CPU"):
        choose_cpu_linear(model, "onednn", "cuda")
    assert choose_cpu_linear(model, "auto", "cuda") == "torch"  # auto off the CPU: nothing to choose


@pytest.mark.unit
def test_a_service_loads_its_model_on_the_kernel_its_options_name(tiny_qwen2_dir):
    from specmesh.server.service import ServiceOptions, load_engine

    engine = load_engine(ServiceOptions(model=str(tiny_qwen2_dir), cpu_linear="onednn"), "target")
    assert isinstance(engine.model.get_output_embeddings(), OneDnnLinear)
    assert engine.costs is not None  # and it measured its step costs on that kernel
