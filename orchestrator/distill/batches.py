"""Left-padded batches of (prompt, continuation) and the model calls over them.

Every continuation in a run has the same length L (generation never stops early),
so with left padding all continuations sit in the last L columns: one slice picks
the rows that predict them, whatever each prompt's length.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def left_pad(sequences: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids [B, T], attention_mask [B, T]) with the padding on the left."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        if sequence:
            ids[row, width - len(sequence):] = torch.tensor(list(sequence), dtype=torch.long)
            mask[row, width - len(sequence):] = 1
    return ids, mask


def position_ids(mask: torch.Tensor) -> torch.Tensor:
    """[B, T] positions counted from each row's first real token, as generate() assigns them."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


def continuation_logits(model: PreTrainedModel, prompts: Sequence[Sequence[int]],
                        continuations: Sequence[Sequence[int]], pad_id: int) -> torch.Tensor:
    """[B, L, V]: row j of each sequence is the model's logits for continuation token j,
    teacher-forced on prompt + continuation[:j]. All continuations have length L."""
    length = len(continuations[0])
    ids, mask = left_pad([list(p) + list(c) for p, c in zip(prompts, continuations)], pad_id)
    device = model.device
    # the last L+1 rows predict continuation[0..L-1] and one token past it (dropped)
    logits = model(input_ids=ids.to(device), attention_mask=mask.to(device),
                   position_ids=position_ids(mask).to(device), logits_to_keep=length + 1, use_cache=False).logits
    return logits[:, :length].float()


@contextmanager
def plain_generation_defaults(model: PreTrainedModel) -> Iterator[None]:
    """generate() fills unset options from the model's generation_config (repetition penalties,
    eos, top-k...). A blank one for the duration keeps greedy = argmax and sampling = softmax."""
    from transformers import GenerationConfig

    saved = model.generation_config
    model.generation_config = GenerationConfig()
    try:
        yield
    finally:
        model.generation_config = saved


@torch.no_grad()
def generate_continuations(model: PreTrainedModel, prompts: Sequence[Sequence[int]], length: int, pad_id: int,
                           temperature: float = 0.0, top_k: int = 0,
                           vocab_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(tokens [B, L], top-k of the generating distribution or None).

    Exactly `length` tokens each: no eos stops generation, because the speculative loop's draft
    and target keep predicting past where the served text ends, and the rounds depend on it.
    With top_k > 0 the softmax of every step's logits is returned as (ids [B, L, K], probs [B, L, K]),
    saving the teacher a second forward over its own continuation."""
    from transformers import GenerationConfig

    ids, mask = left_pad(prompts, pad_id)
    sampling = temperature > 0
    config = GenerationConfig(max_new_tokens=length, do_sample=sampling,
                              temperature=temperature if sampling else None, top_k=0 if sampling else None,
                              top_p=1.0 if sampling else None, eos_token_id=[], pad_token_id=pad_id,
                              return_dict_in_generate=True, output_logits=top_k > 0)
    with plain_generation_defaults(model):
        out = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                             generation_config=config)
    tokens = out.sequences[:, ids.shape[1]:].cpu()  # [B, L]
    if tokens.shape[1] != length:
        raise RuntimeError(f"generate returned {tokens.shape[1]} tokens, expected {length}")
    if top_k <= 0:
        return tokens, None
    logits = torch.stack(out.logits, dim=1).float().cpu()  # [B, L, V]
    return tokens, sparse_top_k(logits, top_k, vocab_size)


def sparse_top_k(logits: torch.Tensor, top_k: int,
                 vocab_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [..., V] -> (ids [..., K], probs [..., K]) of the softmax's K most likely tokens among
    the first `vocab_size` (the draft's); the mass outside them is 1 - probs.sum(-1)."""
    probs = torch.softmax(logits[..., :vocab_size].float(), dim=-1)
    top = probs.topk(min(top_k, probs.shape[-1]), dim=-1)
    return top.indices, top.values
