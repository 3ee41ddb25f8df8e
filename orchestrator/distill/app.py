"""`specmesh distill`: measure, train, measure again, save.

1. The held-out prompts' greedy target continuations (float32: what serving commits) and the
   draft's acceptance on them at fixed k, before training.
2. Training data from the training prompts: the target's greedy continuations with its
   distributions, and the draft's own samples scored by the target (on-policy, GKD style).
3. LoRA (merged afterwards) or full fine-tune of the draft towards those distributions.
4. Acceptance again, then the model directory (weights, config, tokenizer) and the report.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from orchestrator.distill import teacher
from orchestrator.distill.acceptance import AcceptanceStats, measure_acceptance
from orchestrator.distill.args import check_args, learning_rate
from orchestrator.distill.examples import DistillInputError, Example, check_token_ids, load_examples, split_examples
from orchestrator.distill.report import format_report, relative_change, write_report
from orchestrator.distill.training import TrainingSettings, finish_training, make_trainable, steps_for, train
from specmesh.models import ModelNotFoundError, eos_token_ids, load_model, load_tokenizer, vocab_fingerprint


@dataclass
class Run:
    """What every phase needs: the flags, the loaded models and the timings so far."""
    args: argparse.Namespace
    target: object = None
    draft: object = None
    draft_tokenizer: object = None
    pad_id: int = 0
    vocab_size: int = 0  # ids both models can produce (the target's padded rows are never produced)
    eos_ids: dict[str, set[int]] = field(default_factory=dict)  # "target" / "draft" -> ids that end text
    times: dict[str, float] = field(default_factory=dict)

    def progress(self, items, label: str):
        return tqdm(items, desc=label, unit="batch", disable=self.args.no_progress, leave=False)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        started = time.monotonic()
        yield
        self.times[name] = self.times.get(name, 0.0) + time.monotonic() - started



def run(args: argparse.Namespace) -> int:
    problem = check_args(args)
    if problem:
        print(f"specmesh distill: {problem}", file=sys.stderr)
        return 2
    try:
        report = distill(Run(args))
    except (DistillInputError, ModelNotFoundError) as error:
        print(f"specmesh distill: {error}", file=sys.stderr)
        return 2
    print(format_report(report))
    print(f"model and report: {args.output}")
    return 0


def distill(run: Run) -> dict:
    args = run.args
    started = time.monotonic()
    torch.manual_seed(args.seed)
    with run.phase("load"):
        train_set, held_out = _prompts(args)
        load_models(run)
        check_token_ids(train_set + held_out, run.vocab_size)
    with run.phase("evaluate"):
        continuations = teacher.greedy_continuations(run.target, _ids(held_out), args.max_new_tokens,
                                                     args.generation_batch_size, run.pad_id, run.progress)
        before = evaluate(run, held_out, continuations, "draft before")
    print(f"held-out before training, k = {args.k}: acceptance rate {before.acceptance_rate:.3f}, "
          f"tokens per round {before.tokens_per_round:.3f}", flush=True)  # seen even if training is cut short
    with run.phase("training data"):
        sequences = training_sequences(run, _ids(train_set))
    with run.phase("training"):
        losses = train_draft(run, sequences)
    with run.phase("evaluate"):
        after = evaluate(run, held_out, continuations, "draft after")
    with run.phase("save"):
        save_model(run, Path(args.output))
    run.times["total"] = time.monotonic() - started
    report = build_report(run, len(train_set), len(held_out), len(sequences), before, after, losses)
    write_report(report, losses, Path(args.output))
    return report


def _prompts(args: argparse.Namespace) -> tuple[list[Example], list[Example]]:
    tokenizer = load_tokenizer(args.target)
    if vocab_fingerprint(tokenizer) != vocab_fingerprint(load_tokenizer(args.draft)):
        raise DistillInputError(f"the draft {args.draft!r} and the target {args.target!r} have different "
                                "vocabularies; speculation (and distillation) needs the same token ids")
    examples = load_examples(args.prompts, tokenizer, args.max_prompt_tokens)
    return split_examples(examples, args.held_out_fraction, args.seed)


def _ids(examples: list[Example]) -> list[tuple[int, ...]]:
    return [e.prompt_token_ids for e in examples]


def load_models(run: Run) -> None:
    run.target, tokenizer = load_model(run.args.target, run.args.device)
    run.draft, run.draft_tokenizer = load_model(run.args.draft, run.args.device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    run.pad_id = int(pad or 0)  # padded positions are masked; any id works
    run.vocab_size = min(_output_size(run.target), _output_size(run.draft))
    run.eos_ids = {"target": set(eos_token_ids(run.target, tokenizer)),
                   "draft": set(eos_token_ids(run.draft, run.draft_tokenizer))}


def _output_size(model) -> int:
    return model.get_output_embeddings().weight.shape[0]


def evaluate(run: Run, held_out: list[Example], continuations: torch.Tensor, label: str) -> AcceptanceStats:
    argmax = teacher.teacher_forced_argmax(run.draft, _ids(held_out), continuations,
                                           run.args.generation_batch_size, run.pad_id, run.progress, label)
    return measure_acceptance(argmax, continuations, run.args.k, run.eos_ids["target"], run.eos_ids["draft"])


def training_sequences(run: Run, prompts: list[tuple[int, ...]]) -> list:
    args = run.args
    if args.teacher_dtype == "bfloat16":  # after the float32 evaluation continuations
        run.target.to(torch.bfloat16)
    common = dict(length=args.max_new_tokens, top_k=args.distribution_top_k, vocab_size=run.vocab_size,
                  batch_size=args.generation_batch_size, pad_id=run.pad_id, progress=run.progress)
    sequences = teacher.target_sequences(run.target, prompts, eos_ids=run.eos_ids["target"], **common)
    for sample in range(args.on_policy_samples):
        torch.manual_seed(args.seed + 1 + sample)
        sequences += teacher.on_policy_sequences(run.draft, run.target, prompts, temperature=args.draft_temperature,
                                                 draft_dtype=args.train_dtype, eos_ids=run.eos_ids["draft"], **common)
    return sequences


def train_draft(run: Run, sequences: list) -> list[float]:
    args = run.args
    steps = args.steps or steps_for(args.epochs, len(sequences), args.batch_size)
    settings = TrainingSettings(steps=steps, batch_size=args.batch_size, learning_rate=learning_rate(args),
                                divergence=args.divergence, seed=args.seed, compute_dtype=args.train_dtype)
    run.target = None  # training needs the memory more; the evaluation continuations are kept
    model = make_trainable(run.draft, args.lora_rank)
    with tqdm(total=steps, desc="training", unit="step", disable=args.no_progress) as bar:
        def on_step(step: int, loss: float) -> None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}")
        losses = train(model, sequences, settings, run.pad_id, on_step)
    run.draft = finish_training(model)
    return losses


def save_model(run: Run, output: Path) -> None:
    output.mkdir(exist_ok=True)
    run.draft.save_pretrained(str(output), safe_serialization=True)
    run.draft_tokenizer.save_pretrained(str(output))


def build_report(run: Run, train_prompts: int, held_out_prompts: int, training_sequences: int,
                 before: AcceptanceStats, after: AcceptanceStats, losses: list[float]) -> dict:
    args = run.args
    settings = {name: getattr(args, name) for name in (
        "k", "max_new_tokens", "max_prompt_tokens", "batch_size", "generation_batch_size", "lora_rank",
        "on_policy_samples",
        "draft_temperature", "distribution_top_k", "divergence", "teacher_dtype", "train_dtype", "held_out_fraction",
        "seed",
        "device")}
    settings.update(steps=len(losses), epochs=None if args.steps else args.epochs, learning_rate=learning_rate(args))
    return {
        "target": args.target, "draft": args.draft, "prompts": args.prompts, "output": args.output,
        "train_prompts": train_prompts, "held_out_prompts": held_out_prompts,
        "training_sequences": training_sequences, "settings": settings,
        "before": before.as_dict(), "after": after.as_dict(),
        "tokens_per_round_relative_change": relative_change(before.tokens_per_round, after.tokens_per_round),
        "acceptance_rate_change": after.acceptance_rate - before.acceptance_rate,
        "loss": {"first": losses[0], "last": losses[-1]},
        "wall_time_s": {name: round(seconds, 2) for name, seconds in run.times.items()},
    }
