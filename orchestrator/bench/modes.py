"""The modes a configuration runs in, and what each one asks the server for.

"on" is the server's default draft-length policy (the request names no k), "off"
turns speculation off for the request, "k=N" sends num_speculative_tokens=N,
which the server honours as a fixed k for every round (the draft-length sweep).
The peer runs in the bench process: "peer k=N" is transformers' assisted generation
at a constant k of N (--peer-k), "peer-off" transformers' generate of the target alone.
"""

from __future__ import annotations

DEFAULT, OFF, PEER_OFF = "on", "off", "peer-off"
MODE_TITLES = {DEFAULT: "spec on", OFF: "spec off", PEER_OFF: "HF target-only"}  # the A/B tables' column names
DEFAULT_SWEEP = tuple(range(1, 9))  # --sweep-k without values
FIXED_K, PEER_K = "k=", "peer k="  # the prefixes of the served fixed-k modes and of the peer's


def fixed_k(k: int) -> str:
    return f"{FIXED_K}{k}"


def fixed_k_of(mode: str) -> int | None:
    """N for a "k=N" mode, None for the others."""
    return _k_after(FIXED_K, mode)


def peer_k(k: int) -> str:
    return f"{PEER_K}{k}"


def peer_k_of(mode: str) -> int | None:
    """N for a "peer k=N" mode, None for the others."""
    return _k_after(PEER_K, mode)


def _k_after(prefix: str, mode: str) -> int | None:
    return int(mode[len(prefix):]) if mode.startswith(prefix) else None


def peer_modes(ks: list[int]) -> list[str]:
    """The peer's modes: the target alone, then assisted at each constant k."""
    return [PEER_OFF, *map(peer_k, ks)]


def mode_title(mode: str) -> str:
    """A mode's name in the tables and plots: "HF k=N" for the peer at a constant k."""
    k = peer_k_of(mode)
    return f"HF k={k}" if k is not None else MODE_TITLES.get(mode, mode)


def is_peer_mode(mode: str) -> bool:
    return mode == PEER_OFF or mode.startswith(PEER_K)


def request_speculation(mode: str, default_k: int | None) -> tuple[bool, int | None]:
    """(speculation, num_speculative_tokens) a request of `mode` sends; `default_k` is what "on" sends
    (None: nothing, the server's own policy). The peer's modes: off, or its constant k."""
    if mode in (OFF, PEER_OFF):
        return False, None
    if mode == DEFAULT:
        return True, default_k
    k = peer_k_of(mode) if mode.startswith(PEER_K) else fixed_k_of(mode)
    if k is None:
        raise ValueError(f"not a bench mode: {mode!r}")
    return True, k


def served_modes(ab: bool, sweep_ks: list[int]) -> list[str]:
    """The modes every configuration runs, in order: the default, off (with --ab or a sweep), the fixed ks."""
    modes = [DEFAULT]
    if ab or sweep_ks:
        modes.append(OFF)
    return modes + [fixed_k(k) for k in sweep_ks]
