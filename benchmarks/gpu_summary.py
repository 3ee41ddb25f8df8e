"""The GPU speculation run's figures (benchmarks/gpu_speculation.py) from its `specmesh bench` results:
the committed JSON, the targets the run is held to, a table and a plot."""

from __future__ import annotations

from pathlib import Path

DEFAULT, OFF, PEER_OFF = "on", "off", "peer-off"  # orchestrator.bench.modes' names


def alpha_key(alpha: float) -> str:
    return f"{alpha:g}"


def throughput(entry: dict, mode: str) -> float | None:
    figures = entry["modes"].get(mode)
    return figures["overall"]["output_throughput"] if figures else None


def best_of(entry: dict, prefix: str) -> tuple[int | None, float | None]:
    """The constant k (of modes `prefix`k) with the most output tokens/s, and its tokens/s."""
    measured = {int(mode[len(prefix):]): throughput(entry, mode) for mode in entry["modes"]
                if mode.startswith(prefix) and mode[len(prefix):].isdigit()}
    measured = {k: value for k, value in measured.items() if value}
    if not measured:
        return None, None
    best = max(measured, key=lambda k: (measured[k], -k))
    return best, measured[best]


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def target_only(results: list[dict]) -> dict:
    """Speculation off by concurrency, from the first run that measured each."""
    table = {}
    for result in results:
        for entry in result["bench"]["configurations"]:
            key = str(entry["max_concurrency"])
            figures = entry["modes"].get(OFF)
            if key in table or figures is None:
                continue
            tpot = figures["overall"]["tpot_ms"]["mean"]
            table[key] = {"tok_s": figures["overall"]["output_throughput"], "ms_per_token": tpot}
    return table


def speculation(results: list[dict]) -> tuple[dict, dict, dict]:
    """default_policy, best_fixed_k and hf_assisted, by alpha then concurrency."""
    default, fixed, assisted = {}, {}, {}
    for result in results:
        alpha = alpha_key(result["alpha"])
        for entry in result["bench"]["configurations"]:
            key, off = str(entry["max_concurrency"]), throughput(entry, OFF)
            on = entry["modes"][DEFAULT]["overall"]
            default.setdefault(alpha, {})[key] = {
                "tok_s": on["output_throughput"], "vs_target_only": ratio(on["output_throughput"], off),
                "acceptance_rate": on["acceptance_rate"], "tokens_per_round": on["mean_acceptance_length"],
                "rpc_share": rpc_share(entry["modes"][DEFAULT].get("round_parts"))}
            k, best = best_of(entry, "k=")
            if k is not None:
                fixed.setdefault(alpha, {})[key] = {"k": k, "tok_s": best, "vs_target_only": ratio(best, off)}
            k, best = best_of(entry, "peer k=")
            if k is not None:
                assisted.setdefault(alpha, {})[key] = {
                    "k": k, "tok_s": best, "target_only_tok_s": throughput(entry, PEER_OFF),
                    "default_policy_vs_hf": ratio(on["output_throughput"], best)}
    return default, fixed, assisted


def rpc_share(parts: dict | None) -> float | None:
    """Of a round's time, the share its calls took beyond the services' forwards (transport, (de)serialising,
    queueing: the round clock's "wire"); None where the bench could not read the server's round clocks."""
    if not parts or not parts.get("wall_ms"):
        return None
    return parts["wire_ms"] / parts["wall_ms"]


def outputs_identical(results: list[dict]) -> bool | None:
    """Every greedy configuration's outputs the same in every mode (served, fixed k, the peer)."""
    verdicts = [entry["outputs"]["identical"] for result in results
                for entry in result["bench"]["configurations"] if "outputs" in entry]
    return all(verdicts) if verdicts else None


