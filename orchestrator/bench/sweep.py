"""The draft-length sweeps' figures: where the default policy stands against every fixed k and off,
and the peer's best constant k (--peer-k).

Computed from one configuration's aggregates (mode -> {"overall", "per_kind"}):
overall on the run's wall time, and per prompt kind on the kind's own request
time like the by-kind table. The best k is the one with the most output
tokens/s (the smallest such k on a tie); the peer's, on the configuration's
overall figures only.
"""

from __future__ import annotations

from collections.abc import Callable

from orchestrator.bench.modes import DEFAULT, OFF, PEER_OFF, fixed_k, fixed_k_of, peer_k, peer_k_of


def draft_length_sweep(modes: dict[str, dict]) -> dict | None:
    """None when the configuration ran no fixed k."""
    ks = sorted(k for k in map(fixed_k_of, modes) if k is not None)
    if not ks:
        return None

    def overall(mode: str) -> float | None:
        return modes[mode]["overall"]["output_throughput"] if mode in modes else None

    off = overall(OFF)
    kinds = modes[DEFAULT]["per_kind"] if DEFAULT in modes else {}
    return {
        "fixed_ks": ks,
        "output_throughput_vs_off": {mode: _ratio(overall(mode), off) for mode in modes if mode in _swept(ks)},
        **standing(overall, ks),
        "per_kind": {kind: standing(lambda mode, kind=kind: kind_throughput(modes, mode, kind), ks)
                     for kind in kinds},
    }


def standing(throughput: Callable[[str], float | None], ks: list[int]) -> dict:
    """The default against the best of `ks` and against off; `throughput(mode)` gives output tokens/s."""
    measured = {k: throughput(fixed_k(k)) for k in ks}
    best = best_k(measured)
    default, off, best_value = throughput(DEFAULT), throughput(OFF), measured.get(best)
    return {"default_output_throughput": default, "off_output_throughput": off,
            "best_fixed_k": best, "best_fixed_k_output_throughput": best_value,
            "default_vs_off": _ratio(default, off), "best_fixed_k_vs_off": _ratio(best_value, off),
            "default_vs_best_fixed_k": _ratio(default, best_value)}


def best_k(measured: dict[int, float | None]) -> int | None:
    """The k with the most output tokens/s, the smallest on a tie; None when none was measured (all failed)."""
    candidates = sorted(k for k, value in measured.items() if value)
    return max(candidates, key=lambda k: measured[k]) if candidates else None  # first maximum: the smallest k


def peer_standing(modes: dict[str, dict]) -> dict | None:
    """The peer's constant ks and the best of them (its mode is what the A/B tables compare "on" with);
    None when the configuration ran no peer."""
    ks = sorted(k for k in map(peer_k_of, modes) if k is not None)
    if not ks:
        return None
    best = best_k({k: modes[peer_k(k)]["overall"]["output_throughput"] for k in ks})
    standing = {"ks": ks, "best_k": best, "best_mode": None if best is None else peer_k(best)}
    steps = target_alone_steps(modes)
    if steps is not None:
        standing["target_step_ms"] = steps
    return standing


def target_alone_steps(modes: dict[str, dict]) -> dict | None:
    """The target's step alone, ms a round, as the target service ran it ("off") and as the peer did
    ("peer-off"): one row of the same weights on the same kernels, so a ratio far from 1 is the host
    running the two processes unevenly, not either design; None without both."""
    served, peer = (((modes.get(mode) or {}).get("round_parts") or {}).get("target_busy_ms")
                    for mode in (OFF, PEER_OFF))
    if not served or not peer:
        return None
    return {"served": served, "peer": peer, "peer_over_served": peer / served}


def _swept(ks: list[int]) -> set[str]:
    return {DEFAULT, OFF, *map(fixed_k, ks)}


def kind_throughput(modes: dict[str, dict], mode: str, kind: str) -> float | None:
    return ((modes.get(mode) or {}).get("per_kind", {}).get(kind) or {}).get("output_throughput")


def _ratio(value: float | None, base: float | None) -> float | None:
    return value / base if value is not None and base else None
