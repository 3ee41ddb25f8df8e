"""`specmesh distill`: measure, train, measure again, save if it helped.

1. The held-out and validation prompts' greedy target continuations (float32: what serving
   commits), the draft's acceptance on them before training, and the draft/target step-cost ratio.
2. Training data from the training prompts: the target's greedy continuations with its
   distributions, and optionally the draft's own samples scored by the target (on-policy, GKD style).
3. A full fine-tune (small drafts) or LoRA (merged afterwards) towards those distributions,
   early-stopped on the validation prompts' expected speed-up (orchestrator.distill.defaults).
4. The report at the k the server would draft (orchestrator.distill.draft_length), chosen on the
   validation prompts; the model directory only when held-out tokens per round rose (or --force).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from orchestrator.distill import defaults, teacher
from orchestrator.distill.acceptance import AcceptanceStats, measure_acceptance
from orchestrator.distill.args import NO_GAIN_EXIT, check_args
from orchestrator.distill.draft_length import (SERVER_MAX_K, choose_k, position_rates, relative_speed,
                                               step_cost_ratio)
from orchestrator.distill.early_stopping import EarlyStopping
from orchestrator.distill.examples import DistillInputError, Example, check_token_ids, load_examples, split_examples
from orchestrator.distill.report import build_report, format_report, improved, write_report
from orchestrator.distill.training import TrainingSettings, finish_training, make_trainable, train
from specmesh.loading.cpu_linear import choose_cpu_linear
from specmesh.loading.models import ModelNotFoundError, eos_token_ids, load_model, load_tokenizer, vocab_fingerprint


@dataclass
class Reference:
    """Prompts with the target's greedy continuations [N, L]: what acceptance is measured against."""
    prompts: list[tuple[int, ...]]
    continuations: torch.Tensor


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
    cost_ratio: float = 1.0  # a draft step's time over a target step's
    times: dict[str, float] = field(default_factory=dict)

    @property
    def k_max(self) -> int:
        return max(SERVER_MAX_K, self.args.k or 0)

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
    if args.report_json:
        Path(args.report_json).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    if report["written"]:
        print(f"model and report: {args.output}")
    else:
        print(f"nothing written to {args.output}: the draft did not improve (--force writes it anyway)")
    return 0 if report["improved"] else NO_GAIN_EXIT


def distill(run: Run) -> dict:
    args = run.args
    started = time.monotonic()
    torch.manual_seed(args.seed)
    with run.phase("load"):
        train_set, validation_set, held_out_set = _prompts(args)
        load_models(run)
        check_token_ids(train_set + validation_set + held_out_set, run.vocab_size)
        train_set = train_set[:defaults.training_prompt_limit(args)]
    with run.phase("evaluate"):
        held_out, validation = reference(run, held_out_set), reference(run, validation_set)
        before = draft_argmax(run, run.draft, held_out, "draft before")
        _print_before(run, validation, held_out, before)
    with run.phase("training data"):
        sequences = training_sequences(run, _ids(train_set))
    with run.phase("training"):
        losses, stopping = train_draft(run, sequences, validation)
    with run.phase("evaluate"):
        k, k_source = report_k(run, validation)
        after = draft_argmax(run, run.draft, held_out, "draft after")
    stats = {name: replay(run, argmax, held_out, k) for name, argmax in (("before", before), ("after", after))}
    gained = improved(stats["before"], stats["after"])
    if gained or args.force:
        with run.phase("save"):
            save_model(run, Path(args.output))
    run.times["total"] = time.monotonic() - started
    report = build_report(args, dict(train=len(train_set), validation=len(validation_set),
                                     held_out=len(held_out_set), sequences=len(sequences)),
                          stats, losses, k=k, k_source=k_source, stopping=stopping, cost_ratio=run.cost_ratio,
                          times=run.times, written=gained or args.force)
    if report["written"]:
        write_report(report, losses, Path(args.output))
    return report


def _prompts(args: argparse.Namespace) -> tuple[list[Example], list[Example], list[Example]]:
    tokenizer = load_tokenizer(args.target)
    if vocab_fingerprint(tokenizer) != vocab_fingerprint(load_tokenizer(args.draft)):
        raise DistillInputError(f"the draft {args.draft!r} and the target {args.target!r} have different "
                                "vocabularies; speculation (and distillation) needs the same token ids")
    examples = load_examples(args.prompts, tokenizer, args.max_prompt_tokens)
    return split_examples(examples, args.held_out_fraction, args.seed)


