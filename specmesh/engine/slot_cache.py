"""Preallocated KV: one pool of fixed slots per model, each session's cache written in place in its slot.

A DynamicCache appends by concatenation, so every step copies each layer's whole cache, and
its tensors move with every step: nothing can be captured once and replayed. Here every layer
owns one keys and one values tensor [slots, KV heads, slot length, head dim], allocated once;
a session holds a slot, writes its new rows at its length and reads the slot up to it. Rolling
back is a length change (the rows past it are overwritten later), and a step over many sessions
(specmesh.engine.graph_steps) reads and writes the same addresses every time, which is what a CUDA
graph needs.

Slot 0 is scratch: padding rows and shape captures write there, never into a session's slot.
A slot goes back to the pool when its session closes, or when its cache is dropped (a fork
that lost, specmesh's draft branches), whichever comes first.
"""

from __future__ import annotations

import gc
import heapq
import queue
import threading
import weakref

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache

from specmesh.errors import CapacityExhausted
from specmesh.engine.kv_budget import kv_shape

SCRATCH_SLOT = 0


class SlotPool:
    """Every layer's keys and values for `slots` sessions of up to `slot_length` tokens each."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, slots: int, slot_length: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (slots + 1, kv_heads, slot_length, head_dim)  # + the scratch slot
        # Zeros, not empty: a masked position still enters attention's weighted sum as 0 x value.
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.slots, self.slot_length = slots, slot_length
        self._free = list(range(1, slots + 1))  # a heap: the lowest slot first, so busy slots stay packed low
        self._lock = threading.Lock()
        # Slots given back: a dropped cache's finalizer may run inside any allocation, on any thread, even
        # while this pool's lock is held; SimpleQueue.put is safe there, and acquire takes them in.
        self._returned: queue.SimpleQueue[int] = queue.SimpleQueue()

    @classmethod
    def for_model(cls, model: torch.nn.Module, slots: int, slot_length: int) -> "SlotPool":
        weight = next(model.parameters())
        return cls(*kv_shape(model), slots, slot_length, weight.dtype, weight.device)

    @property
    def free(self) -> int:
        with self._lock:
            self._take_returned()
            return len(self._free)

    def acquire(self) -> int:
        for _ in range(2):
            with self._lock:
                self._take_returned()
                if self._free:
                    return heapq.heappop(self._free)
            gc.collect()  # a dropped cache in a reference cycle gives its slot back when collected
        raise CapacityExhausted(f"all {self.slots} KV slots are in use")

    def release(self, slot: int) -> None:
        self._returned.put(slot)

    def _take_returned(self) -> None:
        while True:
            try:
                heapq.heappush(self._free, self._returned.get_nowait())
            except queue.Empty:
                return

    def new_cache(self) -> "SlotCache":
        return SlotCache(self, self.acquire())


class SlotLayer(CacheLayerMixin):
    """One layer of one session's cache: a view of the pool's slot, valid up to `length`."""

    is_sliding = False
    is_croppable = True

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.slot_keys, self.slot_values = keys, values  # [1, KV heads, slot length, head dim] views
        self.length = 0
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass  # allocated by the pool

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key_states, value_states [1, KV heads, rows, head dim] -> the cache [1, KV heads, length, head dim]."""
        start, end = self.length, self.length + key_states.shape[-2]
        if end > self.slot_keys.shape[-2]:
            raise CapacityExhausted(f"a session's KV slot holds {self.slot_keys.shape[-2]} tokens; {end} asked")
        self.slot_keys[:, :, start:end] = key_states
        self.slot_values[:, :, start:end] = value_states
        self.length = end
        return self.slot_keys[:, :, :end], self.slot_values[:, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.slot_keys.shape[-2]

    def crop(self, tokens_to_remove: int) -> None:
        """A negative count: drop that many tokens from the end (the rows stay, to be overwritten)."""
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative count of tokens to remove")
        self.length = max(0, self.length + tokens_to_remove)


class SlotCache(Cache):
    """A session's cache in one slot of a SlotPool, usable wherever a DynamicCache is (crop, forwards)."""

    def __init__(self, pool: SlotPool, slot: int):
        layers = [SlotLayer(keys[slot: slot + 1], values[slot: slot + 1])
                  for keys, values in zip(pool.keys, pool.values)]
        super().__init__(layers=layers)
        self.pool, self.slot = pool, slot
        self._release = weakref.finalize(self, pool.release, slot)

    def close(self) -> None:
        """Give the slot back now (idempotent); the cache must not be used after."""
        self._release()

    def advance(self, rows: int) -> None:
        """Count `rows` more tokens in every layer: a step that wrote the pool directly (graph_steps)."""
        for layer in self.layers:
            layer.length += rows

    def __deepcopy__(self, memo) -> Cache:
        """A fork holding a copy of this cache's tokens: in a slot of its own, or, with every slot taken,
        in a DynamicCache (its steps then run eagerly, outside the graph steps)."""
        try:
            fork = self.pool.new_cache()
        except CapacityExhausted:
            fork = DynamicCache()
            for index, layer in enumerate(self.layers):
                fork.update(layer.slot_keys[:, :, :layer.length].clone(),
                            layer.slot_values[:, :, :layer.length].clone(), index)
            return fork
        for source, target in zip(self.layers, fork.layers):
            target.slot_keys[:, :, :source.length] = source.slot_keys[:, :, :source.length]
            target.slot_values[:, :, :source.length] = source.slot_values[:, :, :source.length]
            target.length = source.length
        return fork
