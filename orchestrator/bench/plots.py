"""PNG plots of a bench result (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after choosing the backend

from orchestrator.bench.metrics import LATENCIES, lookup  # noqa: E402
from orchestrator.bench.modes import DEFAULT, OFF, PEER_OFF, fixed_k, mode_title, peer_k_of  # noqa: E402
from orchestrator.bench.report import LATENCY_TITLES, ab_modes  # noqa: E402

COLOURS = {DEFAULT: "tab:blue", OFF: "tab:orange", PEER_OFF: "tab:olive"}
PEER_COLOUR = "tab:green"  # the peer at any constant k (a plot shows its best k only)


def colour(mode: str) -> str:
    return PEER_COLOUR if peer_k_of(mode) is not None else COLOURS[mode]


def write_plots(result: dict, directory: Path) -> list[Path]:
    paths = [latency_distributions(result, directory / "latency_distributions.png"),
             throughput_by_concurrency(result, directory / "throughput_by_concurrency.png"),
             itl_by_concurrency(result, directory / "itl_by_concurrency.png"),
             acceptance_by_kind(result, directory / "acceptance_by_kind.png")]
    if any("draft_length_sweep" in entry for entry in result["configurations"]):
        paths.append(tokens_by_k(result, directory / "tokens_by_k.png"))
    plt.close("all")
    return paths


def _latencies(requests: list[dict], configuration: str, mode: str, metric: str) -> list[float]:
    chosen = [r for r in requests if r["configuration"] == configuration and r["mode"] == mode and r["ok"]]
    if metric == "itl_ms":
        return [gap for r in chosen for gap in r["itl_ms"]]
    return [r[metric] for r in chosen if r[metric] is not None]


def latency_distributions(result: dict, path: Path) -> Path:
    """One row per configuration, one box plot per latency metric, spec on vs off (vs the peer at its best k
    and its target alone)."""
    configurations = result["configurations"]
    figure, axes = plt.subplots(len(configurations), len(LATENCIES), squeeze=False,
                                figsize=(4 * len(LATENCIES), 2.8 * len(configurations)))
    for row, entry in enumerate(configurations):
        modes = ab_modes(entry)
        for column, metric in enumerate(LATENCIES):
            axis = axes[row][column]
            data = [_latencies(result["requests"], entry["name"], m, metric) or [float("nan")] for m in modes]
            boxes = axis.boxplot(data, patch_artist=True, showfliers=True)
            axis.set_xticks(range(1, len(modes) + 1), [mode_title(m) for m in modes])
            for box, mode in zip(boxes["boxes"], modes):
                box.set_facecolor(colour(mode))
                box.set_alpha(0.6)
            axis.set_title(f"{entry['name']}: {LATENCY_TITLES[metric]}", fontsize=9)
            axis.set_ylabel("ms")
            axis.grid(axis="y", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    return path


def throughput_by_concurrency(result: dict, path: Path) -> Path:
    """Output tokens/s against max concurrency, one line per mode and temperature."""
    figure, axis = plt.subplots(figsize=(6, 4))
    _by_concurrency(axis, result, "output_throughput", "output tokens/s")
    axis.set_title("Output throughput by concurrency")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    return path


def itl_by_concurrency(result: dict, path: Path) -> Path:
    """ITL p50 and p99 against max concurrency (one panel each), one line per mode and temperature."""
    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    for axis, stat in zip(axes, ("p50", "p99")):
        _by_concurrency(axis, result, f"itl_ms.{stat}", "ms")
        axis.set_title(f"Inter-token latency {stat} by concurrency")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    return path


def _by_concurrency(axis, result: dict, metric: str, unit: str) -> None:
    """One line per mode (colour) and temperature (line style) of `metric` against max concurrency."""
    series: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for entry in result["configurations"]:
        temperature = entry["name"].split(" ", 1)[1]
        for mode in ab_modes(entry):  # the fixed ks of a sweep are in tokens_by_k.png
            value = lookup(entry["modes"][mode]["overall"], metric)
            if value is not None:
                series.setdefault((mode, temperature), []).append((entry["max_concurrency"], value))
    styles = ["-", "--", ":", "-."]
    temperatures = sorted({t for _, t in series})
    for (mode, temperature), points in sorted(series.items()):
        points.sort()
        axis.plot([c for c, _ in points], [v for _, v in points], marker="o", color=colour(mode),
                  linestyle=styles[temperatures.index(temperature) % len(styles)],
                  label=f"{mode_title(mode)}, {temperature}")
    axis.set_xlabel("max concurrency")
    axis.set_ylabel(unit)
    axis.set_xscale("log", base=2)  # the sweep doubles: 1, 2, 4, 8, 16
    concurrencies = sorted({e["max_concurrency"] for e in result["configurations"]})
    axis.set_xticks(concurrencies, [str(c) for c in concurrencies])
    axis.set_ylim(bottom=0)  # from zero, so that the lines' heights compare as ratios
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)


def acceptance_by_kind(result: dict, path: Path) -> Path:
    """Acceptance rate and mean acceptance length per prompt kind, one bar per configuration (spec on)."""
    configurations = result["configurations"]
    kinds = list(dict.fromkeys(k for e in configurations for k in e["modes"]["on"]["per_kind"]))
    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / max(1, len(configurations))
    for i, entry in enumerate(configurations):
        per_kind = entry["modes"]["on"]["per_kind"]
        positions = [k + i * width for k in range(len(kinds))]
        for axis, metric in zip(axes, ("acceptance_rate", "mean_acceptance_length")):
            values = [(per_kind.get(kind) or {}).get(metric) or 0.0 for kind in kinds]
            axis.bar(positions, values, width, label=entry["name"])
    for axis, title in zip(axes, ("acceptance rate (accepted / drafted)", "mean acceptance length (tokens/round)")):
        axis.set_xticks([k + 0.4 - width / 2 for k in range(len(kinds))], kinds)
        axis.set_title(title)
        axis.grid(axis="y", alpha=0.3)
    axes[0].set_ylim(0, 1)
    axes[0].legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    return path


def tokens_by_k(result: dict, path: Path) -> Path:
    """Output tokens/s against the fixed k, a line per configuration; the default policy (dashed) and
    speculation off (dotted) as horizontal lines in the configuration's colour."""
    figure, axis = plt.subplots(figsize=(6, 4))
    swept = [entry for entry in result["configurations"] if "draft_length_sweep" in entry]
    for i, entry in enumerate(swept):
        colour, ks = f"C{i % 10}", entry["draft_length_sweep"]["fixed_ks"]
        figures = {mode: entry["modes"][mode]["overall"]["output_throughput"] or 0.0
                   for mode in (*map(fixed_k, ks), DEFAULT, OFF)}
        axis.plot(ks, [figures[fixed_k(k)] for k in ks], marker="o", color=colour, label=f"{entry['name']}: fixed k")
        axis.axhline(figures[DEFAULT], color=colour, linestyle="--", label=f"{entry['name']}: default policy")
        axis.axhline(figures[OFF], color=colour, linestyle=":", label=f"{entry['name']}: speculation off")
    axis.set_xlabel("fixed k (draft tokens per round)")
    axis.set_ylabel("output tokens/s")
    axis.set_ylim(bottom=0)
    axis.set_title("Draft-length sweep")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    return path
