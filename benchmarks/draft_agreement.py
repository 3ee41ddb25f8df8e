"""Where along an answer drafts agree with the target: greedy agreement by position window, and the
acceptance the speculative loop would have at a fixed k, for several drafts on the same prompts.

The target's greedy continuations of the prompts (float32: what serving commits) are computed once;
each draft, loaded in the precision it serves in, is teacher-forced over them. Agreement at a
position is the draft's argmax equal to the target's token; acceptance replays the loop's greedy
rounds exactly (orchestrator.distill.acceptance). A distilled draft that gained on the positions it
was trained on and lost past them shows here, where an average over a short horizon would not.

    python -m benchmarks.draft_agreement --target qwen2.5-coder-1.5b \\
        --drafts qwen2.5-coder-0.5b ./draft-distilled --prompts served.jsonl --last 20 --max-new-tokens 64
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.stack_checks import print_header
from orchestrator.distill import teacher
from orchestrator.distill.acceptance import measure_acceptance
from orchestrator.distill.examples import load_examples
from specmesh.loading.models import eos_token_ids, load_tokenizer
from specmesh.loading.precision import DTYPE_CHOICES, load_model_in

MODULE = "benchmarks.draft_agreement"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--drafts", nargs="+", required=True, help="drafts to compare, on the same prompts")
    parser.add_argument("--prompts", required=True, help="any prompts file `specmesh distill` reads")
    parser.add_argument("--last", type=int, default=None, metavar="N", help="only the file's last N prompts")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="continuation length")
    parser.add_argument("--window", type=int, default=32, help="agreement per window of this many positions")
    parser.add_argument("--k", type=int, default=7, help="draft length of the replayed rounds")
    parser.add_argument("--draft-dtype", choices=DTYPE_CHOICES, default="auto", help="as serve's --draft-dtype")
    parser.add_argument("--batch-size", type=int, default=8)
    return parser.parse_args(argv)


def agreement_by_window(argmax: torch.Tensor, continuations: torch.Tensor, window: int) -> list[float]:
    """[N, L] x2 -> the share of equal tokens in each window of `window` positions."""
    equal = (argmax == continuations).float()  # [N, L]
    return [equal[:, start:start + window].mean().item() for start in range(0, equal.shape[1], window)]


def no_progress(items, label: str):
    return items


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    print_header(MODULE, argv)
    tokenizer = load_tokenizer(args.target)
    examples = load_examples(args.prompts, tokenizer, max_prompt_tokens=256)[-(args.last or 0):]
    prompts = [e.prompt_token_ids for e in examples]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    target, _ = load_model_in(args.target, "cpu", "float32")
    target_eos = set(eos_token_ids(target, tokenizer))
    continuations = teacher.greedy_continuations(target, prompts, args.max_new_tokens, args.batch_size, pad_id,
                                                 no_progress)  # [N, L]
    del target
    results = []
    for spec in args.drafts:
        draft, draft_tokenizer = load_model_in(spec, "cpu", args.draft_dtype)
        argmax = teacher.teacher_forced_argmax(draft, prompts, continuations, args.batch_size, pad_id,
                                               no_progress, spec)
        stats = measure_acceptance(argmax, continuations, args.k, target_eos,
                                   set(eos_token_ids(draft, draft_tokenizer)))
        windows = agreement_by_window(argmax, continuations, args.window)
        results.append({"draft": spec, "agreement": (argmax == continuations).float().mean().item(),
                        "by_window": windows, "acceptance": stats.acceptance_rate,
                        "tokens_per_round": stats.tokens_per_round})
        del draft
    print(f"{len(prompts)} prompts, {args.max_new_tokens} tokens each; agreement by window of {args.window} "
          f"positions; acceptance and tokens per round of greedy rounds replayed at k = {args.k}")
    for r in results:
        windows = " ".join(f"{w:.3f}" for w in r["by_window"])
        print(f"{r['draft']}: agreement {r['agreement']:.3f} (by window: {windows}), "
              f"acceptance {r['acceptance']:.3f}, tokens per round {r['tokens_per_round']:.2f}")
    return results


if __name__ == "__main__":
    main()
