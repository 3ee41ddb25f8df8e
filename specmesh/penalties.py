"""Penalties and biases on the logits, shared by the draft and the target.

Applied to a position's logits before temperature, top-k and top-p, given the
sequence before that position. Within a verification round, row j of the
target's logits predicts the token after the committed sequence *and the draft
tokens 0..j-1*: those tokens are the history the row's distribution depends on,
so the target's distribution at each position is exactly the one target-only
decoding would use there (lossless), and the draft, applying the same step to
its own logits, proposes from a matching distribution (acceptance stays high).

Order and semantics:
1. repetition_penalty (transformers' RepetitionPenaltyLogitsProcessor): every
   token in the prompt or the output has a positive logit divided by it, a
   negative one multiplied;
2. presence and frequency penalties (OpenAI's): subtract presence_penalty from
   each token that occurs in the generated output, and frequency_penalty times
   its number of occurrences there;
3. logit_bias: added to the logit of its token.
"""

from __future__ import annotations

from typing import Sequence

import torch

from specmesh.sampling import SamplingParams


def penalize_logits(logits: torch.Tensor, history: Sequence[int], output_start: int, params: SamplingParams,
                    draft_ids: Sequence[int] = ()) -> torch.Tensor:
    """logits [n, V]: row i predicts the token after history + draft_ids[:i] -> float32 [n, V].

    `output_start`: the position where the generated output begins in history.
    Returns `logits` itself when the request has no penalties or biases.
    """
    if not params.penalizes:
        return logits
    n, vocab = logits.shape
    scores = logits.float().clone()  # [n, V]
    earlier_drafts = _running_counts(draft_ids[: n - 1], n, vocab)  # [n, V]
    if params.repetition_penalty not in (0.0, 1.0):
        seen = (_counts(history, vocab) + earlier_drafts) > 0  # [n, V] prompt and output
        penalty = params.repetition_penalty
        scores = torch.where(seen, torch.where(scores < 0, scores * penalty, scores / penalty), scores)
    if params.presence_penalty or params.frequency_penalty:
        output_counts = _counts(history[output_start:], vocab) + earlier_drafts  # [n, V]
        scores -= params.frequency_penalty * output_counts + params.presence_penalty * (output_counts > 0)
    if params.logit_bias:
        scores += _bias_vector(params.logit_bias, vocab)  # broadcast over rows
    return scores


def _counts(token_ids: Sequence[int], vocab: int) -> torch.Tensor:
    """How often each token id occurs in token_ids -> [V] float32."""
    if not len(token_ids):
        return torch.zeros(vocab)
    return torch.bincount(torch.as_tensor(list(token_ids), dtype=torch.long), minlength=vocab)[:vocab].float()


def _running_counts(draft_ids: Sequence[int], rows: int, vocab: int) -> torch.Tensor:
    """Row i counts draft_ids[:i] -> [rows, V] float32 (row 0 is all zeros)."""
    running = torch.zeros(rows, vocab)
    for index, token_id in enumerate(draft_ids):
        if token_id < vocab:
            running[index + 1:, token_id] += 1
    return running


def _bias_vector(logit_bias: tuple[tuple[int, float], ...], vocab: int) -> torch.Tensor:
    """[V] float32; ids beyond this model's vocabulary (a smaller draft's) are dropped."""
    bias = torch.zeros(vocab)
    for token_id, value in logit_bias:
        if 0 <= token_id < vocab:
            bias[token_id] += value
    return bias
