"""The load generator: send a prompt list at a request rate under a concurrency cap, with a progress bar.

Arrivals follow a Poisson process at --request-rate (exponential gaps drawn from
a generator seeded with --seed, so every mode sees the same schedule); an
infinite rate sends everything at once and --max-concurrency alone paces the
load. With --repeats N every mode runs the list N times, the modes' order reversed
on every other pass (on, off, off, on): a machine that drifts during the run then
favours no mode, and the passes of one mode show the run's noise. With --min-seconds S a
configuration whose passes end sooner than S seconds per mode runs two more (off, on | on, off)
until they do, at most MAX_PASSES in all: at high concurrency a pass takes a fraction of what one
does alone, and the host's noise between passes then decides the A/B. With --seeded-requests, request i is sampled with seed --seed + i in
every mode (reproducible runs; the server then keeps k fixed for them).
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass, replace
from typing import Awaitable, Callable

from tqdm import tqdm

from orchestrator.bench.clients import RequestParams
from orchestrator.bench.metrics import RequestRecord
from orchestrator.bench.modes import DEFAULT, OFF, request_speculation
from orchestrator.prompts.sets import BenchPrompt


DEFAULT_MAX_TOKENS = 128
MAX_PASSES = 8  # of one configuration and mode, whatever --min-seconds asks


@dataclass(frozen=True)
class Configuration:
    max_concurrency: int
    temperature: float | None  # None: each prompt's own (its kind's default)

    @property
    def name(self) -> str:
        temperature = "default" if self.temperature is None else f"{self.temperature:g}"
        return f"c={self.max_concurrency} T={temperature}"


@dataclass(frozen=True)
class LoadSettings:
    max_tokens: int | None  # None: each prompt's own, else this
    request_rate: float
    seed: int
    num_speculative_tokens: int | None  # what the default mode ("on") sends; None: the server's policy
    timeout_s: float
    progress: bool = True
    seeded_requests: bool = False  # send seed + i; the server then keeps k fixed so the seed reproduces
    repeats: int = 1  # passes over the prompt list per mode, in ABBA order (module docstring)
    min_seconds: float = 0.0  # more passes, two at a time, until each mode ran this long (module docstring)


def request_params(item: BenchPrompt, index: int, config: Configuration, load: LoadSettings,
                   mode: str) -> RequestParams:
    """The flags given on the command line win over the prompt's own values."""
    max_tokens = load.max_tokens or item.max_tokens or DEFAULT_MAX_TOKENS
    temperature = request_temperature(item, config)
    seed = load.seed + index if load.seeded_requests else None
    speculation, num_speculative_tokens = request_speculation(mode, load.num_speculative_tokens)
    return RequestParams(max_tokens, temperature, seed, speculation, num_speculative_tokens, load.timeout_s)


def request_temperature(item: BenchPrompt, config: Configuration) -> float:
    """The configuration's temperature, or where it has none the prompt's own."""
    return config.temperature if config.temperature is not None else item.default_temperature()