def bars(summary: dict) -> list[tuple[str, float | None, float, bool]]:
    """The targets the GPU run is held to: (what, measured, bar, met); a missing figure is unmet."""
    target = summary["target_only"]
    policy = summary["default_policy"]
    assisted = summary["hf_assisted"]

    def at(table: dict, *keys):
        for key in keys:
            table = (table or {}).get(key)
        return table

    c1 = at(target, "1", "ms_per_token")
    checks = [
        ("target-only c=1: ms per token / weights-read ms (at most)",
         ratio(c1, summary["target_weights_read_ms"]), 1.6, False),
        ("target-only c=16: tok/s over c=1", ratio(at(target, "16", "tok_s"), at(target, "1", "tok_s")), 8.0, True),
        ("default alpha=0.8 c=1: over target-only", at(policy, "0.8", "1", "vs_target_only"), 2.0, True),
        ("default alpha=0.8 c=16: over target-only", at(policy, "0.8", "16", "vs_target_only"), 1.2, True),
        ("default alpha=0.6 c=1: over target-only", at(policy, "0.6", "1", "vs_target_only"), 1.3, True),
        ("default c=1: over HF assisted (alpha 0.8)", at(assisted, "0.8", "1", "default_policy_vs_hf"), 1.3, True),
        ("default everywhere: lowest over target-only",
         min((v["vs_target_only"] for by_c in policy.values() for v in by_c.values() if v["vs_target_only"]),
             default=None), 0.97, True),
    ]
    rows = [(what, value, bar, value is not None and (value >= bar if larger else value <= bar))
            for what, value, bar, larger in checks]
    identical = summary["outputs_identical"]
    rows.append(("every output identical to target-only", 1.0 if identical else 0.0, 1.0, bool(identical)))
    return rows


def table(summary: dict) -> str:
    lines = [f"GPU {summary['gpu']}, commit {summary['commit']}: copy bandwidth {summary['copy_bandwidth_gb_s']:.0f} "
             f"GB/s, the target's weights read once in {summary['target_weights_read_ms']:.2f} ms", "",
             f"{'mode':<34}{'c':>5}{'tok/s':>10}{'x target-only':>15}{'ms/token':>10}"]
    for c, figures in summary["target_only"].items():
        lines.append(f"{'target-only':<34}{c:>5}{figures['tok_s']:>10.1f}{1.0:>15.2f}"
                     f"{figures['ms_per_token'] or 0:>10.2f}")
    for alpha, by_c in summary["default_policy"].items():
        for c, figures in by_c.items():
            lines.append(f"{'default policy, alpha ' + alpha:<34}{c:>5}{figures['tok_s']:>10.1f}"
                         f"{figures['vs_target_only'] or 0:>15.2f}")
            fixed = summary["best_fixed_k"].get(alpha, {}).get(c)
            if fixed:
                lines.append(f"{'best fixed k=' + str(fixed['k']) + ', alpha ' + alpha:<34}{c:>5}"
                             f"{fixed['tok_s']:>10.1f}{fixed['vs_target_only'] or 0:>15.2f}")
            peer = summary["hf_assisted"].get(alpha, {}).get(c)
            if peer:
                lines.append(f"{'HF assisted k=' + str(peer['k']) + ', alpha ' + alpha:<34}{c:>5}"
                             f"{peer['tok_s']:>10.1f}")
    lines += [f"default policy, alpha {alpha}, c = {c}: calls took {figures['rpc_share']:.0%} of a round "
              f"beyond the forwards" for alpha, by_c in summary["default_policy"].items()
              for c, figures in by_c.items() if figures.get("rpc_share") is not None]
    steps = summary.get("engine_steps")
    if steps:
        lines += ["", "engine step, median ms (sessions x rows: graph steps off / on):"]
        lines += [f"  {shape}: {off:.2f} / {steps['ms']['on'][shape]:.2f}" for shape, off in steps["ms"]["off"].items()]
    lines += ["", f"{'target':<60}{'measured':>10}{'bar':>8}  met"]
    for what, value, bar, met in bars(summary):
        lines.append(f"{what:<60}{'-' if value is None else f'{value:.2f}':>10}{bar:>8.2f}  {'yes' if met else 'NO'}")
    return "\n".join(lines)


def plot(summary: dict, path: Path) -> Path:
    """Output tokens/s by mode, one panel per speculative concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    concurrencies = sorted({c for by_c in summary["default_policy"].values() for c in by_c}, key=int)
    figure, axes = plt.subplots(1, len(concurrencies), figsize=(6 * len(concurrencies), 4), squeeze=False)
    for axis, c in zip(axes[0], concurrencies):
        labels, values = ["target-only"], [summary["target_only"].get(c, {}).get("tok_s") or 0]
        for alpha in summary["default_policy"]:
            for name, table_ in (("default", summary["default_policy"]), ("best k", summary["best_fixed_k"]),
                                 ("HF assisted", summary["hf_assisted"])):
                figures = table_.get(alpha, {}).get(c)
                if figures:
                    labels.append(f"{name}\nα={alpha}")
                    values.append(figures["tok_s"])
        axis.bar(range(len(values)), values, color="tab:blue")
        axis.set_xticks(range(len(values)), labels, fontsize=7)
        axis.set_title(f"concurrency {c}")
        axis.set_ylabel("output tokens/s")
    figure.suptitle(f"specmesh on {summary['gpu']} (set-acceptance pair)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
