"""Near-repeats: a request that re-asks an earlier one with other names gets the earlier answer, renamed.

Agents and users re-send a task with its names changed (a function, a class, a variable). The
suffix index (orchestrator.decoding.suffix_index) finds the earlier answer, but its match breaks at
every renamed identifier and restarts short, where a short match rarely pays. Here the two prompts
are aligned token by token; when every difference is a short substitution (a rename, not another
question), the same substitutions applied to the earlier output predict this request's output, and
the index holds that prediction as a document of its own while the request runs. Like any proposal
it is only a guess the target verifies, so output never depends on it.
"""

from __future__ import annotations

from typing import Sequence

MAX_NAME_TOKENS = 6  # a substitution longer than this (either side) is rewording, not a rename
MAX_CHANGES = 32  # substitutions (occurrences) at most: bounds the work per comparison
MAX_CHANGED_SHARE = 0.2  # and at most this share of the prompt's tokens renamed
ANCHOR = 2  # equal tokens after a substitution that confirm the prompts agree again
STRIDE = 32  # equal tokens skipped at once

Substitutions = dict[tuple[int, ...], tuple[int, ...]]


def renaming(earlier: Sequence[int], prompt: Sequence[int]) -> Substitutions | None:
    """The substitutions that turn the `earlier` prompt into `prompt`, when it differs from it only by
    short substitutions; None when the prompts are equal or differ otherwise (an insertion, a deletion,
    a rewording, one name renamed two ways).

    Linear: the two are walked side by side, and at a difference the shortest substitution after which
    they agree again is taken (at most MAX_NAME_TOKENS ** 2 tries, at most MAX_CHANGES times)."""
    if not earlier or not prompt or abs(len(earlier) - len(prompt)) > MAX_CHANGED_SHARE * len(prompt):
        return None
    earlier, prompt = list(earlier), list(prompt)
    substitutions: Substitutions = {}
    changes = changed = i = j = 0
    while True:
        i, j = _past_equal(earlier, prompt, i, j)
        if i == len(earlier) and j == len(prompt):
            break
        lengths = _resynchronise(earlier, prompt, i, j)
        changes += 1
        if lengths is None or changes > MAX_CHANGES:
            return None
        old, new = earlier[i:i + lengths[0]], prompt[j:j + lengths[1]]
        for piece_old, piece_new in _pieces(old, new):
            if substitutions.setdefault(piece_old, piece_new) != piece_new:
                return None  # one name renamed two ways: no single renaming explains the prompts
        changed += len(new)
        i, j = i + len(old), j + len(new)
    return substitutions if substitutions and changed <= MAX_CHANGED_SHARE * len(prompt) else None


def _pieces(old: list[int], new: list[int]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """A substitution as the renames it holds: token by token where both sides are as long (two names
    a token apart, `account: deposit` -> `wallet: put`, are two renames), else whole."""
    if len(old) != len(new):
        return [(tuple(old), tuple(new))]
    return [((a,), (b,)) for a, b in zip(old, new) if a != b]


def _past_equal(earlier: list[int], prompt: list[int], i: int, j: int) -> tuple[int, int]:
    """(i, j) moved past the tokens where the two agree: whole slices first, then token by token."""
    while i + STRIDE <= len(earlier) and earlier[i:i + STRIDE] == prompt[j:j + STRIDE]:
        i, j = i + STRIDE, j + STRIDE
    while i < len(earlier) and j < len(prompt) and earlier[i] == prompt[j]:
        i, j = i + 1, j + 1
    return i, j


def _inserted(old: list[int], new: list[int]) -> bool:
    """Whether one side is the other with tokens added before or after it: an insertion, not a rename."""
    short, long = sorted((old, new), key=len)
    return len(short) < len(long) and (long[:len(short)] == short or long[-len(short):] == short)


def _resynchronise(earlier: Sequence[int], prompt: Sequence[int], i: int, j: int) -> tuple[int, int] | None:
    """The shortest (a, b), both at least 1, after which earlier[i + a:] and prompt[j + b:] agree for ANCHOR
    tokens (or both end)."""
    for total in range(2, 2 * MAX_NAME_TOKENS + 1):
        for a in range(max(1, total - MAX_NAME_TOKENS), min(MAX_NAME_TOKENS, total - 1) + 1):
            b = total - a
            ends = i + a == len(earlier), j + b == len(prompt)
            if all(ends) and not _inserted(earlier[i:], prompt[j:]):
                return a, b
            if any(ends) or i + a > len(earlier) or j + b > len(prompt):
                continue
            if earlier[i + a:i + a + ANCHOR] == prompt[j + b:j + b + ANCHOR] and not _inserted(
                    earlier[i:i + a], prompt[j:j + b]):
                return a, b
    return None


def rename(tokens: Sequence[int], substitutions: Substitutions) -> list[int]:
    """`tokens` with every occurrence of a substitution's old tokens replaced by its new ones (longest
    first, left to right, never inside a replacement)."""
    lengths = sorted({len(old) for old in substitutions}, reverse=True)
    renamed: list[int] = []
    position = 0
    while position < len(tokens):
        for length in lengths:
            new = substitutions.get(tuple(tokens[position:position + length]))
            if new is not None:
                renamed.extend(new)
                position += length
                break
        else:
            renamed.append(tokens[position])
            position += 1
    return renamed