def _ids(examples: list[Example]) -> list[tuple[int, ...]]:
    return [e.prompt_token_ids for e in examples]


def load_models(run: Run) -> None:
    """Both models, the step-cost ratio, and the flags left to defaults.py settled for this draft."""
    args = run.args
    run.target, tokenizer = load_model(args.target, args.device)
    run.draft, run.draft_tokenizer = load_model(args.draft, args.device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    run.pad_id = int(pad or 0)  # padded positions are masked; any id works
    run.vocab_size = min(_output_size(run.target), _output_size(run.draft))
    run.eos_ids = {"target": set(eos_token_ids(run.target, tokenizer)),
                   "draft": set(eos_token_ids(run.draft, run.draft_tokenizer))}
    run.cost_ratio = step_cost_ratio(run.draft, run.target)
    args.lora_rank = defaults.lora_rank_for(defaults.parameter_count(run.draft), args.lora_rank)
    args.learning_rate = defaults.learning_rate_for(args.lora_rank, args.learning_rate)
    args.teacher_dtype = defaults.resolve_dtype(args.teacher_dtype, args.device)
    args.train_dtype = defaults.resolve_dtype(args.train_dtype, args.device)
    if args.teacher_dtype == "float32":  # the teacher only infers: the services' faster kernel where it is faster
        choose_cpu_linear(run.target, "auto", args.device)


def _output_size(model) -> int:
    return model.get_output_embeddings().weight.shape[0]


def reference(run: Run, examples: list[Example]) -> Reference:
    prompts = _ids(examples)
    return Reference(prompts, teacher.greedy_continuations(run.target, prompts, run.args.max_new_tokens,
                                                           run.args.generation_batch_size, run.pad_id,
                                                           run.progress))


def draft_argmax(run: Run, model, on: Reference, label: str) -> torch.Tensor:
    return teacher.teacher_forced_argmax(model, on.prompts, on.continuations, run.args.generation_batch_size,
                                         run.pad_id, run.progress, label)


def replay(run: Run, argmax: torch.Tensor, on: Reference, k: int) -> AcceptanceStats:
    return measure_acceptance(argmax, on.continuations, k, run.eos_ids["target"], run.eos_ids["draft"])


def speed(run: Run, model, validation: Reference) -> tuple[int, float]:
    """(k, tokens per second relative to the target alone) of `model` on the validation prompts, at
    --k or at the k the server would choose."""
    stats = replay(run, draft_argmax(run, model, validation, "validation"), validation, run.k_max)
    rates = position_rates(stats, run.k_max)
    k = run.args.k or choose_k(rates, run.cost_ratio, run.k_max)
    return k, relative_speed(rates, k, run.cost_ratio)


def report_k(run: Run, validation: Reference) -> tuple[int, str]:
    if run.args.k:
        return run.args.k, "--k"
    return speed(run, run.draft, validation)[0], "chosen on the validation prompts"


def _print_before(run: Run, validation: Reference, held_out: Reference, before: torch.Tensor) -> None:
    """Seen even if training is cut short."""
    k = report_k(run, validation)[0]
    stats = replay(run, before, held_out, k)
    print(f"held-out before training, k = {k}: acceptance rate {stats.acceptance_rate:.3f}, "
          f"tokens per round {stats.tokens_per_round:.3f}", flush=True)


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


def train_draft(run: Run, sequences: list, validation: Reference) -> tuple[list[float], EarlyStopping]:
    args = run.args
    steps = defaults.training_steps(args, len(sequences))
    settings = TrainingSettings(steps=steps, batch_size=args.batch_size, learning_rate=args.learning_rate,
                                divergence=args.divergence, seed=args.seed, compute_dtype=args.train_dtype)
    stopping = EarlyStopping(score=lambda model: speed(run, model, validation)[1], patience=args.patience,
                             interval=defaults.evaluation_interval(len(validation.prompts), args.batch_size))
    run.target = None  # training needs the memory more; the evaluation continuations are kept
    model = make_trainable(run.draft, args.lora_rank)
    with tqdm(total=steps, desc="training", unit="step", disable=args.no_progress) as bar:
        def on_step(step: int, loss: float) -> None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}", best=f"{stopping.best:.3f}")
        losses = train(model, sequences, settings, run.pad_id, on_step, stopping)
    run.draft = finish_training(model)
    return losses, stopping


def save_model(run: Run, output: Path) -> None:
    output.mkdir(exist_ok=True)
    run.draft.save_pretrained(str(output), safe_serialization=True)
    run.draft_tokenizer.save_pretrained(str(output))
