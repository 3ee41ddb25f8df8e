"""Which batch layout a step should use: one session at a time, padded batches, or ragged rows.

For N sessions with mixed cached lengths and new rows (a verification of k + 1 rows, or one
draft step), times one step three ways on the same caches:

- sequential: each session's forward alone, one after the other (what the engines did before
  continuous batching);
- padded: a [N, max new rows] batch over the caches left-padded to the longest one, with a 2-D
  attention mask and per-row position ids (transformers' batched generate layout);
- ragged: the rows of every session in one padding-free sequence over the concatenated caches,
  with a block mask (specmesh.ragged, what the services run).

Prints the median milliseconds per layout and N, and each layout's time relative to sequential.
Tiny random models by default; --model for a real one (e.g. qwen2.5-coder-1.5b):

    python benchmarks/batch_layouts.py
    python benchmarks/batch_layouts.py --model qwen2.5-coder-1.5b --sessions 1 2 4 8 --repeats 3
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from specmesh import models  # noqa: E402
from specmesh.batching import Part  # noqa: E402
from specmesh.engine import EngineConfig, ModelEngine, Session  # noqa: E402
from specmesh.sampling import SamplingParams  # noqa: E402


def tiny_model(root: Path) -> str:
    from tiny_models import build_tiny_model, build_tokenizer
    return str(build_tiny_model(root / "target", "llama", build_tokenizer(root / "tokenizer"), seed=1,
                                max_positions=2048))


def sessions_for(engine: ModelEngine, count: int, rng: random.Random, k: int) -> list[tuple[Session, list[int]]]:
    """`count` sessions with 50..400 cached tokens, each with 1 or k + 1 new rows."""
    out = []
    for index in range(count):
        length = rng.randint(50, 400)
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
    engine.model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=batch, use_cache=True)


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
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        spec = args.model or tiny_model(Path(tmp))
        model, tokenizer = models.load_model(spec)
        engine = ModelEngine(model, tokenizer, EngineConfig(model_name=spec))
        engine.warm_up()
        print(f"model {spec}, threads {torch.get_num_threads()}, k {args.k}, median of {args.repeats}")
        print(f"{'sessions':>8} {'rows':>5} {'sequential ms':>14} {'padded ms':>10} {'ragged ms':>10} "
              f"{'padded/seq':>10} {'ragged/seq':>10}")
        for count in args.sessions:
            work = sessions_for(engine, count, random.Random(count), args.k)
            seq, pad, rag = (time_layout(layout, engine, work, args.repeats) for layout in (sequential, padded, ragged))
            rows = sum(len(rows) for _, rows in work)
            print(f"{count:>8} {rows:>5} {seq:>14.1f} {pad:>10.1f} {rag:>10.1f} {pad / seq:>10.2f} {rag / seq:>10.2f}")


if __name__ == "__main__":
    main()
