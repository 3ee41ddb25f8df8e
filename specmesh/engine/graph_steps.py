"""Decode and verification steps of many sessions as one static-shape forward, replayed as a CUDA graph.

An eager step on a GPU costs its kernel launches and Python, not its arithmetic: at any row count,
many times what reading the weights once takes (figures: docs/design/gpu.md). Here
a step's sessions run as one batch [sessions, rows] over the preallocated KV (specmesh.engine.slot_cache):
every layer writes its new keys and values into each session's slot at the session's length, and
attends over the slots' first `span` positions under a mask built from the lengths. Shapes come in
buckets (sessions, rows and span rounded up), so on CUDA each bucket is captured once as a CUDA
graph and replayed: a step is then a few small host-to-device copies and one launch.

Padding: a session with fewer rows than its bucket repeats its last token; the extra rows write
past the session's length (overwritten by its next rows, never read first) and their logits are
dropped. Padding sessions read and write the scratch slot. Rows need `rows` spare positions past
a session's length, so the engine's context window is the slot length minus MAX_ROWS.

Elsewhere (CPU) the same static-shape forward runs eagerly, which is how the suite checks it
(greedy parity with the model's own generate); a shape whose capture fails runs eagerly too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from transformers import PreTrainedModel

from specmesh.engine.batching import Part
from specmesh.engine.kv_budget import KVBudget, model_devices
from specmesh.engine.ragged import NO_MASK
from specmesh.engine.slot_cache import SCRATCH_SLOT, SlotCache, SlotPool

log = logging.getLogger(__name__)
ROW_BUCKETS = (1, 2, 4, 8, 16)  # a verification of k drafts has k + 1 rows
MAX_ROWS = ROW_BUCKETS[-1]  # longer feeds (prefill chunks) run eagerly
SESSION_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # more sessions than the last: several steps
MIN_SPAN = 256  # positions attended per slot: powers of two from here up to the slot length
MIN_SLOT_LENGTH = 1024  # shorter slots would refuse ordinary prompts: a small budget holds fewer sessions instead
COMMON_SHAPES = [(sessions, rows) for sessions in (1, 2, 4, 8, 16) for rows in (1, 2, 4, 8)]  # captured at start
GRAPH_STEPS_CHOICES = ("auto", "on", "off")


def uses_graph_steps(setting: str, model: PreTrainedModel) -> bool:
    """Whether the setting turns graph steps on for this model: "auto" on CUDA. A model sharded over several
    devices (device "auto") steps eagerly: one pool per layer's device is not built."""
    if setting not in GRAPH_STEPS_CHOICES:
        raise ValueError(f"graph steps: {setting!r} is not one of {', '.join(GRAPH_STEPS_CHOICES)}")
    devices = model_devices(model)
    if setting == "off" or len(devices) > 1:
        if setting == "on":
            log.warning("graph steps off: the model is sharded over %d devices", len(devices))
        return False
    return setting == "on" or devices[0].type == "cuda"


