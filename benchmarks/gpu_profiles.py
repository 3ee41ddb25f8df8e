"""Step times of GPU serving, as tables an emulated (CPU) benchmark pair pads its forwards to.

Benchmark-only: `set_acceptance_pair.py --profile NAME` writes a profile's target table into the
target's config and its draft table into each draft's config; `modeling_set_acceptance.py` then sleeps
each forward up to the table's time. Nothing in the serving path reads these.

A table is (rows, ms) points: piecewise-linear between them, flat before the first, the last segment
extended past the last. A step of `sessions` sessions (one ragged forward) costs the table at its total
rows plus `per_session_ms` for each session after the first: the weights are read once per step
whatever the sessions, but attention reads every session's own KV cache.

Per-session increments are that KV read, at CONTEXT_TOKENS of context per session, at H100 HBM3
bandwidth: small at these contexts (tenths of a millisecond at most), which is why batching pays.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

H100_HBM_BYTES_PER_S = 3.35e12  # H100 SXM5 datasheet: HBM3 3.35 TB/s
CONTEXT_TOKENS = 1536  # a session's cached context assumed for the per-session increment (prompt + output)


@dataclass(frozen=True)
class StepTable:
    points: tuple[tuple[int, float], ...]  # (rows, ms), rows strictly increasing
    per_session_ms: float = 0.0  # added for each session after the first in one step

    def __post_init__(self):
        rows = [r for r, _ in self.points]
        if not rows or rows[0] < 1 or any(b <= a for a, b in zip(rows, rows[1:])):
            raise ValueError(f"points need rows >= 1, strictly increasing: {self.points}")
        if any(ms <= 0 for _, ms in self.points) or self.per_session_ms < 0:
            raise ValueError(f"step times must be positive: {self}")

    def ms(self, rows: int, sessions: int = 1) -> float:
        """The step's time in ms for `rows` input rows (padding included) over `sessions` sessions."""
        return self._rows_ms(rows) + self.per_session_ms * max(0, sessions - 1)

    def _rows_ms(self, rows: int) -> float:
        xs = [r for r, _ in self.points]
        if len(xs) == 1 or rows <= xs[0]:
            return self.points[0][1]
        upper = min(bisect.bisect_left(xs, rows), len(xs) - 1)  # past the last point: the last segment
        (x0, y0), (x1, y1) = self.points[upper - 1], self.points[upper]
        return y0 + (y1 - y0) * (rows - x0) / (x1 - x0)


@dataclass(frozen=True)
class Profile:
    name: str
    target: StepTable
    draft: StepTable
    sources: tuple[str, ...]  # the published measurements and the arithmetic the numbers come from


def scaled(table: StepTable, time_scale: float) -> StepTable:
    """The table with every time multiplied by `time_scale`: a slower copy of the same GPU, for a host whose
    smallest real forward would overrun the profile's shortest step. Speedups and their bounds are ratios
    of step times and link delays, so stretching both alike leaves them as they were; what does not stretch
    is the CPU's own per-round work, which then weighs less than it would at the profile's own times."""
    if not time_scale > 0:
        raise ValueError(f"time_scale must be > 0, not {time_scale}")
    return StepTable(tuple((rows, ms * time_scale) for rows, ms in table.points), table.per_session_ms * time_scale)


def to_config(table: StepTable) -> dict:
    """The table as a model config's `step_profile` (JSON: lists, not tuples)."""
    return {"points": [[rows, ms] for rows, ms in table.points], "per_session_ms": table.per_session_ms}


def from_config(config: dict) -> StepTable:
    return StepTable(points=tuple((int(rows), float(ms)) for rows, ms in config["points"]),
                     per_session_ms=float(config.get("per_session_ms", 0.0)))


def kv_read_ms(kv_bytes_per_token: int, gpus: int = 1) -> float:
    """One session's KV read per step, per GPU (tensor parallelism splits the KV heads)."""
    return kv_bytes_per_token / gpus * CONTEXT_TOKENS / H100_HBM_BYTES_PER_S * 1e3


# KV bytes per token in bf16: 2 (K and V) * layers * KV heads * head dim * 2 bytes, from the models' configs.
LLAMA3_8B_KV = 2 * 32 * 8 * 128 * 2  # 128 KiB
QWEN25_05B_KV = 2 * 24 * 2 * 64 * 2  # 12 KiB
LLAMA3_70B_KV = 2 * 80 * 8 * 128 * 2  # 320 KiB
LLAMA32_1B_KV = 2 * 16 * 8 * 64 * 2  # 32 KiB

