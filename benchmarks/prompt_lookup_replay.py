"""How often prompt lookup would propose, and be accepted, on `specmesh bench`'s prompts (greedy, replayed).

The target generates each prompt's greedy output once; then the rounds of a request
that verifies prompt lookup's proposal (orchestrator.decoding.lookup) every round are
replayed against it: each round proposes up to --k tokens from the committed sequence,
accepts the prefix that matches the target's output, and commits it plus one token.
Prints, per prompt kind, the rounds against the tokens (tokens per round is what lookup
alone would save, with verification rows free), the proposals and their acceptance by
position: the figures behind the policy's LOOKUP_PRIOR.

    python -m benchmarks.prompt_lookup_replay --model qwen2.5-coder-1.5b --num-prompts 16 --max-tokens 32
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch

from orchestrator.prompts.sets import KINDS, BenchPrompt, prompt_pool, select_prompts
from orchestrator.decoding.lookup import PromptLookup
from specmesh.loading.models import load_model


def prompt_ids(tokenizer, prompt: BenchPrompt) -> list[int]:
    if prompt.messages is None:
        return tokenizer.encode(prompt.prompt)
    ids = tokenizer.apply_chat_template(list(prompt.messages), add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def greedy(model, ids: list[int], max_tokens: int, eos: set[int]) -> list[int]:
    with torch.inference_mode():
        output = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False)
    generated = output[0, len(ids):].tolist()
    ends = [i for i, token in enumerate(generated) if token in eos]
    return generated[: ends[0] + 1] if ends else generated


def replay(prompt: list[int], output: list[int], k: int) -> dict:
    """Rounds of a request whose every round verifies lookup's proposal; the first token is the prefill's."""
    sequence = prompt + output[:1]
    lookup = PromptLookup(sequence)
    figures = {"tokens": len(output) - 1, "rounds": 0, "proposals": 0, "proposed": 0, "accepted": 0,
               "reached": [0] * k, "accepted_at": [0] * k}
    while len(sequence) < len(prompt) + len(output):
        at = len(sequence) - len(prompt)
        proposal = lookup.propose(min(k, len(output) - at - 1))
        accepted = 0
        while accepted < len(proposal) and proposal[accepted] == output[at + accepted]:
            accepted += 1
        if proposal:
            figures["proposals"] += 1
            figures["proposed"] += len(proposal)
            figures["accepted"] += accepted
            for position in range(min(accepted + 1, len(proposal))):
                figures["reached"][position] += 1
            for position in range(accepted):
                figures["accepted_at"][position] += 1
        sequence.extend(output[at:at + accepted + 1])
        figures["rounds"] += 1
    return figures


def add(total: dict, figures: dict) -> None:
    for key, value in figures.items():
        total[key] = [a + b for a, b in zip(total[key], value)] if isinstance(value, list) else total[key] + value


def report(name: str, f: dict) -> str:
    rates = " ".join(f"{a / r:.2f}" if r else "-" for a, r in zip(f["accepted_at"], f["reached"]))
    return (f"{name:<9} {f['tokens']:>6} {f['rounds']:>6} {f['tokens'] / max(f['rounds'], 1):>8.2f} "
            f"{f['proposals']:>9} {f['proposed']:>8} {f['accepted']:>8}   {rates}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b", help="the target: an embedded alias or a path")
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0, help="prompt order, as specmesh bench's --seed")
    parser.add_argument("--k", type=int, default=4, help="the most lookup tokens a round verifies")
    args = parser.parse_args(argv)
    model, tokenizer = load_model(args.model)
    eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    by_kind: dict[str, dict] = defaultdict(lambda: {"tokens": 0, "rounds": 0, "proposals": 0, "proposed": 0,
                                                    "accepted": 0, "reached": [0] * args.k, "accepted_at": [0] * args.k})
    for prompt in select_prompts(prompt_pool(args.kinds, None), args.num_prompts, args.seed):
        ids = prompt_ids(tokenizer, prompt)
        add(by_kind[prompt.kind], replay(ids, greedy(model, ids, args.max_tokens, eos), args.k))
    total = {"tokens": 0, "rounds": 0, "proposals": 0, "proposed": 0, "accepted": 0,
             "reached": [0] * args.k, "accepted_at": [0] * args.k}
    for figures in by_kind.values():
        add(total, figures)
    print(f"{'kind':<9} {'tokens':>6} {'rounds':>6} {'tok/rnd':>8} {'proposals':>9} {'proposed':>8} {'accepted':>8}"
          f"   acceptance by position")
    for kind, figures in by_kind.items():
        print(report(kind, figures))
    print(report("all", total))
    return {"by_kind": dict(by_kind), "all": total}


if __name__ == "__main__":
    main()
