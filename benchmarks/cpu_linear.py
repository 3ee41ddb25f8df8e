"""A float32 model's step cost on each CPU linear kernel (the --cpu-linear choices), and how far they differ.

For each kernel: the median time of one session's step feeding T rows over a 100-token
cache (a decode step is T = 1, a verification of k draft tokens T = k + 1), and the largest
logit change between the kernels over a 100-token prompt, and whether greedy decoding of
each prompt gives the same tokens on both.

    python -m benchmarks.cpu_linear                          # the embedded target
    python -m benchmarks.cpu_linear --model qwen2.5-coder-0.5b --rows 1 2 4 8
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

from specmesh.loading.cpu_linear import use_onednn
from specmesh.loading.hf_compat import cache_kwargs
from specmesh.loading.precision import load_model_in

PROMPTS = ["def quicksort(arr):", "Write a short poem about the sea.", "Explain what a hash map is."]


@torch.inference_mode()
def step_ms(model, rows: int, repeats: int = 8) -> float:
    """Median ms of one session's step of `rows` new rows over a 100-token cache."""
    ids = torch.randint(1, min(5000, model.config.vocab_size), (1, 100 + rows))  # [1, 100 + rows]
    cache = DynamicCache()
    model(ids[:, :100], **cache_kwargs(model, cache), use_cache=True)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        model(ids[:, 100:], **cache_kwargs(model, cache), use_cache=True)
        samples.append(time.perf_counter() - start)
        cache.crop(-rows)
    return statistics.median(samples) * 1e3


@torch.inference_mode()
def outputs(model, tokenizer, tokens: int) -> tuple[torch.Tensor, list[list[int]]]:
    """(logits of a 100-token prompt [100, vocab], greedy continuations of PROMPTS)."""
    ids = torch.randint(1, min(5000, model.config.vocab_size), (1, 100), generator=torch.Generator().manual_seed(0))
    greedy = [model.generate(tokenizer(p, return_tensors="pt").input_ids, max_new_tokens=tokens,
                             do_sample=False)[0].tolist() for p in PROMPTS]
    return model(ids).logits[0], greedy


def main(argv: list[str] | None = None) -> dict[str, dict[int, float]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 8, 16])
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt for the comparison")
    args = parser.parse_args(argv)
    model, tokenizer = load_model_in(args.model, "cpu", "float32")
    print(f"{args.model} float32, {torch.get_num_threads()} threads; ms of one session's step of T rows")
    print(f"{'kernel':8} " + " ".join(f"{f'T={rows}':>8}" for rows in args.rows))
    table, results = {}, {}
    for kernel in ("torch", "onednn"):
        if kernel == "onednn":
            use_onednn(model)
        table[kernel] = {rows: step_ms(model, rows) for rows in args.rows}
        print(f"{kernel:8} " + " ".join(f"{table[kernel][rows]:8.1f}" for rows in args.rows), flush=True)
        results[kernel] = outputs(model, tokenizer, args.tokens)
    delta = float((results["torch"][0] - results["onednn"][0]).abs().max())
    same = sum(a == b for a, b in zip(results["torch"][1], results["onednn"][1]))
    print(f"max |dlogit| torch vs onednn over a 100-token prompt: {delta:.2e}; "
          f"greedy {args.tokens} tokens identical for {same} of {len(PROMPTS)} prompts")
    return table


if __name__ == "__main__":
    main()
