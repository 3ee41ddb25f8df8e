"""The target's log-probabilities of committed tokens, for clients that ask for them.

They come from the same (penalized) logits that decided the tokens, at
temperature 1 and before top-k/top-p: the model's own distribution under the
request's penalties and biases. That is defined under greedy decoding too, and
identical with speculation on or off, since every committed token's row is the
target's row for that position whichever way the token was chosen.
"""

from __future__ import annotations

from typing import Sequence

import torch

from specmesh.v1 import common_pb2


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int], top_n: int) -> list[common_pb2.TokenLogprob]:
    """logits [m, V] (row i decided token_ids[i]) -> one TokenLogprob per token, with top_n alternatives."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [m, V]
    ids = torch.tensor(list(token_ids), dtype=torch.long)  # [m]
    chosen = logprobs[torch.arange(ids.numel()), ids].tolist()  # [m]
    top_n = min(top_n, logprobs.shape[-1])
    top_values, top_ids = torch.topk(logprobs, top_n, dim=-1) if top_n else (None, None)  # [m, top_n]
    return [common_pb2.TokenLogprob(
        token_id=token_id, logprob=chosen[row],
        top_token_ids=top_ids[row].tolist() if top_n else [],
        top_logprobs=top_values[row].tolist() if top_n else [])
        for row, token_id in enumerate(token_ids)]
