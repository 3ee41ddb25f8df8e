"""What a service computes in: the `--dtype` names, and int8 weights for a draft on CPU.

`int8` keeps each Linear layer's weight as int8 with one scale per output channel and
computes in bfloat16 (torch's own `_weight_int8pack_mm` CPU kernel): a quarter of the weight
bytes for about a point of top-1 agreement with the target (docs/design/cpu-kernels-and-precision.md).
Weight-only quantization keeps every row's result independent of the
other rows in a step (no activation scale shared across the batch), so batching stays as
reproducible as in bfloat16. It changes the model, so it is for the draft: the draft's
precision never changes the output, only acceptance and speed. `auto` picks it for a CPU
with native bf16; on another CPU it times a one-row step in int8 (bf16 emulated, but a quarter
of the weight bytes) and in float32 on its faster kernel, and keeps the faster; on a GPU `auto`
is bfloat16 where native, else float32.

torchao's `Int8WeightOnlyConfig` is the library way to do this, but it ran the draft slower than
bfloat16 on the CPUs we measured; the kernel below is the one torch ships.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch

from specmesh.loading.cpu_linear import OneDnnLinear, choose_cpu_linear
from specmesh.timing_noise import PICK_GAIN

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
INT8 = "int8"  # int8 weights, bfloat16 compute (CPU)
DTYPE_CHOICES = ["auto", *DTYPES, INT8]
DTYPE_HELP = ("auto: on a CPU int8 weights (with native bf16, or where they run faster than float32), "
              "else float32; on a GPU bfloat16 where native, else float32; int8: int8 weights with bfloat16 "
              "compute, CPU only")


@dataclass(frozen=True)
class Precision:
    dtype: torch.dtype  # what activations (and unquantized weights) are in
    # Linear weights as int8 per output channel (Int8WeightLinear); None: whichever runs faster here
    int8_weights: bool | None = False


def native_bf16(device: str) -> bool:
    """Whether `device` computes bf16 natively (then bf16 beats fp32; emulated, it loses)."""
    if device.startswith("cuda") or device == "auto":  # auto: sharded over GPUs
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="ignore") as cpuinfo:
            flags = cpuinfo.read()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


def resolve_precision(name: str, device: str) -> Precision:
    """The precision `name` means on `device`; ValueError for int8 off the CPU."""
    on_cpu = device == "cpu"
    if name == "auto":
        if not native_bf16(device):
            return Precision(torch.float32, int8_weights=None if on_cpu else False)
        return Precision(torch.bfloat16, int8_weights=on_cpu)
    if name == INT8:
        if not on_cpu:
            raise ValueError(f"dtype int8 (int8 weights) runs on the CPU only, not on {device!r}")
        return Precision(torch.bfloat16, int8_weights=True)
    return Precision(DTYPES[name])


def resolve_dtype(name: str, device: str) -> torch.dtype:
    """The torch dtype that `name` computes in on `device`."""
    return resolve_precision(name, device).dtype


class Int8WeightLinear(torch.nn.Module):
    """A Linear layer whose weight [out, in] is int8 with a scale per output channel."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        weight = linear.weight.detach().float()  # [out, in]
        scales = weight.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127  # [out]
        self.register_buffer("qweight", (weight / scales[:, None]).round().clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scales.to(linear.weight.dtype))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        rows = x.reshape(-1, self.in_features).contiguous()
        y = torch._weight_int8pack_mm(rows, self.qweight, self.scales.to(rows.dtype))
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)


def quantize_int8_weights(model: torch.nn.Module) -> int:
    """Replace every Linear layer of `model` by an Int8WeightLinear; returns how many.

    A tied output projection gets its own int8 copy, so the input embedding keeps its
    weights (an embedding lookup gains nothing from int8).
    """
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(parent, name, Int8WeightLinear(child))
                replaced += 1
    return replaced


def load_model_in(spec: str, device: str, dtype_name: str, cpu_linear: str | None = None,
                  trust_remote_code: bool = False):
    """(model, tokenizer) of `spec` on `device` in the precision `dtype_name` names, its float32
    Linear layers on the `cpu_linear` kernel (specmesh.loading.cpu_linear; None: left to the caller)."""
    from specmesh.loading import models

    precision = resolve_precision(dtype_name, device)
    model, tokenizer = models.load_model(spec, device=device, dtype=precision.dtype,
                                         trust_remote_code=trust_remote_code)
    if precision.int8_weights is None:  # it chooses the float32 kernel as it times it
        return int8_if_faster(model, cpu_linear or "auto", device), tokenizer
    if precision.int8_weights:
        layers = quantize_int8_weights(model)
        logger.info("%s: int8 weights in %d linear layers, computed in %s", spec, layers, precision.dtype)
    if cpu_linear is not None:
        choose_cpu_linear(model, cpu_linear, device)
    return model, tokenizer


def int8_if_faster(model: torch.nn.Module, kernels: str, device: str,
                   step_s: Callable[[torch.nn.Module], float] | None = None) -> torch.nn.Module:
    """`model` (float32) on its faster kernel, or an int8-weight copy of it computed in bf16, whichever
    runs a one-row step faster here by at least 1 - PICK_GAIN."""
    step_s = step_s or one_row_step_s
    int8 = copy.deepcopy(model)
    quantize_int8_weights(int8)
    int8 = int8.to(torch.bfloat16)
    choose_cpu_linear(model, kernels, device)
    seconds = {"float32": step_s(model), "int8": step_s(int8)}
    logger.info("one-row step: float32 %.1f ms, int8 weights %.1f ms", seconds["float32"] * 1e3, seconds["int8"] * 1e3)
    return int8 if seconds["int8"] < PICK_GAIN * seconds["float32"] else model


def loaded_as(model: torch.nn.Module) -> tuple[str, str]:
    """(precision, cpu_linear) that `model` runs in, as --dtype and --cpu-linear name them once resolved:
    what another process passes load_model_in to run the same weights on the same kernels."""
    modules = list(model.modules())
    if any(isinstance(module, Int8WeightLinear) for module in modules):
        precision = INT8
    else:
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        precision = next((name for name, known in DTYPES.items() if known == dtype), str(dtype).removeprefix("torch."))
    return precision, "onednn" if any(isinstance(module, OneDnnLinear) for module in modules) else "torch"


@torch.no_grad()  # not inference_mode: a model timed here may be trained next (specmesh distill)
def one_row_step_s(model: torch.nn.Module, repeats: int = 3) -> float:
    """The fastest of `repeats` one-token forwards (after one to warm up): a decode step's weight pass."""
    ids = torch.ones((1, 1), dtype=torch.long, device=output_device(model))
    best = float("inf")
    for attempt in range(repeats + 1):
        start = time.perf_counter()
        model(input_ids=ids, use_cache=False)
        if ids.device.type == "cuda":  # kernels run asynchronously: wait for them, not for their launch
            torch.cuda.synchronize(ids.device)
        if attempt:
            best = min(best, time.perf_counter() - start)
    return best


def output_rows(model) -> int:
    """Rows of the model's output projection (its vocabulary), whatever module holds it."""
    return int(model.get_output_embeddings().out_features)


def output_device(model) -> torch.device:
    """Where the model's output projection computes (a sharded model may put it apart)."""
    head = model.get_output_embeddings()
    tensor = next(head.parameters(), None)
    if tensor is None:
        tensor = next(head.buffers())
    return tensor.device
