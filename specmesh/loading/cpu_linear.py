"""Which kernel an fp32 Linear layer runs on the CPU: torch's default GEMM or oneDNN's, chosen by timing.

A decode or verification step multiplies a few rows by every weight of the model, so
its cost is how fast the GEMM streams the weights for small row counts. That depends
on the host: either kernel wins on some CPUs and row counts
(docs/design/cpu-kernels-and-precision.md). So `auto` times both
on the model's own layer shapes at start-up, for the row counts a step feeds, and keeps
the faster.

Either kernel sums in a different order than the other, and than itself for another row
count: a logit moves by about 1e-5 (fp32), the same order as batching already moves it
(docs/design/continuous-batching.md). Only float32 layers are converted: int8 layers
(specmesh.loading.precision) and other dtypes keep their own kernels.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

import torch

from specmesh.timing_noise import PICK_GAIN

logger = logging.getLogger(__name__)

KERNEL_CHOICES = ("auto", "onednn", "torch")
KERNEL_HELP = ("kernel of float32 Linear layers on a CPU: torch (its default GEMM), onednn (oneDNN's "
               "linear, weights in oneDNN's layout), or auto: time both on this model's layers at "
               "start-up and keep the faster")
TIMED_ROWS = (1, 2, 4, 8)  # what decode and verification steps feed
REPEATS = 3  # the fastest of these (noise only ever adds time)
PACK_ROWS = 16  # the batch size oneDNN lays the packed weight out for (smaller layouts ran slower: tuning.md)
# oneDNN builds (JIT-compiles) and caches a primitive per input shape, in two caches of 1024 entries each
# (its own, and ideep's computation cache), ~0.6-1.6 MB an entry: fed every row count a ragged step makes,
# a process grew by hundreds of MB (430 -> 828 MB over 1,200 streams). So a layer only ever runs these
# row counts: exact up to EXACT_ROWS (decode and verification steps), else padded up to a multiple of
# ROW_STEP, and more than CHUNK_ROWS rows go in CHUNK_ROWS-row chunks (a chunk that size is already
# compute-bound, so the extra weight passes cost little). That is 15 shapes a layer, whatever the load.
EXACT_ROWS = 8
ROW_STEP = 8
CHUNK_ROWS = 64


class OneDnnLinear(torch.nn.Module):
    """A float32 Linear layer computed by oneDNN from a weight packed once into oneDNN's blocked
    layout for batches of about PACK_ROWS rows.

    The packed layout is what makes several rows cheap (docs/design/cpu-kernels-and-precision.md).
    """

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # [out, in] in oneDNN's blocked layout: an opaque tensor that only this op reads
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), PACK_ROWS))
        self.register_buffer("bias", linear.bias.detach() if linear.bias is not None else None)  # [out]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        rows = x.reshape(-1, self.in_features)  # [rows, in]
        chunks = [self._bounded(rows[start:start + CHUNK_ROWS])
                  for start in range(0, rows.shape[0], CHUNK_ROWS)]
        y = chunks[0] if len(chunks) == 1 else torch.cat(chunks)  # [rows, out]
        return y.reshape(*x.shape[:-1], self.out_features)

    def _bounded(self, rows: torch.Tensor) -> torch.Tensor:
        """[n, in] with n <= CHUNK_ROWS -> [n, out], computed at a row count of bounded_rows(n)."""
        n = rows.shape[0]
        padded = bounded_rows(n)
        if padded != n:  # pad rows are zeros; each output row depends on its own input row only
            rows = torch.nn.functional.pad(rows, (0, 0, 0, padded - n))
        return linear_pointwise(rows.contiguous(), self.packed_weight, self.bias)[:n]


def bounded_rows(n: int) -> int:
    """The row count a chunk of n <= CHUNK_ROWS rows runs at (see EXACT_ROWS)."""
    return n if n <= EXACT_ROWS else -(-n // ROW_STEP) * ROW_STEP


def linear_pointwise(rows: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's linear: [rows, in] (contiguous) x the packed [out, in] weight -> [rows, out]."""
    return torch.ops.mkldnn._linear_pointwise(rows, packed_weight, bias, "none", [], "")


def onednn_usable(device: str) -> bool:
    return device == "cpu" and torch.backends.mkldnn.is_available()


def _fp32_linears(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.nn.Linear]]:
    """(parent, attribute, layer) of every float32 Linear layer of `model`."""
    return [(parent, name, child) for parent in list(model.modules())
            for name, child in list(parent.named_children())
            if isinstance(child, torch.nn.Linear) and child.weight.dtype == torch.float32]


def use_onednn(model: torch.nn.Module) -> int:
    """Replace every float32 Linear layer by a OneDnnLinear; returns how many. A tied output
    projection gets its own copy (the input embedding keeps its weights)."""
    layers = _fp32_linears(model)
    for parent, name, linear in layers:
        setattr(parent, name, OneDnnLinear(linear))
    return len(layers)


def _fastest_seconds(kernels: dict[str, torch.nn.Module], rows: int, width: int) -> dict[str, float]:
    """The fastest of REPEATS calls of each kernel on `rows` rows, the kernels taking turns call by
    call, so a disturbance (another process starting beside this one) slows both alike."""
    x = torch.randn(rows, width)  # [rows, in]
    best = {name: float("inf") for name in kernels}
    for name, forward in kernels.items():
        forward(x)  # the first call pays one-time costs (kernel selection)
    for _ in range(REPEATS):
        for name, forward in kernels.items():
            start = time.perf_counter()
            forward(x)
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def time_kernels(model: torch.nn.Module) -> dict[str, float]:
    """Seconds of one pass over every float32 Linear layer at each of TIMED_ROWS, per kernel
    (each distinct shape timed once, counted as often as the model has it)."""
    shapes = Counter((linear.out_features, linear.in_features) for _, _, linear in _fp32_linears(model))
    first = {}
    for _, _, linear in _fp32_linears(model):
        first.setdefault((linear.out_features, linear.in_features), linear)
    totals = {"torch": 0.0, "onednn": 0.0}
    with torch.inference_mode():
        for shape, count in shapes.items():
            kernels = {"torch": first[shape], "onednn": OneDnnLinear(first[shape])}
            for rows in TIMED_ROWS:
                for name, seconds in _fastest_seconds(kernels, rows, shape[1]).items():
                    totals[name] += count * seconds
    return totals


def choose_cpu_linear(model: torch.nn.Module, kernels: str, device: str) -> str:
    """Put `model`'s float32 Linear layers on the kernel `kernels` names (auto: the faster here);
    returns the kernel they run. ValueError for onednn where oneDNN cannot run."""
    if kernels not in KERNEL_CHOICES:
        raise ValueError(f"cpu linear kernel must be one of {', '.join(KERNEL_CHOICES)}, not {kernels!r}")
    if kernels == "onednn" and not onednn_usable(device):
        raise ValueError(f"cpu linear kernel onednn needs a CPU with oneDNN, not device {device!r}")
    if kernels == "torch" or not onednn_usable(device) or not _fp32_linears(model):
        return "torch"
    if kernels == "auto":
        totals = time_kernels(model)
        logger.info("float32 linear layers, one pass at rows %s: torch %.1f ms, onednn %.1f ms",
                    TIMED_ROWS, totals["torch"] * 1e3, totals["onednn"] * 1e3)
        if totals["onednn"] >= PICK_GAIN * totals["torch"]:
            return "torch"
    logger.info("oneDNN linear in %d float32 layers", use_onednn(model))
    return "onednn"
