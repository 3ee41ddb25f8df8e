"""How much continuous batching changes logits: one ragged step of N sessions against each alone.

Builds N sessions (default 8) over random, seeded prompts of mixed lengths. In each round every
session gets 1..k+1 new rows (a verification's k drafts plus the bonus position; a quarter of the
sessions instead take their whole prompt as a prefill in the first round), and the round is run
twice: as one ragged step over all sessions (`ModelEngine._run_step`, what the batching worker
runs) and session by session with `ModelEngine.forward` on copies that never saw a batched step.
Rounds after the first feed more rows on top, so the KV that batched steps appended is compared
too. Prints, per round, max |Δlogit| overall and per session, and whether every argmax agrees;
then one summary line for the README. The engine is warmed up and calibrated as a service's is,
so batched steps get the same row padding they get when serving.

It passes when: in fp32, max |Δlogit| stays at reordered-sum noise (below 1e-4, the bound
tests/test_batching.py asserts) and every argmax agrees, in every round.

By default the model is a tiny random-weight Llama built on the fly (benchmarks/tiny_models.py);
--model takes a real one:

    python -m benchmarks.batched_logits
    python -m benchmarks.batched_logits --model qwen2.5-coder-1.5b --sessions 8 --rounds 3
    python -m benchmarks.batched_logits --model qwen2.5-coder-0.5b --prompt-tokens 16 1024 --k 7
"""

from __future__ import annotations

import argparse
import copy
import random
import tempfile
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from specmesh.engine.batching import Part
from specmesh.engine.model_engine import EngineConfig, ModelEngine, Session
from specmesh.loading.precision import DTYPE_CHOICES, load_model_in
from specmesh.engine.sampling_params import SamplingParams

PREFILL_EVERY = 4  # every 4th session prefills its prompt inside the first batched step
NOISE_BOUND = 1e-4  # fp32 reordered sums (tests/test_batching.py's MAX_ABS_LOGIT_DELTA)


def tiny_model(root: Path) -> str:
    from benchmarks.tiny_models import TINY_CORPUS, build_tiny_model, build_tokenizer
    tokenizer = build_tokenizer(root / "tokenizer", corpus=TINY_CORPUS)
    return str(build_tiny_model(root / "model", "llama", tokenizer, seed=1, max_positions=4096))


def open_sessions(engine: ModelEngine, count: int, prompt_tokens: tuple[int, int], k: int,
                  rng: random.Random) -> tuple[list[Session], list[list[int]]]:
    """Sessions over random prompts; all but every PREFILL_EVERY-th have theirs cached already.

    Returns the sessions and the rows each feeds in the first step: a prefill's whole prompt, or the
    newest prompt token plus 0..k random drafts.
    """
    sessions, first_rows = [], []
    for index in range(count):
        prompt = [rng.randrange(engine.vocab_size) for _ in range(max(2, rng.randint(*prompt_tokens)))]
        session = Session(f"s{index}", list(prompt), DynamicCache(), SamplingParams(), torch.Generator())
        if index % PREFILL_EVERY == PREFILL_EVERY - 1:
            first_rows.append(prompt)
        else:
            engine.forward(session, prompt[:-1], 1)  # the cache never covers the newest token
            first_rows.append(prompt[-1:] + [rng.randrange(engine.vocab_size) for _ in range(rng.randint(0, k))])
        sessions.append(session)
    return sessions, first_rows


def compare_round(engine: ModelEngine, batched: list[Session], solo: list[Session],
                  rows: list[list[int]], keeps: list[int]) -> tuple[list[float], list[bool], list[float]]:
    """One ragged step over `batched`, one forward each over `solo`: per session (max |Δ|, argmax
    agrees, max |logit|) over its kept rows."""
    step_logits, _ = engine._run_step([Part(s, r, k) for s, r, k in zip(batched, rows, keeps)])
    deltas, agrees, scales = [], [], []
    for session, new_rows, keep, logits in zip(solo, rows, keeps, step_logits):
        alone, _ = engine.forward(session, new_rows, keep)  # [keep, V]
        deltas.append((logits - alone).abs().max().item())
        agrees.append(torch.equal(logits.argmax(-1), alone.argmax(-1)))
        scales.append(alone.abs().max().item())
    return deltas, agrees, scales


