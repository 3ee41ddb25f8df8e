"""How `specmesh distill` fills the flags left at their defaults: the method and learning rate for the
draft's size, the precision the device runs fastest, and a training budget for the prompt set's size.

The budget is an upper bound: early stopping on the validation prompts (orchestrator.distill.
early_stopping) ends training where acceptance stops rising and keeps the best weights, so the
budget can be generous on small sets and the learning rate on the high side of what was measured.
"""

from __future__ import annotations

import argparse
import math

# Full tuning keeps weights, grads and two AdamW moments in float32 (16 B a parameter): under 5 GB below this.
FULL_FINE_TUNE_MAX_PARAMETERS = 300_000_000
LORA_RANK = 16
# Measured: full tuning at 1e-3 to 3e-3 doubled a tiny draft's agreement; LoRA at 1e-3 lifted the 0.5B draft.
LEARNING_RATE = {"lora": 1e-3, "full": 1e-3}
MIN_STEPS = 100  # 16 steps (two passes over 80 prompts) were measured to gain nothing; early stopping ends sooner
MAX_STEPS = 4000  # 32,000 sequences of batch 8: past that, more prompts cost hours of teacher time for little
PASSES = 2  # passes over the training sequences between those bounds
VALIDATION_FRACTION = 0.1  # of the prompts, for early stopping and the choice of k
VALIDATION_MAX = 200  # ~10,000 continuation tokens: past that, evaluations cost more than they tell
HELD_OUT_MAX = 1000  # the report's prompts: its figures are settled to a fraction of a percent by then
PATIENCE = 3  # evaluations without improvement: one or two can dip on a small validation set and recover
LEARNING_RATE_CUTS = 2  # on running out of patience, back to the best weights at a third of the rate; then stop
MIN_EVALUATION_INTERVAL = 10  # steps: evaluating more often only re-measures noise
EVALUATION_SHARE = 2  # evaluate every 2 x (validation forwards) steps: validation costs about a sixth of training


def resolve_dtype(name: str, device: str) -> str:
    """'auto' is bfloat16 where the device computes it natively (faster), else float32."""
    if name != "auto":
        return name
    from specmesh.loading.precision import native_bf16  # torch: not at import, the CLI's flags read this module

    return "bfloat16" if native_bf16(device) else "float32"


def parameter_count(model) -> int:
    return sum(p.numel() for p in model.parameters())


def lora_rank_for(parameters: int, requested: int | None) -> int:
    """The LoRA rank to train with, 0 for a full fine-tune: `requested` if given, else by the draft's size."""
    if requested is not None:
        return requested
    return 0 if parameters <= FULL_FINE_TUNE_MAX_PARAMETERS else LORA_RANK


def learning_rate_for(lora_rank: int, requested: float | None) -> float:
    if requested is not None:
        return requested
    return LEARNING_RATE["lora" if lora_rank > 0 else "full"]


def steps_for(epochs: float, num_sequences: int, batch_size: int) -> int:
    return max(1, math.ceil(epochs * num_sequences / batch_size))


def step_budget(num_sequences: int, batch_size: int) -> int:
    """Optimiser steps when neither --steps nor --epochs is given: PASSES passes, within MIN_STEPS..MAX_STEPS."""
    return min(MAX_STEPS, max(MIN_STEPS, steps_for(PASSES, num_sequences, batch_size)))


def training_prompt_limit(args: argparse.Namespace) -> int | None:
    """Training prompts worth making data for: under the automatic budget, what one pass of MAX_STEPS uses
    (the teacher's continuations of the rest would never be trained on); None: all of them."""
    if args.steps is not None or args.epochs is not None:
        return None
    return max(1, MAX_STEPS * args.batch_size // (1 + args.on_policy_samples))


def training_steps(args: argparse.Namespace, num_sequences: int) -> int:
    if args.steps is not None:
        return args.steps
    if args.epochs is not None:
        return steps_for(args.epochs, num_sequences, args.batch_size)
    return step_budget(num_sequences, args.batch_size)


def evaluation_interval(validation_prompts: int, batch_size: int) -> int:
    """Steps between validation evaluations: a teacher-forced forward of the validation prompts costs
    about a third of a training step per batch, so this keeps evaluation a small share of the time."""
    return max(MIN_EVALUATION_INTERVAL, EVALUATION_SHARE * math.ceil(validation_prompts / batch_size))
