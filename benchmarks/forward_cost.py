"""Cost of one forward pass by number of new tokens (rows), with a KV cache behind them.

Speculative decoding pays off when verifying k+1 tokens costs little more than
one: this prints that curve for a model on this machine, which is how the row
padding in specmesh.engine.model_engine and the default k were chosen.

    python -m benchmarks.forward_cost qwen2.5-coder-1.5b --dtype float32 --rows 1 2 3 4 5 6 7 8
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

from specmesh.loading.hf_compat import cache_kwargs
from specmesh.loading.precision import DTYPE_CHOICES, load_model_in, resolve_dtype

CONTEXT = "def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n"


@torch.inference_mode()
def forward_ms(model, prompt_ids: list[int], rows: int, repeats: int) -> float:
    """Median ms of a forward over `rows` new tokens after a prefilled prompt."""
    times = []
    for _ in range(repeats + 1):
        cache = DynamicCache()
        model(torch.tensor([prompt_ids], device=model.device), **cache_kwargs(model, cache), use_cache=True)
        start = time.perf_counter()
        model(torch.full((1, rows), 100, device=model.device), **cache_kwargs(model, cache), use_cache=True)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[1:])  # the first pass also pages the weights in


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--dtype", default="float32", choices=DTYPE_CHOICES)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 7, 8])
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    model, tokenizer = load_model_in(args.model, args.device, args.dtype)
    dtype = resolve_dtype(args.dtype, args.device)
    prompt_ids = tokenizer.encode(CONTEXT)
    one = None
    print(f"{args.model} ({dtype}, {args.device}, {torch.get_num_threads()} threads)")
    for rows in args.rows:
        ms = forward_ms(model, prompt_ids, rows, args.repeats)
        one = one or ms
        print(f"  {rows} rows: {ms:7.1f} ms  ({ms / one:.2f}x one row)")


if __name__ == "__main__":
    main()