def next_rows(sessions: list[Session], k: int, vocab_size: int, rng: random.Random) -> list[list[int]]:
    """1..k+1 random rows per session: the newest token plus up to k drafts."""
    return [[rng.randrange(vocab_size) for _ in range(rng.randint(1, k + 1))] for _ in sessions]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model to load (default: a tiny one built here)")
    parser.add_argument("--dtype", default="float32", choices=DTYPE_CHOICES)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--k", type=int, default=4, help="new rows per session per round: 1..k+1")
    parser.add_argument("--prompt-tokens", type=int, nargs=2, default=(8, 256), metavar=("MIN", "MAX"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-calibrate", action="store_true", help="skip the start-up step-cost measurement")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as root:
        spec = args.model or tiny_model(Path(root))
        model, tokenizer = load_model_in(spec, args.device, args.dtype)
        engine = ModelEngine(model, tokenizer, EngineConfig(model_name=spec))
    try:
        return run(engine, args, rng)
    finally:
        engine.scheduler.stop()


def run(engine: ModelEngine, args: argparse.Namespace, rng: random.Random) -> dict:
    name = args.model or "tiny llama"
    if not engine.ragged:
        print(f"{name}: its attention cannot take a ragged mask, so steps run session by session (nothing to compare)")
    engine.warm_up()
    if not args.no_calibrate:
        started = time.perf_counter()
        engine.calibrate()
        print(f"calibrated step costs in {time.perf_counter() - started:.1f} s")
    batched, rows = open_sessions(engine, args.sessions, tuple(args.prompt_tokens), args.k, rng)
    solo = copy.deepcopy(batched)
    worst, all_agree, compared_rows, scale = 0.0, True, 0, 0.0
    print(f"{name} ({model_dtype(engine)}, {args.device}): {args.sessions} sessions, prompts "
          f"{args.prompt_tokens[0]}..{args.prompt_tokens[1]} tokens, 1..{args.k + 1} new rows per round")
    for round_number in range(args.rounds):
        keeps = [1 if len(r) > args.k + 1 else len(r) for r in rows]  # a prefill keeps its last row only
        cached = [session.cached_length for session in batched]
        deltas, agrees, scales = compare_round(engine, batched, solo, rows, keeps)
        worst, all_agree = max(worst, *deltas), all_agree and all(agrees)
        compared_rows, scale = compared_rows + sum(keeps), max(scale, *scales)
        per_session = " ".join(f"{d:.1e}{'' if a else '(argmax!)'}" for d, a in zip(deltas, agrees))
        print(f"  round {round_number + 1}: new rows {[len(r) for r in rows]} after cached {cached}")
        print(f"    max |Δlogit| {max(deltas):.2e}; argmax agrees: {all(agrees)}; per session: {per_session}")
        rows = next_rows(batched, args.k, engine.vocab_size, rng)
    summary = dict(max_abs_delta=worst, argmax_agrees=all_agree, rows=compared_rows, max_abs_logit=scale)
    print(f"summary: batched vs solo logits, {name} {model_dtype(engine)}, {args.sessions} sessions x "
          f"{args.rounds} rounds ({compared_rows} logit rows, |logit| up to {scale:.1f}): max |Δlogit| "
          f"{worst:.1e}, argmax {'agrees on every row' if all_agree else 'DIFFERS on some rows'}")
    met = worst < NOISE_BOUND and all_agree
    print(f"check (max |Δlogit| < {NOISE_BOUND:.0e} and every argmax agrees): {'met' if met else 'NOT met'}")
    return summary


def model_dtype(engine: ModelEngine) -> str:
    return str(engine.model.dtype).removeprefix("torch.")


if __name__ == "__main__":
    main()
