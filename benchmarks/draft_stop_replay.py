"""How long to draft each round, replayed without the host's noise: the policy's stop against transformers'.

The target generates each bench prompt's greedy output once. Then, from every position of that
output, the draft drafts --k tokens greedily from the true prefix and records its confidence at each
(its largest probability: what ProposeResponse.probabilities carries). The rounds of a request are
replayed against the output under several stop rules, each round priced at the step costs measured
here in this process (a draft step, and a target step by rows):

- `k=N`: a fixed draft length;
- `conf<T`: transformers' assisted generation, which ends a round after the first token whose own
  confidence is below T (assistant_confidence_threshold, 0.4 by default), at most --k;
- `run<T`: specmesh's draft stop, which ends a round after the first token at which the run
  probability (the product of the confidences so far) is below T, at most --k; the policy sets T each
  round to goodput x the cost of one more token / how well the draft's confidences have matched
  acceptance (orchestrator.decoding.policy), printed as `the policy's T`;
- `run<T+alt`: the same rounds, their verification also trying the draft's second choice at the
  positions the policy would offer (target_service.alternatives): where the chance of committing one
  more token (run probability before the position x the second choice's probability) is worth the
  row at the rule's own rate, each row priced by the target's step costs here.

Prints tokens per second of the rounds (prefill aside), draft tokens and committed tokens a round,
per prompt kind and overall. Equal costs for every rule: what differs is only how long each drafts.

    python -m benchmarks.draft_stop_replay --num-prompts 12 --max-tokens 64
"""

from __future__ import annotations

import argparse
import sys

import torch
from transformers import DynamicCache

from benchmarks.forward_cost import CONTEXT, forward_ms
from benchmarks.prompt_lookup_replay import greedy, prompt_ids
from benchmarks.stack_checks import print_header
from orchestrator.prompts.sets import KINDS, prompt_pool, select_prompts
from specmesh.loading.hf_compat import cache_kwargs
from specmesh.loading.models import eos_token_ids
from specmesh.loading.precision import load_model_in

TIMED_STEPS = 5  # forwards timed per row count (their median)


def draft_runs(draft, prompt: list[int], output: list[int], k: int) -> list[tuple[list[int], list[float], list[int],
                                                                                list[float]]]:
    """For each position of `output`: the draft's k greedy tokens from prompt + output[:position], its
    confidence at each, and its second choice at each with that choice's probability."""
    runs = []
    cache = DynamicCache()
    with torch.inference_mode():
        logits = draft(torch.tensor([prompt]), **cache_kwargs(draft, cache), use_cache=True).logits[0, -1]  # [V]
        for position in range(len(output)):
            base, step_logits, tokens, confidences, seconds, second_confidences = (
                cache.get_seq_length(), logits, [], [], [], [])
            for _ in range(k):
                top, ids = torch.softmax(step_logits.float(), -1).topk(2)
                tokens.append(int(ids[0]))
                confidences.append(float(top[0]))
                seconds.append(int(ids[1]))
                second_confidences.append(float(top[1]))
                step_logits = draft(torch.tensor([[int(ids[0])]]), **cache_kwargs(draft, cache),
                                    use_cache=True).logits[0, -1]
            cache.crop(base - cache.get_seq_length())
            runs.append((tokens, confidences, seconds, second_confidences))
            logits = draft(torch.tensor([[output[position]]]), **cache_kwargs(draft, cache),
                           use_cache=True).logits[0, -1]
    return runs


def fixed_length(k: int):
    return lambda confidences: k


def length_by_confidence(threshold: float, k: int):
    """transformers: stop after the first token whose own confidence is below the threshold."""
    return lambda confidences: next((i + 1 for i, c in enumerate(confidences[:k]) if c < threshold), k)


def length_by_run(threshold: float, k: int):
    """specmesh: stop after the first token at which the run probability falls below the threshold."""
    def length(confidences: list[float]) -> int:
        run = 1.0
        for i, confidence in enumerate(confidences[:k]):
            run *= confidence
            if run < threshold:
                return i + 1
        return k
    return length


def offered_alternatives(confidences: list[float], second_confidences: list[float], n: int, rate: float,
                         target_s: list[float]) -> set[int]:
    """The positions of n drafted whose second choice the policy offers at `rate` tokens a second
    (orchestrator.decoding.plan.RoundPlan.alternatives, its confidence factor 1)."""
    chances, run = [], 1.0
    for index in range(n):
        chances.append((run * second_confidences[index], index))
        run *= confidences[index]
    chosen: set[int] = set()
    for chance, index in sorted(chances, reverse=True):
        rows = n + len(chosen)  # target_s[rows]: n drafts, the last committed token, the alternatives so far
        if rows + 1 >= len(target_s) or chance < rate * (target_s[rows + 1] - target_s[rows]):
            break
        chosen.add(index)
    return chosen


