"""The draft's step cost and agreement with the target, by precision (the --draft-dtype choices).

For each precision: the median time of a one-row and an eight-row decode step over a 100-token
cache, and top-1 agreement with the target's greedy continuation (teacher-forced, so every
position counts), on the same prompts for every precision. Also the largest logit change that
batching a row with others causes (rows computed alone vs in a batch of four).

With --head-tokens N ..., also each precision with its output head cut to the first N token
ids (byte-level BPE numbers its tokens by merge order, so the low ids are the common ones): the
head's share of a step, and how often the target's token falls outside those N.

    python -m benchmarks.draft_precision                       # the embedded pair
    python -m benchmarks.draft_precision --dtypes bfloat16 int8 --tokens 64
    python -m benchmarks.draft_precision --dtypes int8 --head-tokens 65536 32768
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

from specmesh.loading.hf_compat import cache_kwargs
from specmesh.loading.precision import load_model_in

PROMPTS = ["def quicksort(arr):", "Write a short poem about the sea.", "Explain what a hash map is.",
           "Fix the bug: for i in range(len(xs)) print(xs[i])"]


@torch.inference_mode()
def step_ms(model, rows: int, repeats: int = 12) -> float:
    """Median ms of one decode step of `rows` rows over a 100-token cache."""
    ids = torch.randint(1, min(5000, model.config.vocab_size), (rows, 100))  # [rows, 100]
    cache = DynamicCache()
    model(ids, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        model(ids[:, -1:], **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
        samples.append(time.perf_counter() - start)
        cache.crop(-1)
    return statistics.median(samples) * 1e3


@torch.inference_mode()
def agreement(model, continuations: list[tuple[int, torch.Tensor]]) -> float:
    """Share of positions where the model's argmax is the target's greedy token."""
    hits = total = 0
    for prompt_len, ids in continuations:  # ids [1, prompt_len + generated]
        predicted = model(ids).logits[0, prompt_len - 1:-1].argmax(-1)
        hits += int((predicted == ids[0, prompt_len:]).sum())
        total += ids.shape[1] - prompt_len
    return hits / total


def cut_head(model, tokens: int) -> None:
    """Keep the output head's rows of the first `tokens` ids only (an int8 head or a float Linear)."""
    from specmesh.loading.precision import Int8WeightLinear
    head = model.get_output_embeddings()
    tokens = min(tokens, head.out_features)
    if isinstance(head, Int8WeightLinear):
        head.qweight, head.scales = head.qweight[:tokens].contiguous(), head.scales[:tokens].contiguous()
        if head.bias is not None:
            head.bias = head.bias[:tokens].contiguous()
        head.out_features = tokens
        return
    cut = torch.nn.Linear(head.in_features, tokens, bias=head.bias is not None, dtype=head.weight.dtype)
    cut.weight = torch.nn.Parameter(head.weight[:tokens].detach().clone())  # a copy: unties the embedding
    if head.bias is not None:
        cut.bias = torch.nn.Parameter(head.bias[:tokens].detach().clone())
    model.set_output_embeddings(cut)


@torch.inference_mode()
def batching_delta(model) -> float:
    """max |Δlogit| of row 0 computed alone vs in a padded batch of four."""
    ids = torch.randint(1, min(5000, model.config.vocab_size), (4, 20), generator=torch.Generator().manual_seed(0))
    alone, batched = model(ids[:1]).logits[0].float(), model(ids).logits[0].float()
    return float((alone - batched).abs().max())


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "int8"])
    parser.add_argument("--tokens", type=int, default=64, help="greedy target tokens per prompt")
    parser.add_argument("--head-tokens", type=int, nargs="*", default=[], metavar="N",
                        help="also cut the draft's output head to the first N token ids")
    args = parser.parse_args(argv)
    target, tokenizer = load_model_in(args.target, "cpu", "float32")
    with torch.inference_mode():
        continuations = []
        for prompt in PROMPTS:
            ids = tokenizer(prompt, return_tensors="pt").input_ids  # [1, prompt_len]
            continuations.append((ids.shape[1], target.generate(ids, max_new_tokens=args.tokens, do_sample=False)))
    del target
    print(f"draft {args.draft}, {torch.get_num_threads()} threads; agreement with {args.target} greedy over "
          f"{len(PROMPTS)} prompts x {args.tokens} tokens")
    print(f"{'dtype':10} {'1 row ms':>9} {'8 rows ms':>10} {'agreement':>10} {'max|dlogit| batched':>20}")
    rows = {}
    for name in args.dtypes:
        for head in [None, *args.head_tokens]:
            draft, _ = load_model_in(args.draft, "cpu", name)
            label = name if head is None else f"{name}/{head}"
            if head is not None:
                cut_head(draft, head)
            row = rows[label] = dict(one_row_ms=step_ms(draft, 1), eight_rows_ms=step_ms(draft, 8),
                                     agreement=agreement(draft, continuations), batching_delta=batching_delta(draft))
            print(f"{label:10} {row['one_row_ms']:9.1f} {row['eight_rows_ms']:10.1f} {row['agreement']:10.3f} "
                  f"{row['batching_delta']:20.2e}", flush=True)
            del draft
    return rows


if __name__ == "__main__":
    main()
