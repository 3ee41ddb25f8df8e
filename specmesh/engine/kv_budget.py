"""A model service's KV memory, managed by reservation: admission, a FIFO queue, never an out-of-memory crash.

The engine admits a session (specmesh.engine.model_engine.ModelEngine.admit) with the budget and the pure
arithmetic here: what a session reserves, how long an open may wait, whether its prefill ends in time.

A session reserves, when it opens, the KV room of every token it may ever hold:
min(context window, prompt + max_new_tokens) (max_new_tokens 0: the whole window).
Reservations are counted in tokens against a budget (`--kv-cache-memory`) divided by
the bytes one token's keys and values take in every layer. A session that does not
fit waits, first in first out, until closes free enough room or its RPC's deadline
nears; one that could never fit, or that would join a queue already
`--max-waiting-sessions` long, is refused at once with RESOURCE_EXHAUSTED, and so is one whose
prefill, behind the prompt rows already queued, would end past its call's deadline.

Reservations are an upper bound, not an allocation: a session's cache grows as it
decodes, and may stop early (EOS), but the sum of all caches never exceeds the budget.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import re
from dataclasses import dataclass
from typing import Sequence

import psutil
import torch

from specmesh.errors import CapacityExhausted, SessionExists

log = logging.getLogger(__name__)
DEFAULT_MAX_WAITING_SESSIONS = 64
WAIT_MARGIN_S, WAIT_MARGIN_FRACTION = 1.0, 0.1  # an open stops waiting this long before its deadline
DEFAULT_FRACTION = {"cuda": 0.8, "cpu": 0.3}  # of free device memory (after the weights) / available RAM
UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_AMOUNT = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")
KV_CACHE_MEMORY_HELP = ("KV cache budget: bytes (2GiB, 512MiB, 1500000000) or a fraction of the device's memory "
                        "(0.5: half the free GPU memory after the weights on CUDA, half the available RAM on CPU); "
                        "default: 0.8 on CUDA, 0.3 on CPU. Sessions reserve min(context window, prompt + "
                        "max_new_tokens) tokens of it when they open, and wait while it is full")


@dataclass(frozen=True)
class KVCacheMemory:
    """A --kv-cache-memory setting: a number of bytes, or a fraction of the device's memory."""

    bytes: int | None = None
    fraction: float | None = None

    def __str__(self) -> str:
        return f"{self.bytes} bytes" if self.bytes is not None else f"{self.fraction:g} of device memory"


def parse_kv_cache_memory(text: str) -> KVCacheMemory:
    """'2GiB' / '512MB' / '1500000000' -> bytes; '0.5' (a plain number in (0, 1]) -> a fraction."""
    match = _AMOUNT.match(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in UNITS:
        raise argparse.ArgumentTypeError(f"not a memory size: {text!r} (e.g. 2GiB, 512MiB, 1500000000, or a "
                                         f"fraction such as 0.5)")
    number = float(match.group(1))
    if not unit and 0 < number <= 1:
        return KVCacheMemory(fraction=number)
    if not unit and not number.is_integer():
        raise argparse.ArgumentTypeError(f"{text!r}: a plain number is a fraction in (0, 1] or whole bytes")
    size = int(number * UNITS[unit])
    if size <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: the KV cache budget must be more than 0 bytes")
    return KVCacheMemory(bytes=size)


def kv_shape(model: torch.nn.Module) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) of the model's keys and values."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads  # Qwen3, Gemma: explicit
    return config.num_hidden_layers, kv_heads, head_dim


def kv_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of keys and values one token holds: layers x 2 (K, V) x KV heads x head dim x dtype bytes.

    For models with sliding-window layers (which keep fewer tokens) it is an upper bound.
    """
    layers, kv_heads, head_dim = kv_shape(model)
    return layers * 2 * kv_heads * head_dim * torch.empty((), dtype=model.dtype).element_size()


def model_devices(model: torch.nn.Module) -> list[torch.device]:
    """The devices the model's weights are on: more than one where it is sharded."""
    return list({parameter.device for parameter in model.parameters()})


def available_memory(devices: Sequence[torch.device]) -> int:
    """Free memory on the CUDA devices among `devices` (summed: a sharded model spreads its KV), else
    the system RAM available to this process."""
    cuda = sorted({torch.cuda.current_device() if d.index is None else d.index
                   for d in devices if d.type == "cuda"})
    if cuda:
        return sum(torch.cuda.mem_get_info(index)[0] for index in cuda)
    return available_ram()


def available_ram() -> int:
    """MemAvailable, capped by the cgroup's limit (a container sees the host's RAM in /proc/meminfo)."""
    available = psutil.virtual_memory().available
    try:
        with open("/sys/fs/cgroup/memory.max") as limit, open("/sys/fs/cgroup/memory.current") as current:
            text = limit.read().strip()
            if text != "max":
                available = min(available, int(text) - int(current.read()))
    except (OSError, ValueError):
        pass  # no cgroup v2 limit
    return max(0, available)


def budget_bytes(setting: KVCacheMemory | None, devices: Sequence[torch.device]) -> int:
    if setting is not None and setting.bytes is not None:
        return setting.bytes
    on_cuda = any(d.type == "cuda" for d in devices)
    fraction = setting.fraction if setting is not None else DEFAULT_FRACTION["cuda" if on_cuda else "cpu"]
    return int(fraction * available_memory(devices))


