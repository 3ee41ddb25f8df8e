"""Compact wire form of a draft token's distribution.

The draft samples from the *decoded* distribution, so the q the target uses in
the acceptance test is exactly the q the token was drawn from: fp16 rounding of
a dense vector changes q, but identically on both sides.
"""

from __future__ import annotations

import torch

from specmesh.v1 import common_pb2

# A sparse entry costs 8 bytes (int32 id + float32 prob), a dense one 2 (fp16).
_SPARSE_BYTES, _DENSE_BYTES = 8, 2


def encode_distribution(probs: torch.Tensor) -> common_pb2.TokenDistribution:
    """probs [V] -> the smaller of the sparse (non-zero entries) and dense fp16 forms."""
    probs = probs.detach().float().cpu()
    # Counted first: listing the ids of a full distribution allocates 8 bytes per token for nothing.
    if int(torch.count_nonzero(probs)) * _SPARSE_BYTES < probs.numel() * _DENSE_BYTES:
        nonzero_ids = torch.nonzero(probs).flatten()  # [nnz]
        return common_pb2.TokenDistribution(
            sparse=common_pb2.SparseDistribution(
                token_ids=nonzero_ids.tolist(), probs=probs[nonzero_ids].tolist()
            )
        )
    return common_pb2.TokenDistribution(
        dense=common_pb2.DenseDistribution(
            probs_fp16=probs.half().numpy().astype("<f2").tobytes(), vocab_size=probs.numel()
        )
    )


def decode_distribution(dist: common_pb2.TokenDistribution, vocab_size: int) -> torch.Tensor:
    """TokenDistribution -> probs [vocab_size] float32, renormalised.

    Raises ValueError with a description when the message is malformed.
    """
    form = dist.WhichOneof("form")
    if form == "sparse":
        probs = _decode_sparse(dist.sparse, vocab_size)
    elif form == "dense":
        probs = _decode_dense(dist.dense, vocab_size)
    else:
        raise ValueError("distribution has neither sparse nor dense form")
    total = probs.sum()
    if not torch.isfinite(total) or total <= 0:
        raise ValueError("distribution must have positive, finite mass")
    return probs / total


def _decode_sparse(sparse: common_pb2.SparseDistribution, vocab_size: int) -> torch.Tensor:
    if len(sparse.token_ids) != len(sparse.probs):
        raise ValueError("sparse token_ids and probs differ in length")
    ids = torch.tensor(list(sparse.token_ids), dtype=torch.long)
    values = torch.tensor(list(sparse.probs), dtype=torch.float32)
    if ids.numel() and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"sparse token id outside [0, {vocab_size})")
    _check_values(values)
    return torch.zeros(vocab_size, dtype=torch.float32).index_put_((ids,), values, accumulate=True)


def _decode_dense(dense: common_pb2.DenseDistribution, vocab_size: int) -> torch.Tensor:
    if dense.vocab_size > vocab_size or len(dense.probs_fp16) != 2 * dense.vocab_size:
        raise ValueError(f"dense distribution must hold vocab_size <= {vocab_size} fp16 values")
    values = torch.frombuffer(bytearray(dense.probs_fp16), dtype=torch.float16).float()  # [n]
    _check_values(values)
    if values.numel() == vocab_size:
        return values
    # A draft whose logits have fewer rows than the target's gives 0 to the rest.
    probs = torch.zeros(vocab_size, dtype=torch.float32)
    probs[: values.numel()] = values
    return probs


def _check_values(values: torch.Tensor) -> None:
    """Negative or NaN values refused in one pass (NaN fails the comparison); an infinite one makes the
    total infinite, which decode_distribution refuses."""
    if values.numel() and not float(values.min()) >= 0:
        raise ValueError("probabilities must be non-negative numbers")