def arrival_times(count: int, rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent."""
    if math.isinf(rate):
        return [0.0] * count
    rng, now, times = random.Random(seed), 0.0, []
    for _ in range(count):
        times.append(now)
        now += rng.expovariate(rate)
    return times


async def run_modes(client, prompts: list[BenchPrompt], config: Configuration, load: LoadSettings,
                    modes: list[str], fresh_pass: Callable[[], Awaitable[None]] | None = None,
                    ) -> dict[str, tuple[list[RequestRecord], list[float]]]:
    """Every prompt `load.repeats` times in each mode; per mode, the records (by pass, in prompt order)
    and the seconds each pass took.

    Where requests run one after another anyway (concurrency 1, no arrival schedule), the
    modes take turns prompt by prompt, so a machine that drifts faster or slower during a
    long run favours no mode (docs/design/benchmarking.md). Otherwise each mode needs the whole list in flight, and runs
    it in one go; over several passes the modes' order is reversed every other pass, so
    drift over the passes cancels as well (on, off, off, on).

    `fresh_pass` (emptying the server's suffix index) is awaited before every pass of a mode that runs the
    list in one go, and before every pass of the turns prompt by prompt: a pass never finds the same prompts'
    answers from an earlier pass, which would make the suffix index propose them and the later passes of the
    default mode faster than the first.
    """
    one_at_a_time = config.max_concurrency == 1 and math.isinf(load.request_rate)
    pass_size = 1 if one_at_a_time else max(1, len(prompts))
    records: dict[str, list[RequestRecord]] = {mode: [] for mode in modes}
    seconds: dict[str, list[float]] = {mode: [] for mode in modes}
    repeat = 0
    while wants_another_pass(repeat, seconds, load):
        order = modes if repeat % 2 == 0 else modes[::-1]
        for mode in modes:
            seconds[mode].append(0.0)
        for first in range(0, len(prompts), pass_size):
            for mode in order:
                if fresh_pass is not None and first == 0 and (mode == order[0] or not one_at_a_time):
                    await fresh_pass()
                done, took = await run_load(client, prompts[first:first + pass_size], config, load, mode,
                                            first_index=first)
                elapsed = sum(seconds[mode])
                for record in done:  # seconds since the mode's first request, over its passes
                    record.start_s += elapsed
                    record.repeat = repeat
                records[mode] += done
                seconds[mode][repeat] += took
        repeat += 1
    return {mode: (records[mode], seconds[mode]) for mode in modes}


def wants_another_pass(done: int, seconds: dict[str, list[float]], load: LoadSettings) -> bool:
    """Whether a configuration runs pass number `done` (from 0): the --repeats passes, then, while
    a mode has run less than --min-seconds, pairs of passes (so that ABBA order stays balanced)."""
    if done < load.repeats:
        return True
    if (done - load.repeats) % 2:  # the second of a pair
        return True
    shortest = min((sum(s) for s in seconds.values()), default=0.0)
    return done + 2 <= MAX_PASSES and shortest < load.min_seconds


async def run_load(client, prompts: list[BenchPrompt], config: Configuration, load: LoadSettings,
                   mode: str, first_index: int = 0) -> tuple[list[RequestRecord], float]:
    """Send every prompt once in `mode` (see orchestrator.bench.modes); return the records (in prompt order)
    and the wall duration in seconds. The prompts are the list's from `first_index` on (their index
    numbers the records and, with --seeded-requests, gives their seed)."""
    semaphore = asyncio.Semaphore(config.max_concurrency)
    records = [RequestRecord(kind=item.kind, mode=mode, index=first_index + i) for i, item in enumerate(prompts)]
    bar = tqdm(total=len(prompts), desc=f"{config.name} spec {mode}", unit="req", disable=not load.progress,
               leave=False)
    start = time.perf_counter()

    async def one(i: int, item: BenchPrompt, at: float) -> None:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        async with semaphore:
            await client.send(item, request_params(item, first_index + i, config, load, mode), records[i], start)
        bar.update(1)

    times = arrival_times(len(prompts), load.request_rate, load.seed)
    try:
        await asyncio.gather(*(one(i, item, at) for i, (item, at) in enumerate(zip(prompts, times))))
    finally:
        bar.close()
    return records, time.perf_counter() - start


async def warm_up(client, prompts: list[BenchPrompt], count: int, load: LoadSettings, concurrency: int = 1,
                  modes: tuple[str, ...] = (DEFAULT, OFF)) -> None:
    """Short requests in `modes` (speculation on and off) that are not counted: `count` of them one at a
    time, or one per slot at a higher concurrency. Before each concurrency the services meet its batch
    shapes (new row counts: new kernel plans, cost tables and chunk steering to settle) and the
    orchestrator its load; unwarmed, whichever mode ran first paid for that."""
    quiet = replace(load, max_tokens=min(load.max_tokens or 8, 8), progress=False)
    chosen = [prompts[i % len(prompts)] for i in range(max(count, concurrency))] if prompts else []
    for mode in modes:
        await run_load(client, chosen, Configuration(concurrency, None), quiet, mode)