H100_8B = Profile(
    name="h100-8b",
    # Decode (1-16 rows) is weight-read bound: 6 ms. From 16 rows the GEMMs leave the bandwidth floor
    # gently (6.5 ms at 64, 7.5 at 256); prefill is compute bound: ~14 GFLOP/token at ~700 TFLOP/s
    # effective bf16 is 0.02 ms/token, plus ~1.5 ms fixed: 11.7 ms at 512 rows, 22 ms at 1024, and the
    # last segment's 0.02 ms/row beyond.
    target=StepTable(((1, 6.0), (16, 6.0), (64, 6.5), (256, 7.5), (512, 11.7), (1024, 22.0)),
                     per_session_ms=kv_read_ms(LLAMA3_8B_KV)),
    # A 0.5B draft with CUDA graphs is launch bound near 1 ms up to tens of rows; its prefill is ~1
    # GFLOP/token at ~330 TFLOP/s (small GEMMs run far below peak): 0.003 ms/row, 4 ms at 1024 rows.
    # At every row count the draft's step stays >= 0.15 of the target's (1/6 at decode).
    draft=StepTable(((1, 1.0), (64, 1.0), (256, 1.6), (1024, 4.0)), per_session_ms=kv_read_ms(QWEN25_05B_KV)),
    sources=(
        "gpt-fast README (pytorch-labs/gpt-fast): Llama-2-7B bf16 104.9 tok/s at batch 1 on one A100-80GB "
        "(9.5 ms/step, 1397 GB/s effective of ~1700 GB/s peak): a compiled step runs at ~80% of bandwidth",
        "H100 SXM5 datasheet: HBM3 3.35 TB/s, 989 TFLOP/s dense bf16; a 7-8B bf16 step reads ~15 GB: "
        "4.5 ms bound, 6-7 ms served (an estimate)",
        "a 0.5B draft with CUDA graphs is launch bound near 1 ms (an estimate); its weights read in "
        "~0.3 ms (1 GB at 3.35 TB/s)",
        "per-session KV read: Llama-3-8B 128 KiB/token, Qwen2.5-0.5B 12 KiB/token (model configs), "
        f"{CONTEXT_TOKENS} tokens of context at 3.35 TB/s",
    ),
)

H100X8_70B = Profile(
    name="h100x8-70b",
    # Decode: 20 ms. gpt-fast measured 16 ms/step (62.5 tok/s) for Llama-2-70B bf16 TP8 on 8 power-limited
    # A100s, compiled, batch 1, a 5-token prompt: the floor of a hand-tuned step. H100 bandwidth alone
    # would take it to ~10 ms, but 160 all-reduces per step do not shrink as fast, and serving engines
    # add scheduling and sampling to each step (6-7 ms served against 4.5 bound for the 8B): 20 ms, the
    # low end of the 20-30 ms served range. Prefill: ~140 GFLOP/token over 8 GPUs at ~500 TFLOP/s each
    # is 0.035 ms/token: 50 ms at 1024 rows, ~0.033 ms/row beyond.
    target=StepTable(((1, 20.0), (16, 20.0), (64, 21.0), (256, 25.0), (1024, 50.0)),
                     per_session_ms=kv_read_ms(LLAMA3_70B_KV, gpus=8)),
    # A 1B draft (Llama-3.2-1B class) inside the target's TP group pays that group's all-reduces on
    # each of its 16 layers: 2.5 ms, an eighth of the target's step. Prefill ~2.5 GFLOP/token: 6 ms at 1024.
    draft=StepTable(((1, 2.5), (64, 2.5), (256, 3.0), (1024, 6.0)), per_session_ms=kv_read_ms(LLAMA32_1B_KV)),
    sources=(
        "gpt-fast README (pytorch-labs/gpt-fast), tensor parallelism: Llama-2-70B bf16 62.50 tok/s on "
        "8xA100-80GB at batch 1 (16 ms/step, 1135 GB/s effective per GPU)",
        "vLLM RFC #42109: a 1-8B draft adds 10-30% to a TP2 70B step: a 1B draft at the "
        "low end, 2-2.5 ms against 20 ms",
        "SGLang decoupled drafter PR #22520: 70B TP8 + 1B draft 1.81-1.91x at batch 1-16; "
        "the sequential bound at t=20 ms, d=2.5 ms is 1.85x (k=4) at alpha 0.7 (alpha assumed, not in the PR notes)",
        "per-session KV read: Llama-3-70B 320 KiB/token split over 8 GPUs, Llama-3.2-1B 32 KiB/token "
        f"(model configs), {CONTEXT_TOKENS} tokens of context at 3.35 TB/s",
    ),
)

PROFILES: dict[str, Profile] = {profile.name: profile for profile in (H100_8B, H100X8_70B)}
