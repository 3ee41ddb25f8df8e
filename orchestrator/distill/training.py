"""Training the draft towards the target's token distributions (DistillSpec / GKD style).

Each training sequence is a prompt plus a continuation — the target's own greedy one,
or the draft's sampled one (on-policy) — with the target's distribution at every
continuation position kept as its top K tokens plus the rest mass (K+1 buckets):
exact for the tokens that matter, and memory bounded whatever the vocabulary.
The loss compares the draft's distribution collapsed onto the same buckets.
"""

from __future__ import annotations

import contextlib
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from orchestrator.distill.batches import continuation_logits
from orchestrator.distill.early_stopping import CUT, CUT_FACTOR, STOP, EarlyStopping

if TYPE_CHECKING:
    from transformers import PreTrainedModel

_TINY = 1e-8


@dataclass(frozen=True)
class TrainingSequence:
    prompt_token_ids: tuple[int, ...]
    continuation: torch.Tensor  # [L] token ids
    target_top_ids: torch.Tensor  # [L, K] the target's most likely next tokens at each position
    target_top_probs: torch.Tensor  # [L, K] their probabilities
    weight: torch.Tensor  # [L] 1 up to and including the first eos, 0 after (never served)


@dataclass(frozen=True)
class TrainingSettings:
    steps: int
    batch_size: int
    learning_rate: float
    divergence: str = "kl"
    seed: int = 0
    max_grad_norm: float = 1.0
    compute_dtype: str = "float32"  # "bfloat16": forward/backward under autocast, weights stay float32


def autocast(model: PreTrainedModel, compute_dtype: str) -> contextlib.AbstractContextManager:
    """bf16 matmuls with float32 weights and updates (CPUs with AMX run bf16 several times faster)."""
    if compute_dtype != "bfloat16":
        return contextlib.nullcontext()
    return torch.autocast(device_type=model.device.type, dtype=torch.bfloat16)


def bucket_divergence(draft_logits: torch.Tensor, top_ids: torch.Tensor, top_probs: torch.Tensor,
                      divergence: str) -> torch.Tensor:
    """draft_logits [B, L, V], top_ids/top_probs [B, L, K] -> [B, L] divergence per position.

    "kl": forward KL(target || draft), the mode-covering choice of DistillSpec's ablations;
    "tvd": total variation, which is exactly 1 - the acceptance probability under sampling."""
    log_q = torch.log_softmax(draft_logits, dim=-1).gather(-1, top_ids)  # [B, L, K]
    q = log_q.exp()
    p_rest = (1 - top_probs.sum(-1)).clamp(min=0)  # [B, L]
    q_rest = (1 - q.sum(-1)).clamp(min=_TINY)  # [B, L]
    if divergence == "tvd":
        return 0.5 * ((top_probs - q).abs().sum(-1) + (p_rest - q_rest).abs())
    kl_top = (top_probs * (torch.log(top_probs.clamp(min=_TINY)) - log_q)).sum(-1)
    return kl_top + p_rest * (torch.log(p_rest.clamp(min=_TINY)) - torch.log(q_rest))


def batch_loss(model: PreTrainedModel, batch: list[TrainingSequence], pad_id: int, divergence: str) -> torch.Tensor:
    """Mean divergence over the batch's served positions."""
    logits = continuation_logits(model, [s.prompt_token_ids for s in batch],
                                 [s.continuation.tolist() for s in batch], pad_id)  # [B, L, V]
    per_position = bucket_divergence(logits, torch.stack([s.target_top_ids for s in batch]).to(logits.device),
                                     torch.stack([s.target_top_probs for s in batch]).to(logits.device),
                                     divergence)  # [B, L]
    weight = torch.stack([s.weight for s in batch]).to(logits.device)  # [B, L]
    return (per_position * weight).sum() / weight.sum().clamp(min=1)


def make_trainable(model: PreTrainedModel, lora_rank: int) -> PreTrainedModel:
    """LoRA adapters on every linear layer (rank > 0), or every weight (rank 0)."""
    if lora_rank <= 0:
        model.requires_grad_(True)
        model.train()
        return model
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, lora_dropout=0.0, target_modules="all-linear",
                        task_type="CAUSAL_LM")
    model = get_peft_model(model, config)
    model.train()
    return model


def finish_training(model: PreTrainedModel) -> PreTrainedModel:
    """The plain model with any adapter merged into its weights, in eval mode, without grads."""
    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    model.eval()
    model.requires_grad_(False)
    return model


def train(model: PreTrainedModel, sequences: list[TrainingSequence], settings: TrainingSettings, pad_id: int,
          on_step: Callable[[int, float], None] = lambda step, loss: None,
          stopping: EarlyStopping | None = None) -> list[float]:
    """Up to `settings.steps` optimiser steps over shuffled batches (reshuffled every pass), ending on the
    best weights `stopping` measured; the losses of the steps run."""
    parameters = [p for p in model.parameters() if p.requires_grad]
    optimiser = torch.optim.AdamW(parameters, lr=settings.learning_rate, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimiser, _warmup_cosine(settings.steps))
    rng = random.Random(settings.seed)
    losses: list[float] = []
    batches = _batches(sequences, settings.batch_size, rng)
    if stopping is not None and stopping.enabled:
        stopping.evaluate(model, 0)
    for step in range(1, settings.steps + 1):
        with autocast(model, settings.compute_dtype):
            loss = batch_loss(model, next(batches), pad_id, settings.divergence)
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, settings.max_grad_norm)
        optimiser.step()
        schedule.step()
        losses.append(loss.item())
        on_step(step, losses[-1])
        if stopping is not None and stopping.due(step, step == settings.steps):
            outcome = stopping.evaluate(model, step)
            if outcome == STOP:
                break
            if outcome == CUT:  # the best weights are back: fresh moments at the lower rate
                optimiser.state.clear()
                schedule.base_lrs = [rate * CUT_FACTOR for rate in schedule.base_lrs]
    if stopping is not None:
        stopping.restore_best(model)
    return losses


def _batches(sequences: list[TrainingSequence], batch_size: int, rng: random.Random):
    while True:
        order = list(sequences)
        rng.shuffle(order)
        for start in range(0, len(order), batch_size):
            yield order[start:start + batch_size]


def _warmup_cosine(steps: int) -> Callable[[int], float]:
    """Learning-rate factor: linear warm-up over the first 5 % of steps, then cosine to 10 %."""
    warmup = max(1, steps // 20)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
    return factor

