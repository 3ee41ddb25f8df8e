"""One forward for several sessions: their new rows in one padding-free sequence, attention per session.

The weight passes (every Linear layer, the bulk of a step) run once over the rows of all
the parts concatenated into one batch-1 sequence of T rows, each row at its own session's
position (RoPE puts every row where a solo forward would). Attention is the only place
where sessions must not mix, so it runs per session: the model's attention is routed to
`segmented_attention`, which, for each part, appends the part's new keys and values to
its session's own cache (a DynamicCache, so rollback stays a crop) and attends its rows
over that cache alone, with a causal mask among its own new rows. Padding rows attend
only to each other and are cached nowhere.

Chosen by measurement over one attention across the concatenated caches with a block mask
(the previous design), which copied every session's cache into a batch cache and back each
step and made each row attend over every other session's masked positions: slower than a
forward per session (figures: docs/design/continuous-batching.md).

Grouped-query attention is packed, not repeated: a session's query heads that share a
key/value head are laid out as rows of one attention over that head, so no key or value
is ever copied per query head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from specmesh.engine.batching import Part

ATTENTION = "specmesh_segmented"  # the model's attention once install_segmented_attention ran
# A ready 4-D mask makes transformers skip building one (the segmented attention makes its own).
NO_MASK = torch.ones(1, 1, 1, 1, dtype=torch.bool)
Ancestry = tuple[torch.Tensor, list[int]]  # a tree of rows' (sees [rows, rows] bool, depth of each row): tree_ancestry


@dataclass(frozen=True)
class Segment:
    cache: object | None  # the session's DynamicCache; None: padding rows, cached nowhere
    start: int  # its first row in the step
    rows: int
    mask: torch.Tensor | None  # [groups * rows, cached + rows] bool, or None for one row


def supports_ragged(model: PreTrainedModel) -> bool:
    """Whether steps of several sessions can run as one forward (else one forward per session)."""
    layer_types = set(getattr(model.config, "layer_types", None) or ["full_attention"])
    return model.config._attn_implementation in ("sdpa", ATTENTION) and layer_types == {"full_attention"}


def avoid_cudnn_attention(device: torch.device) -> bool:
    """On CUDA, keep scaled_dot_product_attention off cuDNN's backend in this process; True if it was on.

    cuDNN attention builds an execution plan for every attention shape it meets, and decoding
    meets a new one every step (the cache grows by a row, a verification adds its draft rows,
    each prompt has its length): a step at a new shape cost about three times one at a known shape,
    where flash and memory-efficient attention cost the same either way (figures: docs/design/gpu.md).
    """
    if device.type != "cuda" or not torch.backends.cuda.cudnn_sdp_enabled():
        return False
    torch.backends.cuda.enable_cudnn_sdp(False)
    return True


def install_segmented_attention(model: PreTrainedModel) -> None:
    """Route the model's attention through segmented_attention; a forward without segments (one
    session's, or transformers' own generate) still runs exactly the sdpa attention it ran before."""
    if model.config._attn_implementation != ATTENTION:
        model.set_attn_implementation(ATTENTION)


def segmented_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                        scaling: float | None = None, segments: Sequence[Segment] | None = None,
                        slot_batch=None, **kwargs):
    """query [1, H, T, D], key and value [1, KVH, T, D] (the step's new rows) -> ([1, T, H, D], None).

    A static step over preallocated KV (specmesh.engine.graph_steps) brings its own slot_batch instead."""
    if slot_batch is not None:
        return slot_batch.attend(module, query, key, value, scaling)
    if segments is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    _, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    outputs = []
    for segment in segments:
        rows = slice(segment.start, segment.start + segment.rows)
        new_keys, new_values = key[:, :, rows], value[:, :, rows]
        if segment.cache is not None:  # appended to the session's cache: [1, KVH, cached + rows, D]
            new_keys, new_values = segment.cache.update(new_keys, new_values, module.layer_idx)
        packed = query[:, :, rows].reshape(1, kv_heads, groups * segment.rows, dim)  # a KV head's query heads as rows
        out = F.scaled_dot_product_attention(packed, new_keys, new_values, attn_mask=segment.mask, scale=scaling)
        outputs.append(out.reshape(1, heads, segment.rows, dim))
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION, segmented_attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)  # forwards without segments mask as sdpa does


@torch.inference_mode()
def ragged_forward(model: PreTrainedModel, parts: Sequence[Part], padding: int,
                   device: torch.device, logits_device: torch.device) -> list[torch.Tensor | None]:
    """Logits [keep_rows, V] float32 on the CPU per part (None where keep_rows is 0)."""
    install_segmented_attention(model)  # the engine did, unless a caller passes its own model
    past_lengths = [part.session.cache.get_seq_length() for part in parts]
    heads = model.config.num_attention_heads
    groups = heads // (getattr(model.config, "num_key_value_heads", None) or heads)  # query heads per KV head
    trees = [tree_ancestry(part.parents) if part.parents else None for part in parts]  # None: a chain
    segments = _segments(parts, trees, past_lengths, padding, groups, device)
    position_ids, input_ids = _layout(parts, trees, past_lengths, padding, device)
    keep = _kept_rows(parts, logits_device)
    if keep.numel() == 0:  # only prefill chunks that are not the last: project one row, read none
        keep = torch.tensor([0], dtype=torch.long, device=logits_device)
    try:
        output = model(input_ids=input_ids, position_ids=position_ids, attention_mask=NO_MASK.to(device),
                       use_cache=False, logits_to_keep=keep, segments=segments)
    except BaseException:
        for part, past in zip(parts, past_lengths):
            _crop_layers(part.session.cache, past)
        raise
    logits = output.logits[0].float().cpu()  # [kept rows, V]
    results, start = [], 0
    for part in parts:
        results.append(logits[start: start + part.keep_rows] if part.keep_rows else None)
        start += part.keep_rows
    return results


def _crop_layers(cache, length: int) -> None:
    """Every layer back to `length` tokens: a forward that failed had appended this step's rows to the
    layers before the failure only, so the layers' lengths differ (and cache.crop crops them all alike)."""
    for layer in cache.layers:
        surplus = layer.get_seq_length() - length
        if surplus > 0:
            layer.crop(-surplus)


def _segments(parts: Sequence[Part], trees: Sequence[Ancestry | None], past_lengths: list[int], padding: int,
              groups: int, device: torch.device) -> list[Segment]:
    segments, start = [], 0
    for part, tree, past in zip(parts, trees, past_lengths):
        rows = len(part.token_ids)
        mask = _tree_mask(tree[0], past, groups, device) if tree else _causal_mask(rows, past, groups, device)
        segments.append(Segment(part.session.cache, start, rows, mask))
        start += rows
    if padding:
        segments.append(Segment(None, start, padding, _causal_mask(padding, 0, groups, device)))
    return segments


def _causal_mask(rows: int, past: int, groups: int, device: torch.device) -> torch.Tensor | None:
    """[groups * rows, past + rows]: every row sees the cache and its own earlier new rows (None for one row)."""
    if rows == 1:
        return None
    mask = torch.ones(rows, past + rows, dtype=torch.bool)
    mask[:, past:] = torch.ones(rows, rows, dtype=torch.bool).tril()
    return mask.repeat(groups, 1).to(device)  # packed rows are ordered by query head within the group, then row


def tree_ancestry(parents: Sequence[int]) -> Ancestry:
    """A tree of new rows, row i after row parents[i] (-1: after the cache; parents[i] < i) ->
    (sees [rows, rows] bool: each row's ancestors and itself, depth of each row: 0 after the cache).

    A verification with alternatives feeds its chain of drafts, then each alternative token as a row
    whose parent is the row before the draft it stands in for: it sees what that draft would have seen."""
    rows = len(parents)
    sees = torch.eye(rows, dtype=torch.bool)
    depths = []
    for row, parent in enumerate(parents):
        if not -1 <= parent < row:
            raise ValueError(f"row {row}'s parent {parent} is not an earlier row")
        if parent >= 0:
            sees[row] |= sees[parent]
        depths.append(depths[parent] + 1 if parent >= 0 else 0)
    return sees, depths


def _tree_mask(sees: torch.Tensor, past: int, groups: int, device: torch.device) -> torch.Tensor:
    """sees [rows, rows] (tree_ancestry) -> [groups * rows, past + rows]: every row sees the cache, its
    ancestors and itself."""
    mask = torch.cat([torch.ones(len(sees), past, dtype=torch.bool), sees], dim=1)
    return mask.repeat(groups, 1).to(device)


def _layout(parts: Sequence[Part], trees: Sequence[Ancestry | None], past_lengths: list[int], padding: int,
            device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(position ids [1, T], input ids [1, T]), T counting the padding."""
    positions, token_ids = [], []
    for part, tree, past in zip(parts, trees, past_lengths):
        if tree:  # a row of a tree sits at its depth: an alternative where its draft would be
            positions += [past + depth for depth in tree[1]]
        else:
            positions += range(past, past + len(part.token_ids))
        token_ids += part.token_ids
    positions += [0] * padding
    token_ids += [token_ids[-1]] * padding
    return (torch.tensor([positions], device=device),
            torch.tensor([token_ids], dtype=torch.long, device=device))


def _kept_rows(parts: Sequence[Part], logits_device: torch.device) -> torch.Tensor:
    """Indices of the rows whose logits someone reads: each part's last keep_rows."""
    kept, start = [], 0
    for part in parts:
        n = len(part.token_ids)
        kept += range(start + n - part.keep_rows, start + n)
        start += n
    return torch.tensor(kept, dtype=torch.long, device=logits_device)