class KVBudget:
    """Token reservations against a capacity; a FIFO queue of sessions waiting for room.

    Used from the event loop only (the servicers, the idle reaper): a release wakes waiters' futures.
    """

    def __init__(self, capacity_tokens: int, max_waiting: int = DEFAULT_MAX_WAITING_SESSIONS,
                 bytes_per_token: int = 0):
        self.capacity = capacity_tokens
        self.max_waiting = max_waiting
        self.bytes_per_token = bytes_per_token
        self.reserved: dict[str, int] = {}  # request id -> tokens
        self._waiting: dict[str, tuple[int, asyncio.Future]] = {}  # in arrival order

    @classmethod
    def for_model(cls, model: torch.nn.Module, setting: KVCacheMemory | None,
                  max_waiting: int = DEFAULT_MAX_WAITING_SESSIONS) -> KVBudget:
        devices = model_devices(model)
        per_token = kv_bytes_per_token(model)
        budget = budget_bytes(setting, devices)
        if budget < per_token:
            raise ValueError(f"a KV cache budget of {budget} bytes (--kv-cache-memory {setting or 'default'}) "
                             f"holds no token: one takes {per_token} bytes")
        log.info("KV cache budget %.2f GiB (%s): %d tokens of %d bytes", budget / 2**30,
                 setting or "default", budget // per_token, per_token)
        return cls(budget // per_token, max_waiting, per_token)

    @property
    def used(self) -> int:
        return sum(self.reserved.values())

    @property
    def running(self) -> int:
        return len(self.reserved)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def usage(self) -> float:
        """Reserved fraction of the budget, 0..1."""
        return self.used / self.capacity if self.capacity else 1.0

    async def reserve(self, request_id: str, tokens: int, timeout_s: float | None = None) -> None:
        """Reserve `tokens` for `request_id`, waiting behind earlier sessions until they fit.

        Cancelled or timed out while waiting, the session leaves the queue and holds nothing.
        """
        if tokens > self.capacity:
            raise CapacityExhausted(f"needs {tokens} tokens of KV, budget is {self.capacity}")
        if request_id in self.reserved or request_id in self._waiting:
            raise SessionExists(request_id)
        if not self._waiting and self.used + tokens <= self.capacity:
            self.reserved[request_id] = tokens
            return
        if len(self._waiting) >= self.max_waiting:
            raise CapacityExhausted(f"KV cache full and {len(self._waiting)} sessions already wait for it: "
                                    f"the limit is --max-waiting-sessions {self.max_waiting}")
        granted = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = (tokens, granted)
        try:
            async with asyncio.timeout(timeout_s):
                await granted
        except BaseException as error:
            self._withdraw(request_id, granted)
            if isinstance(error, TimeoutError):
                raise CapacityExhausted(f"waited {timeout_s:.3g}s for {tokens} tokens of KV: the budget of "
                                        f"{self.capacity} stayed full") from None
            raise

    def _withdraw(self, request_id: str, granted: asyncio.Future) -> None:
        """A waiter gave up: out of the queue, or, granted meanwhile, its reservation back."""
        entry = self._waiting.get(request_id)
        if entry is not None and entry[1] is granted:
            del self._waiting[request_id]
            self._grant()  # the one it held up may fit now
        elif granted.done() and not granted.cancelled():
            self.release(request_id)

    def release(self, request_id: str) -> None:
        """Free the session's reservation (none held: nothing happens) and admit who now fits."""
        if self.reserved.pop(request_id, None) is not None:
            self._grant()

    def _grant(self) -> None:
        """Admit waiters in arrival order while the first one fits; a large one is never overtaken."""
        while self._waiting:
            request_id, (tokens, granted) = next(iter(self._waiting.items()))
            if self.used + tokens > self.capacity:
                return
            del self._waiting[request_id]
            self.reserved[request_id] = tokens
            granted.set_result(None)


def reservation(context_window: int, length: int, max_new_tokens: int) -> int:
    """Tokens a session of `length` tokens that may add `max_new_tokens` (0: no limit) can ever hold."""
    if max_new_tokens <= 0:
        return context_window
    return min(context_window, length + max_new_tokens)


def wait_limit(deadline_s: float | None) -> float | None:
    """How long an open may wait for room: until a little before its RPC's deadline, so that its caller
    hears why (RESOURCE_EXHAUSTED, the budget stayed full) rather than a bare DEADLINE_EXCEEDED."""
    if deadline_s is None:
        return None
    return max(0.0, deadline_s - min(WAIT_MARGIN_S, WAIT_MARGIN_FRACTION * deadline_s))


def check_prefill_in_time(ahead_rows: int, expected_s: float | None, left_s: float) -> None:
    """Admission by expected wait: a prefill that, behind the `ahead_rows` prompt rows already queued,
    would end in `expected_s` (None: unknown yet), past the `left_s` its call has, is refused at once
    (RESOURCE_EXHAUSTED, HTTP 429: come back later or elsewhere) rather than prefilled in part and
    timed out, which would only slow every request queued behind it."""
    if expected_s is not None and expected_s > left_s:
        raise CapacityExhausted(f"{ahead_rows} prompt tokens are queued ahead: this prefill would end in about "
                                f"{expected_s:.0f} s, past this call's deadline ({left_s:.0f} s left)")
