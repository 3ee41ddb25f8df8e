"""What the models produce for distillation: continuations, the target's distributions over
them, and the draft's teacher-forced guesses. Batched; one progress-bar step per batch."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import torch

from orchestrator.distill.batches import continuation_logits, generate_continuations, sparse_top_k
from orchestrator.distill.training import TrainingSequence, autocast

if TYPE_CHECKING:
    from transformers import PreTrainedModel

Prompts = Sequence[Sequence[int]]
Progress = Callable[[Iterable, str], Iterable]


def chunks(items: Sequence, size: int) -> list[Sequence]:
    return [items[start:start + size] for start in range(0, len(items), size)]


def served_weight(continuation: torch.Tensor, eos_ids: set[int]) -> torch.Tensor:
    """[L] -> [L]: 1 up to and including the first eos, 0 after it (text nobody is served)."""
    is_eos = torch.tensor([int(t) in eos_ids for t in continuation.tolist()], dtype=torch.long)
    after_first_eos = (is_eos.cumsum(0) - is_eos) > 0
    return (~after_first_eos).float()


def target_sequences(target: PreTrainedModel, prompts: Prompts, length: int, top_k: int, vocab_size: int,
                     batch_size: int, pad_id: int, eos_ids: set[int], progress: Progress) -> list[TrainingSequence]:
    """The target's greedy continuations, with its distributions from the same generate call."""
    sequences = []
    for batch in progress(chunks(prompts, batch_size), "target continuations"):
        tokens, (top_ids, top_probs) = generate_continuations(target, batch, length, pad_id, top_k=top_k,
                                                                 vocab_size=vocab_size)
        sequences += [TrainingSequence(tuple(p), tokens[i], top_ids[i], top_probs[i], served_weight(tokens[i], eos_ids))
                      for i, p in enumerate(batch)]
    return sequences


@torch.no_grad()
def on_policy_sequences(draft: PreTrainedModel, target: PreTrainedModel, prompts: Prompts, length: int,
                        top_k: int, vocab_size: int, batch_size: int, temperature: float, pad_id: int,
                        eos_ids: set[int], progress: Progress, draft_dtype: str = "float32") -> list[TrainingSequence]:
    """The draft's own continuations (sampled at `temperature`, 0 = greedy; under bf16 autocast with
    draft_dtype "bfloat16") scored by the target in one teacher-forced forward: where the draft goes
    wrong is what it has to unlearn."""
    sequences = []
    for batch in progress(chunks(prompts, batch_size), "draft samples scored by target"):
        with autocast(draft, draft_dtype):
            tokens, _ = generate_continuations(draft, batch, length, pad_id, temperature=temperature)
        logits = continuation_logits(target, batch, tokens.tolist(), pad_id)  # [B, L, V]
        top_ids, top_probs = sparse_top_k(logits, top_k, vocab_size)
        sequences += [TrainingSequence(tuple(p), tokens[i], top_ids[i].cpu(), top_probs[i].cpu(),
                                       served_weight(tokens[i], eos_ids)) for i, p in enumerate(batch)]
    return sequences


def greedy_continuations(target: PreTrainedModel, prompts: Prompts, length: int, batch_size: int, pad_id: int,
                         progress: Progress) -> torch.Tensor:
    """[N, L]: what greedy serving commits for each prompt (and what the target predicts past its eos)."""
    rows = [generate_continuations(target, batch, length, pad_id)[0]
            for batch in progress(chunks(prompts, batch_size), "held-out target continuations")]
    return torch.cat(rows)


@torch.no_grad()
def teacher_forced_argmax(model: PreTrainedModel, prompts: Prompts, continuations: torch.Tensor, batch_size: int,
                          pad_id: int, progress: Progress, label: str) -> torch.Tensor:
    """[N, L]: the model's argmax for continuation index j given prompt + continuation[:j]."""
    rows = []
    for start in progress(range(0, len(prompts), batch_size), label):
        batch = prompts[start:start + batch_size]
        rows.append(continuation_logits(model, batch, continuations[start:start + batch_size].tolist(),
                                        pad_id).argmax(-1).cpu())
    return torch.cat(rows)
