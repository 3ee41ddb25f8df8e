"""One forward for several sessions: their new rows concatenated, padding-free.

Each session keeps its own KV cache (a DynamicCache, so rollback stays a crop). For a
step, every layer's cached keys and values are concatenated along the sequence into
one batch-1 cache of P positions, the parts' new tokens into one sequence of T rows,
and a [T, P + T] mask lets each row see its own session's cache and the rows of its
own part before it, nothing else. Position ids are each session's own, so RoPE puts
every row where a solo forward would. After the forward, each part's new keys and
values (the last T positions of the batch cache, sliced per part) are appended to
its session's cache; padding rows are dropped.

Attention over other sessions' masked positions costs T x P per layer, small next to
the weight passes that batching shares; the copies in and out are the price of
keeping one cache per session.
"""

from __future__ import annotations

from typing import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from specmesh.batching import Part

RAGGED_ATTENTION = ("sdpa", "eager")  # those that take a custom 4D mask


def supports_ragged(model: PreTrainedModel) -> bool:
    layer_types = set(getattr(model.config, "layer_types", None) or ["full_attention"])
    return model.config._attn_implementation in RAGGED_ATTENTION and layer_types == {"full_attention"}


@torch.inference_mode()
def ragged_forward(model: PreTrainedModel, parts: Sequence[Part], padding: int,
                   device: torch.device, logits_device: torch.device) -> list[torch.Tensor | None]:
    """Logits [keep_rows, V] float32 on the CPU per part (None where keep_rows is 0)."""
    past_lengths = [part.session.cache.get_seq_length() for part in parts]
    rows = [len(part.token_ids) for part in parts]
    past, total_past = _batch_cache(model, parts), sum(past_lengths)
    mask, position_ids, input_ids = _layout(parts, past_lengths, padding, device)
    if model.config._attn_implementation == "eager":  # additive, in the model's dtype
        mask = torch.zeros(mask.shape, dtype=model.dtype, device=device).masked_fill(~mask, torch.finfo(model.dtype).min)
    keep = _kept_rows(parts, rows, logits_device)
    if keep.numel() == 0:  # only prefill chunks that are not the last: project one row, read none
        keep = torch.tensor([0], dtype=torch.long, device=logits_device)
    output = model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids,
                   past_key_values=past, use_cache=True, logits_to_keep=keep)
    _scatter_new_kv(past, parts, rows, total_past)
    logits = output.logits[0].float().cpu()  # [kept rows, V]
    results, start = [], 0
    for part in parts:
        results.append(logits[start: start + part.keep_rows] if part.keep_rows else None)
        start += part.keep_rows
    return results


def _batch_cache(model: PreTrainedModel, parts: Sequence[Part]) -> DynamicCache:
    """The parts' caches, layer by layer, concatenated along the sequence ([1, H, P, D])."""
    batch = DynamicCache()
    cached = [part.session.cache for part in parts if part.session.cache.get_seq_length() > 0]
    if not cached:
        return batch
    for layer in range(len(cached[0].layers)):
        keys = torch.cat([cache.layers[layer].keys for cache in cached], dim=-2)
        values = torch.cat([cache.layers[layer].values for cache in cached], dim=-2)
        batch.update(keys, values, layer)
    return batch


def _layout(parts: Sequence[Part], past_lengths: list[int], padding: int,
            device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mask [1, 1, T, P + T] bool, position ids [1, T], input ids [1, T]), T counting the padding."""
    total_past = sum(past_lengths)
    total_rows = sum(len(part.token_ids) for part in parts) + padding
    mask = torch.zeros(total_rows, total_past + total_rows, dtype=torch.bool)
    positions, token_ids, past_start, row = [], [], 0, 0
    for part, past in zip(parts, past_lengths):
        n = len(part.token_ids)
        mask[row: row + n, past_start: past_start + past] = True  # the session's own cache
        mask[row: row + n, total_past + row: total_past + row + n] = torch.ones(n, n, dtype=torch.bool).tril()
        positions += range(past, past + n)
        token_ids += part.token_ids
        past_start, row = past_start + past, row + n
    for pad in range(row, total_rows):  # padding rows see only themselves
        mask[pad, total_past + pad] = True
    positions += [0] * padding
    token_ids += [token_ids[-1]] * padding
    return (mask[None, None].to(device), torch.tensor([positions], device=device),
            torch.tensor([token_ids], dtype=torch.long, device=device))


def _kept_rows(parts: Sequence[Part], rows: list[int], logits_device: torch.device) -> torch.Tensor:
    """Indices of the rows whose logits someone reads: each part's last keep_rows."""
    kept, start = [], 0
    for part, n in zip(parts, rows):
        kept += range(start + n - part.keep_rows, start + n)
        start += n
    return torch.tensor(kept, dtype=torch.long, device=logits_device)


def _scatter_new_kv(batch: DynamicCache, parts: Sequence[Part], rows: list[int], total_past: int) -> None:
    """Append each part's new keys and values, sliced from the batch cache, to its session's cache."""
    for layer_index, layer in enumerate(batch.layers):
        start = total_past
        for part, n in zip(parts, rows):
            part.session.cache.update(layer.keys[:, :, start: start + n], layer.values[:, :, start: start + n],
                                      layer_index)
            start += n