def slot_shape(capacity_tokens: int, sessions: int, window: int) -> tuple[int, int]:
    """(slots, slot length) for a KV budget of `capacity_tokens`: a slot per session, a fifth more for the
    draft's forks of pre-drafted branches, each as long as the budget allows up to the model's window."""
    wanted = sessions + max(2, sessions // 5)
    slot_length = min(window + MAX_ROWS, max(MIN_SLOT_LENGTH, capacity_tokens // wanted))
    slots = min(wanted, capacity_tokens // slot_length)
    if slots < 2:
        raise ValueError(f"a KV budget of {capacity_tokens} tokens holds fewer than two slots of {slot_length}: "
                         f"raise --kv-cache-memory or turn graph steps off")
    return slots, slot_length


def slot_budget(model: PreTrainedModel, budget: KVBudget, max_sessions: int,
                window: int) -> tuple[KVBudget, "GraphSteps"]:
    """The pool that takes the whole KV budget, its graph steps, and the budget sessions now reserve from:
    a whole slot each, leaving the spare slots to forks and warm-up."""
    slots, slot_length = slot_shape(budget.capacity, max_sessions, window)
    pool = SlotPool.for_model(model, slots, slot_length)
    spare = max(1, min(slots - max_sessions, slots // 6))
    log.info("KV preallocated: %d slots of %d tokens (%d for sessions), %.2f GiB", slots, slot_length,
             slots - spare, slots * slot_length * budget.bytes_per_token / 2**30)
    sessions_budget = KVBudget((slots - spare) * slot_length, budget.max_waiting, budget.bytes_per_token)
    return sessions_budget, GraphSteps(model, pool)


def bucket(n: int, buckets: Sequence[int]) -> int:
    return next(size for size in buckets if size >= n)


def span_for(positions: int, slot_length: int) -> int:
    span = MIN_SPAN
    while span < positions:
        span *= 2
    return min(span, slot_length)


@dataclass
class SlotBatch:
    """What the attention of one static step reads: the pool, each batch row's slot and length."""

    pool: SlotPool
    slot_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N, R]: the rows' positions (the sessions' lengths onward)
    mask: torch.Tensor  # [N, 1, R, span] bool: row r of a session sees positions up to its own

    def attend(self, module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scaling: float | None) -> tuple[torch.Tensor, None]:
        """query [N, H, R, D], key and value [N, KVH, R, D] -> ([N, R, H, D], None)."""
        sessions, heads, rows, dim = query.shape
        kv_heads = key.shape[1]
        groups = heads // kv_heads
        keys, values = self.pool.keys[module.layer_idx], self.pool.values[module.layer_idx]
        slots = self.slot_ids[:, None].expand(sessions, rows)  # [N, R]
        keys[slots, :, self.positions] = key.transpose(1, 2)  # written in place: [N, R, KVH, D]
        values[slots, :, self.positions] = value.transpose(1, 2)
        span = self.mask.shape[-1]
        session_keys = keys[:, :, :span].index_select(0, self.slot_ids)  # [N, KVH, span, D]
        session_values = values[:, :, :span].index_select(0, self.slot_ids)
        packed = query.reshape(sessions, kv_heads, groups * rows, dim)  # a KV head's query heads as rows
        mask = self.mask.repeat(1, 1, groups, 1)  # [N, 1, groups * R, span], row g * R + r is row r
        out = torch.nn.functional.scaled_dot_product_attention(packed, session_keys, session_values,
                                                               attn_mask=mask, scale=scaling)
        return out.reshape(sessions, heads, rows, dim).transpose(1, 2).contiguous(), None


def static_step(model: PreTrainedModel, pool: SlotPool, input_ids: torch.Tensor, slot_ids: torch.Tensor,
                lengths: torch.Tensor, span: int, no_mask: torch.Tensor) -> torch.Tensor:
    """input_ids [N, R], slot_ids and lengths [N] -> logits [N, R, V]; only device work, so capturable."""
    rows = input_ids.shape[1]
    positions = lengths[:, None] + torch.arange(rows, device=input_ids.device)  # [N, R]
    seen = torch.arange(span, device=input_ids.device)[None, None, :] <= positions[:, :, None]  # [N, R, span]
    batch = SlotBatch(pool, slot_ids, positions, seen[:, None])
    output = model(input_ids=input_ids, position_ids=positions, attention_mask=no_mask, use_cache=False,
                   slot_batch=batch)
    return output.logits


class CapturedStep:
    """One bucket's static_step captured as a CUDA graph over static input buffers."""

    def __init__(self, model: PreTrainedModel, pool: SlotPool, sessions: int, rows: int, span: int,
                 memory_pool) -> None:
        device = pool.keys[0].device
        self.input_ids = torch.zeros(sessions, rows, dtype=torch.long, device=device)
        self.slot_ids = torch.full((sessions,), SCRATCH_SLOT, dtype=torch.long, device=device)
        self.lengths = torch.zeros(sessions, dtype=torch.long, device=device)
        no_mask = NO_MASK.to(device)

        def run() -> torch.Tensor:  # while capturing, every row writes the scratch slot
            return static_step(model, pool, self.input_ids, self.slot_ids, self.lengths, span, no_mask)

        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # allocator and kernel choices settle before the capture
            run()
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: a CUDA call on another thread (a servicer's) neither breaks the capture nor fails
        with torch.cuda.graph(self.graph, pool=memory_pool, capture_error_mode="thread_local"):
            self.logits = run()

    def __call__(self, input_ids: torch.Tensor, slot_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        self.input_ids.copy_(input_ids, non_blocking=True)
        self.slot_ids.copy_(slot_ids, non_blocking=True)
        self.lengths.copy_(lengths, non_blocking=True)
        self.graph.replay()
        return self.logits


class GraphSteps:
    """Runs the decode parts of a step (each at most MAX_ROWS rows, in a SlotCache) as static steps."""

    def __init__(self, model: PreTrainedModel, pool: SlotPool):
        self.model, self.pool = model, pool
        self.device = pool.keys[0].device
        self.capture = self.device.type == "cuda"
        self.memory_pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.captured: dict[tuple[int, int, int], CapturedStep | None] = {}  # None: capture failed, eager
        self.no_mask = NO_MASK.to(self.device)
        self.steps = 0  # static steps run (each of up to SESSION_BUCKETS[-1] sessions per bucket)

    @property
    def context_window(self) -> int:
        """Tokens a session may hold: the slot, less the rows a padded step writes past a session's length."""
        return self.pool.slot_length - MAX_ROWS

    @torch.inference_mode()
    def capture_common_shapes(self) -> None:
        """Capture the usual decode shapes before serving, so no request waits for a capture."""
        if self.capture:
            for sessions, rows in COMMON_SHAPES:
                self._runner(sessions, rows, span_for(rows, self.pool.slot_length))

    def fits(self, part: Part) -> bool:
        """A decode or verification part in a slot with room for a padded step (else it runs eagerly, where a
        cache that would overflow its slot fails with CapacityExhausted instead of writing out of bounds)."""
        cache = part.session.cache
        return (not part.prefill and not part.parents and isinstance(cache, SlotCache)
                and 0 < len(part.token_ids) <= MAX_ROWS
                and cache.get_seq_length() + MAX_ROWS <= self.pool.slot_length)

    @torch.inference_mode()
    def step(self, parts: Sequence[Part]) -> list[torch.Tensor | None]:
        """Logits [keep_rows, V] float32 on the CPU per part (None where keep_rows is 0)."""
        self.steps += 1
        results: list[torch.Tensor | None] = []
        largest = SESSION_BUCKETS[-1]
        for start in range(0, len(parts), largest):
            results += self._step(parts[start: start + largest])
        return results

    def _step(self, parts: Sequence[Part]) -> list[torch.Tensor | None]:
        sessions = bucket(len(parts), SESSION_BUCKETS)
        rows = bucket(max(len(part.token_ids) for part in parts), ROW_BUCKETS)
        lengths = [part.session.cache.get_seq_length() for part in parts]
        span = span_for(max(lengths) + rows, self.pool.slot_length)
        input_ids, slot_ids, length_tensor = _inputs(parts, lengths, sessions, rows)
        logits = self._runner(sessions, rows, span)(input_ids.to(self.device), slot_ids.to(self.device),
                                                    length_tensor.to(self.device))  # [N, R, V]
        flat = logits.reshape(sessions * rows, -1)
        kept = [(index * rows + len(part.token_ids) - part.keep_rows, part.keep_rows)
                for index, part in enumerate(parts)]
        wanted = torch.tensor([first + offset for first, count in kept for offset in range(count)],
                              dtype=torch.long, device=flat.device)
        chosen = flat.index_select(0, wanted).float().cpu()  # [kept rows, V]; .cpu() waits for the step
        for part in parts:
            part.session.cache.advance(len(part.token_ids))
        results, at = [], 0
        for _, count in kept:
            results.append(chosen[at: at + count] if count else None)
            at += count
        return results

    def _runner(self, sessions: int, rows: int, span: int) -> Callable[..., torch.Tensor]:
        if not self.capture:
            return self._eager(span)
        shape = (sessions, rows, span)
        if shape not in self.captured:
            self.captured[shape] = self._capture(shape)
        captured = self.captured[shape]
        return captured if captured is not None else self._eager(span)

    def _capture(self, shape: tuple[int, int, int]) -> CapturedStep | None:
        try:
            return CapturedStep(self.model, self.pool, *shape, memory_pool=self.memory_pool)
        except Exception:  # the step stays correct eagerly; only its speed is lost
            log.exception("capturing a step of %d sessions x %d rows over %d positions failed; it runs "
                          "eagerly", *shape)
            return None

    def _eager(self, span: int) -> Callable[..., torch.Tensor]:
        return lambda input_ids, slot_ids, lengths: static_step(self.model, self.pool, input_ids, slot_ids,
                                                                lengths, span, self.no_mask)


def _inputs(parts: Sequence[Part], lengths: list[int], sessions: int,
            rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input ids [N, R], slot ids [N], lengths [N]) on the CPU, padded to the bucket."""
    input_ids = torch.zeros(sessions, rows, dtype=torch.long)
    slot_ids = torch.full((sessions,), SCRATCH_SLOT, dtype=torch.long)
    length_tensor = torch.zeros(sessions, dtype=torch.long)
    for index, (part, length) in enumerate(zip(parts, lengths)):
        ids = list(part.token_ids) + [part.token_ids[-1]] * (rows - len(part.token_ids))
        input_ids[index] = torch.tensor(ids)
        slot_ids[index] = part.session.cache.slot
        length_tensor[index] = length
    return input_ids, slot_ids, length_tensor
