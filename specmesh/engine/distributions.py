"""Compact wire form of a draft token's distribution.

The draft samples from the *decoded* distribution, so the q the target uses in
the acceptance test is exactly the q the token was drawn from. Speculative
sampling is lossless for any q the draft token is truly drawn from, so the wire
form may change q as long as both sides see the same change: values are rounded
to fp16, and the tail of smallest entries holding at most TAIL_MASS of the mass
is dropped where that makes the sparse form the smaller one. The output stays
exactly the target's; a dropped tail can only lower acceptance, by at most
TAIL_MASS per token. A near point mass (a confident draft, low temperature)
then travels as one id and one probability instead of the whole vocabulary.
"""

from __future__ import annotations

import torch

from specmesh.v1 import common_pb2

# A sparse entry costs 8 bytes (int32 id + float32 prob), a dense one 2 (fp16).
_SPARSE_BYTES, _DENSE_BYTES = 8, 2
# The most mass the wire form may drop from a draft's q: it bounds what acceptance can lose (a draft token
# is accepted with probability sum(min(p, q)), which a tail of mass m lowers by at most m), at a level far
# below the acceptance differences the draft-length policy can tell apart.
TAIL_MASS = 2.0 ** -10


def encode_distribution(probs: torch.Tensor) -> common_pb2.TokenDistribution:
    """probs [V] -> the smaller of the sparse form (the fp16-rounded entries left once the tail is dropped)
    and the dense fp16 form."""
    rounded = probs.detach().float().cpu().half().float()  # [V]: what either form carries
    kept = rounded >= tail_threshold(rounded)  # [V] bool
    # Counted first: listing the ids of a full distribution allocates 8 bytes per token for nothing.
    if int(torch.count_nonzero(kept)) * _SPARSE_BYTES < rounded.numel() * _DENSE_BYTES:
        kept_ids = torch.nonzero(kept).flatten()  # [kept]
        return common_pb2.TokenDistribution(
            sparse=common_pb2.SparseDistribution(token_ids=kept_ids.tolist(), probs=rounded[kept_ids].tolist()))
    return common_pb2.TokenDistribution(
        dense=common_pb2.DenseDistribution(
            probs_fp16=rounded.half().numpy().astype("<f2").tobytes(), vocab_size=rounded.numel()))


def tail_threshold(values: torch.Tensor) -> float:
    """values [V] >= 0 -> the smallest power of two t such that the entries below t hold at most TAIL_MASS
    of the total (entries of 0 always fall below it).

    One pass: the mass is summed by binary exponent (frexp), not sorted, so a 152k-entry vocabulary costs a
    fraction of a millisecond."""
    positive = values[values > 0]  # [n]
    if positive.numel() == 0:
        return float("inf")
    _, exponents = torch.frexp(positive)  # positive = mantissa * 2**exponent, mantissa in [0.5, 1)
    low = int(exponents.min())
    by_exponent = torch.zeros(int(exponents.max()) - low + 1, dtype=torch.float64)
    by_exponent.scatter_add_(0, (exponents - low).long(), positive.double())  # [exponents]
    below = torch.cumsum(by_exponent, 0) / by_exponent.sum()  # [exponents]: mass at or under each exponent
    dropped = int(torch.count_nonzero(below <= TAIL_MASS))  # whole exponent buckets that fit in the tail
    return 2.0 ** (low + dropped - 1)  # the bucket of exponent e holds [2**(e-1), 2**e)


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
