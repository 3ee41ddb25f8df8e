"""The regime benchmark's markdown table and its plot: speedup against round trip, one panel per concurrency."""

from __future__ import annotations

from pathlib import Path

COLUMNS = (  # (header, the row's key or a function of the row, format)
    ("profile", "profile", "{}"), ("alpha", "alpha", "{:g}"), ("placement", "placement", "{}"),
    ("rtt ms", "rtt_ms", "{:g}"), ("bandwidth", "bandwidth", "{}"), ("c", "concurrency", "{}"),
    ("T", "temperature", "{:g}"), ("tok/s", "tokens_per_s", "{:.0f}"), ("speedup", "speedup", "{:.2f}x"),
    ("bound seq", "bound_sequential", "{:.2f}x"), ("bound pipe", "bound_pipelined", "{:.2f}x"),
    ("of bound", lambda r: r["speedup"] / max(r["bound_pipelined"], r["bound_sequential"]), "{:.2f}"),
    ("hit", "predraft_hit_rate", "{:.2f}"), ("tok/round", "tokens_per_round", "{:.2f}"),
    ("B/round", "bytes_per_round", "{:.0f}"), ("B/token", "bytes_per_token", "{:.0f}"),
    ("overhead ms/round", "overhead_ms_per_round", "{:.2f}"),
    ("target ms/token", "target_busy_ms_per_token", "{:.2f}"),
    ("sessions/target step", "sessions_per_target_step", "{:.2f}"), ("greedy same", "greedy_identical", "{}"),
)


def _cell(row: dict, key, form: str) -> str:
    value = key(row) if callable(key) else row.get(key)
    return "-" if value is None else form.format(value)


def table(rows: list[dict]) -> str:
    """Every cell as a markdown table row (emulated: say so wherever it is shown)."""
    lines = ["| " + " | ".join(header for header, _, _ in COLUMNS) + " |",
             "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cell(row, key, form) for _, key, form in COLUMNS) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def plot_speedups(rows: list[dict], path: Path) -> Path | None:
    """Speedup over target-only against the link's round trip, a panel per concurrency, a line per
    (profile, alpha, placement, bandwidth, temperature); the direct stack at rtt 0 as a marker."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    concurrencies = sorted({row["concurrency"] for row in rows})
    if not concurrencies:
        return None
    figure, axes = plt.subplots(1, len(concurrencies), figsize=(5 * len(concurrencies), 4), squeeze=False)
    for axis, concurrency in zip(axes[0], concurrencies):
        lines: dict[tuple, list[tuple[float, float]]] = {}
        for row in rows:
            if row["concurrency"] == concurrency and row["speedup"] is not None:
                key = (row["profile"], row["alpha"], row["placement"], row["bandwidth"], row["temperature"])
                lines.setdefault(key, []).append((row["rtt_ms"], row["speedup"]))
        for (profile, alpha, placement, bandwidth, temperature), points in sorted(lines.items()):
            points.sort()
            label = f"{profile} a={alpha:g} {placement} {bandwidth} T={temperature:g}"
            style = "o" if placement == "direct" else "o-"
            axis.plot([p[0] for p in points], [p[1] for p in points], style, label=label)
        axis.axhline(1.0, color="grey", linewidth=0.8)
        axis.set_title(f"concurrency {concurrency} (emulated GPU steps and links)")
        axis.set_xlabel("round trip of the delayed link (ms)")
        axis.set_ylabel("speedup over target-only")
        axis.legend(fontsize=6)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
