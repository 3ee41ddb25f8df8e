"""The modes a configuration runs in, and what each one asks the server for.

"on" is the server's default draft-length policy (the request names no k), "off"
turns speculation off for the request, "k=N" sends num_speculative_tokens=N,
which the server honours as a fixed k for every round (the draft-length sweep),
and "peer" is transformers' assisted generation in the bench process.
"""

from __future__ import annotations

DEFAULT, OFF, PEER = "on", "off", "peer"
MODE_TITLES = {DEFAULT: "spec on", OFF: "spec off", PEER: "HF assisted"}  # the A/B tables' column names
DEFAULT_SWEEP = tuple(range(1, 9))  # --sweep-k without values


def fixed_k(k: int) -> str:
    return f"k={k}"


def fixed_k_of(mode: str) -> int | None:
    """N for a "k=N" mode, None for the others."""
    return int(mode[2:]) if mode.startswith("k=") else None


def request_speculation(mode: str, default_k: int | None) -> tuple[bool, int | None]:
    """(speculation, num_speculative_tokens) a request of `mode` sends; `default_k` is what "on" sends
    (None: nothing, the server's own policy)."""
    if mode == OFF:
        return False, None
    if mode == DEFAULT:
        return True, default_k
    k = fixed_k_of(mode)
    if k is None:
        raise ValueError(f"not a served mode: {mode!r}")
    return True, k


def served_modes(ab: bool, sweep_ks: list[int]) -> list[str]:
    """The modes every configuration runs, in order: the default, off (with --ab or a sweep), the fixed ks."""
    modes = [DEFAULT]
    if ab or sweep_ks:
        modes.append(OFF)
    return modes + [fixed_k(k) for k in sweep_ks]
