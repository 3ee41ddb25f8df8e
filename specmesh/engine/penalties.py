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

import math
from typing import Sequence

import torch

from specmesh.errors import InvalidArgument
from specmesh.engine.sampling_params import SamplingParams


def penalize_logits(logits: torch.Tensor, history: Sequence[int], output_start: int, params: SamplingParams,
                    draft_ids: Sequence[int] = ()) -> torch.Tensor:
    """logits [n, V]: row i predicts the token after history + draft_ids[:i] -> float32 [n, V].

    `output_start`: the position where the generated output begins in history.
    Returns `logits` itself when the request has no penalties or biases. Only the
    columns of tokens that occur are touched: a 150k vocabulary costs a copy, not
    a pass of arithmetic.
    """
    if not params.penalizes:
        return logits
    n, vocab = logits.shape
    scores = logits.float().clone()  # [n, V]
    columns, anywhere, in_output = _occurrences(history, output_start, draft_ids[: n - 1], n)
    touched = scores[:, columns]  # [n, U]
    if params.repetition_penalty not in (0.0, 1.0):
        penalty = params.repetition_penalty
        penalized = torch.where(touched < 0, touched * penalty, touched / penalty)
        touched = torch.where(anywhere > 0, penalized, touched)
    if params.presence_penalty or params.frequency_penalty:
        touched = touched - params.frequency_penalty * in_output - params.presence_penalty * (in_output > 0)
    scores[:, columns] = touched
    for token_id, bias in params.logit_bias:
        if 0 <= token_id < vocab:  # ids beyond this model's vocabulary (a smaller draft's) are dropped
            scores[:, token_id] += bias
    return scores


def _occurrences(history: Sequence[int], output_start: int, draft_ids: Sequence[int],
                 rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The token ids that occur, and how often before each row.

    Returns (columns [U], anywhere [rows, U], in_output [rows, U]): counts over
    history + draft_ids[:row], and over its generated part (from output_start on).
    """
    token_ids = torch.tensor(list(history) + list(draft_ids), dtype=torch.long)
    columns, column_of = torch.unique(token_ids, return_inverse=True)  # [U], [len(history) + k]
    history_columns, draft_columns = column_of[: len(history)], column_of[len(history):].tolist()
    ones = torch.ones(len(history))
    whole = torch.zeros(columns.numel()).index_add_(0, history_columns, ones)  # [U]
    output = torch.zeros(columns.numel()).index_add_(0, history_columns[output_start:], ones[output_start:])
    running = torch.zeros(rows, columns.numel())  # row i: draft_ids[:i]
    for index, column in enumerate(draft_columns):
        running[index + 1:, column] += 1
    return columns, whole + running, output + running


def check_penalties(sampling: SamplingParams) -> None:
    """A direct caller's garbage never reaches the logits (the orchestrator checks clients' ranges)."""
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        if not math.isfinite(getattr(sampling, name)):
            raise InvalidArgument(f"sampling.{name}", "must be finite")
    if sampling.repetition_penalty < 0:
        raise InvalidArgument("sampling.repetition_penalty", "must be >= 0 (0 or 1: off)")
    if not all(math.isfinite(bias) for _, bias in sampling.logit_bias):
        raise InvalidArgument("sampling.logit_bias", "biases must be finite")
