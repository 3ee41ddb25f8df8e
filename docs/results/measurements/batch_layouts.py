"""Which batch layout a step should use: one session at a time, padded batches, or ragged rows.

For N sessions with mixed cached lengths and new rows (a verification of k + 1 rows, or one
draft step), times one step four ways on the same caches:

- sequential: each session's forward alone, one after the other (what the engines did before
  continuous batching);
- padded: a [N, max new rows] batch over the caches left-padded to the longest one, with a 2-D
  attention mask and per-row position ids (transformers' batched generate layout);
- concatenated: the rows of every session in one padding-free sequence over the sessions'
  caches concatenated into one, with a block mask (the services' first ragged design);
- ragged: the same padding-free rows, attention per session over its own cache
  (specmesh.engine.ragged, what the services run).

Prints the median milliseconds per layout and N, and each layout's time relative to sequential.
Tiny random models by default; --model for a real one (e.g. qwen2.5-coder-1.5b). From the repository
root:

    PYTHONPATH=. python docs/results/measurements/batch_layouts.py
    PYTHONPATH=. python docs/results/measurements/batch_layouts.py --model qwen2.5-coder-1.5b \\
        --sessions 1 2 4 8 16 --repeats 3
    PYTHONPATH=. python docs/results/measurements/batch_layouts.py --model qwen2.5-coder-1.5b \\
        --sessions 8 --cached 500 700 --k 0
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from specmesh.loading import models
from specmesh.engine.batching import Part
from specmesh.engine.model_engine import EngineConfig, ModelEngine, Session
from specmesh.loading.hf_compat import cache_kwargs
from specmesh.engine.sampling_params import SamplingParams


def tiny_model(root: Path) -> str:
    from benchmarks.tiny_models import build_tiny_model, build_tokenizer
    return str(build_tiny_model(root / "target", "llama", build_tokenizer(root / "tokenizer"), seed=1,
                                max_positions=2048))


def sessions_for(engine: ModelEngine, count: int, rng: random.Random, k: int,
                 cached: tuple[int, int]) -> list[tuple[Session, list[int]]]:
    """`count` sessions with cached[0]..cached[1] cached tokens, every other one with k + 1 new rows, the rest 1."""
    out = []
    for index in range(count):
        length = rng.randint(*cached)
        ids = [rng.randrange(engine.vocab_size) for _ in range(length)]
        session = Session(f"s{index}", ids, DynamicCache(), SamplingParams(), torch.Generator())
        engine.forward(session, ids)
        out.append((session, [rng.randrange(engine.vocab_size) for _ in range(1 if index % 2 else k + 1)]))
    return out


def sequential(engine: ModelEngine, work) -> None:
    for session, rows in work:
        engine.forward(session, rows)


def ragged(engine: ModelEngine, work) -> None:
    engine._run_step([Part(session, rows, len(rows)) for session, rows in work])


@torch.inference_mode()
def concatenated(engine: ModelEngine, work) -> None:
    """One attention over the concatenated caches, a [T, P + T] block mask keeping sessions apart."""
    caches = [session.cache for session, _ in work]
    batch = DynamicCache()
    for layer in range(len(caches[0].layers)):
        batch.update(torch.cat([c.layers[layer].keys for c in caches], dim=-2),
                     torch.cat([c.layers[layer].values for c in caches], dim=-2), layer)
    lengths = [cache.get_seq_length() for cache in caches]
    total_past, total_rows = sum(lengths), sum(len(rows) for _, rows in work)
    mask = torch.zeros(total_rows, total_past + total_rows, dtype=torch.bool)
    positions, ids, past_start, row = [], [], 0, 0
    for (session, rows), past in zip(work, lengths):
        n = len(rows)
        mask[row: row + n, past_start: past_start + past] = True
        mask[row: row + n, total_past + row: total_past + row + n] = torch.ones(n, n, dtype=torch.bool).tril()
        positions += range(past, past + n)
        ids += rows
        past_start, row = past_start + past, row + n
    engine.model(input_ids=torch.tensor([ids]), attention_mask=mask[None, None], position_ids=torch.tensor([positions]),
                 **cache_kwargs(engine.model, batch), use_cache=True)
    for layer_index, layer in enumerate(batch.layers):  # each session's new keys and values back to its cache
        start = total_past
        for cache, (_, rows) in zip(caches, work):
            cache.update(layer.keys[:, :, start: start + len(rows)], layer.values[:, :, start: start + len(rows)],
                         layer_index)
            start += len(rows)


@torch.inference_mode()
def padded(engine: ModelEngine, work) -> None:
    caches = [session.cache for session, _ in work]
    past = max(cache.get_seq_length() for cache in caches)
    width = max(len(rows) for _, rows in work)
    batch = DynamicCache()
    for layer in range(len(caches[0].layers)):
        keys, values = [], []
        for cache in caches:
            k, v = cache.layers[layer].keys, cache.layers[layer].values  # [1, H, L, D]
            pad = past - k.shape[-2]
            keys.append(torch.nn.functional.pad(k, (0, 0, pad, 0)))
            values.append(torch.nn.functional.pad(v, (0, 0, pad, 0)))
        batch.update(torch.cat(keys), torch.cat(values), layer)
    mask = torch.zeros(len(work), past + width, dtype=torch.long)
    ids = torch.zeros(len(work), width, dtype=torch.long)
    positions = torch.zeros(len(work), width, dtype=torch.long)
    for row, ((session, rows), cache) in enumerate(zip(work, caches)):
        length = cache.get_seq_length()
        mask[row, past - length: past + len(rows)] = 1
        ids[row, : len(rows)] = torch.tensor(rows)
        positions[row] = torch.arange(length, length + width)
    engine.model(input_ids=ids, attention_mask=mask, position_ids=positions, **cache_kwargs(engine.model, batch),
                 use_cache=True)


def time_layout(layout, engine: ModelEngine, work, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        fresh = [(copy.deepcopy(session), rows) for session, rows in work]  # every run from the same caches
        start = time.perf_counter()
        layout(engine, fresh)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: a tiny random Llama built on the fly")
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--k", type=int, default=4, help="draft tokens of the verifying sessions")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cached", type=int, nargs=2, default=(50, 400), metavar=("MIN", "MAX"),
                        help="each session's cached tokens, drawn in [MIN, MAX]")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        spec = args.model or tiny_model(Path(tmp))
        model, tokenizer = models.load_model(spec)
        engine = ModelEngine(model, tokenizer, EngineConfig(model_name=spec))
        engine.warm_up()
        print(f"model {spec}, threads {torch.get_num_threads()}, k {args.k}, cached {args.cached[0]}-{args.cached[1]} "
              f"tokens, median of {args.repeats}")
        layouts = {"sequential": sequential, "padded": padded, "concatenated": concatenated, "ragged": ragged}
        print(f"{'sessions':>8} {'rows':>5} " + " ".join(f"{name + ' ms':>15}" for name in layouts) + " "
              + " ".join(f"{name[:6] + '/seq':>10}" for name in list(layouts)[1:]))
        for count in args.sessions:
            work = sessions_for(engine, count, random.Random(count), args.k, tuple(args.cached))
            ms = [time_layout(layout, engine, work, args.repeats) for layout in layouts.values()]
            rows = sum(len(rows) for _, rows in work)
            print(f"{count:>8} {rows:>5} " + " ".join(f"{m:>15.1f}" for m in ms) + " "
                  + " ".join(f"{m / ms[0]:>10.2f}" for m in ms[1:]))


if __name__ == "__main__":
    main()