def replay(requests, length, draft_s: float, target_s: list[float],
           alternatives_at: float | None = None) -> tuple[float, float, float, float, float]:
    """(tokens/s, drafted a round, tokens a round, accepted, the draft's expected accepted) over the requests'
    rounds; with alternatives_at, each round also verifies the alternatives offered at that rate."""
    seconds = rounds = drafted = tokens = accepted_all = expected_all = 0.0
    for output, runs in requests:
        position = 0
        while position < len(output):
            proposal, confidences, seconds_choice, second_confidences = runs[position]
            n = length(confidences)
            accepted = 0
            while (accepted < n and position + accepted < len(output)
                   and proposal[accepted] == output[position + accepted]):
                accepted += 1
            run, expected = 1.0, 0.0
            for confidence in confidences[:n]:
                run *= confidence
                expected += run
            offered = set() if alternatives_at is None else offered_alternatives(
                confidences, second_confidences, n, alternatives_at, target_s)
            taken = (accepted < n and accepted in offered and position + accepted < len(output)
                     and seconds_choice[accepted] == output[position + accepted])
            position += accepted + 1 + taken
            seconds += n * draft_s + target_s[n + len(offered)]
            rounds += 1
            drafted += n
            accepted_all += accepted
            expected_all += expected
        tokens += len(output)
    return tokens / seconds, drafted / rounds, tokens / rounds, accepted_all, expected_all


def main(argv: list[str] | None = None) -> dict[str, dict[str, tuple]]:
    """{kind: {rule: (tokens/s, drafted a round, tokens a round, accepted, expected)}}, "all" included."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--target-dtype", default="float32")
    parser.add_argument("--draft-dtype", default="auto")
    parser.add_argument("--kinds", nargs="+", default=list(KINDS))
    parser.add_argument("--num-prompts", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0, help="which prompts of each kind (as specmesh bench)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=7, help="the most draft tokens a round (the default k_max)")
    args = parser.parse_args(argv)
    print_header("benchmarks.draft_stop_replay", sys.argv[1:] if argv is None else argv)
    target, tokenizer = load_model_in(args.target, "cpu", args.target_dtype, "auto")
    draft, _ = load_model_in(args.draft, "cpu", args.draft_dtype, "auto")
    context = tokenizer.encode(CONTEXT)
    draft_s = forward_ms(draft, context, 1, TIMED_STEPS) / 1e3
    # n drafts + 1, and up to one alternative for each draft
    target_s = [forward_ms(target, context, n + 1, TIMED_STEPS) / 1e3 for n in range(2 * args.k + 1)]
    print(f"step costs here: draft {draft_s * 1e3:.1f} ms; target by rows 1..{2 * args.k + 1}: "
          + ", ".join(f"{s * 1e3:.0f}" for s in target_s) + " ms")
    eos = set(eos_token_ids(target, tokenizer))
    by_kind: dict[str, list] = {}
    for prompt in select_prompts(prompt_pool(args.kinds, None), args.num_prompts, args.seed):
        ids = prompt_ids(tokenizer, prompt)
        output = greedy(target, ids, args.max_tokens, eos)
        by_kind.setdefault(prompt.kind, []).append((output, draft_runs(draft, ids, output, args.k)))
    return report(by_kind, args.k, draft_s, target_s)


def report(by_kind: dict[str, list], k: int, draft_s: float, target_s: list[float]) -> dict[str, dict[str, tuple]]:
    rules = {f"k={n}": fixed_length(n) for n in range(1, k + 1)}
    rules.update({f"conf<{t}": length_by_confidence(t, k) for t in (0.3, 0.4, 0.5)})
    rules.update({f"run<{t}": length_by_run(t, k) for t in (0.2, 0.3, 0.4, 0.5, 0.6)})
    per_token_s = draft_s + (target_s[k] - target_s[1]) / max(k - 1, 1)  # the policy's price of one more token
    tables = {}
    for kind, requests in [("all", [r for rs in by_kind.values() for r in rs]), *by_kind.items()]:
        results = tables[kind] = {name: replay(requests, length, draft_s, target_s) for name, length in rules.items()}
        for t in (0.3, 0.4, 0.5):  # each at its own rate: what its rounds earn without alternatives
            name = f"run<{t}"
            results[f"{name}+alt"] = replay(requests, rules[name], draft_s, target_s, alternatives_at=results[name][0])
        best = max(results, key=lambda name: results[name][0])
        goodput, _, _, accepted, expected = results["run<0.4"]
        policy_t = goodput * per_token_s / (accepted / expected)
        print(f"\n== {kind} ({len(requests)} prompts): best {best}; the policy's T would be {policy_t:.2f} "
              f"(at run<0.4's goodput, the confidences' match to acceptance {accepted / expected:.2f})")
        print(f"{'rule':<9} {'tok/s':>6} {'drafted':>8} {'tokens':>7}")
        for name, (rate, drafted, tokens, _, _) in results.items():
            print(f"{name:<9} {rate:6.2f} {drafted:8.2f} {tokens:7.2f}")
    return tables


if __name__ == "__main__":
    main()
