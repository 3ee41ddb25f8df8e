"""The result of a bench run: the JSON file and the tables printed to stdout."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
from pathlib import Path

from orchestrator.bench.metrics import LATENCIES, lookup
from orchestrator.bench.modes import DEFAULT, OFF, PEER_OFF, fixed_k, mode_title, peer_k
from orchestrator.bench.sweep import kind_throughput

PEER_NOTE = ("HF k=N, HF target-only: transformers' generate in-process, one request at a time, assisted by the "
             "draft at a constant k of N (with transformers' default confidence stop: the assistant ends a round "
             "early below assistant_confidence_threshold, 0.4 to start) and with the target alone; the A/B "
             "columns show the peer at its best k (the most output tokens/s of the configuration). It takes turns "
             "with the served modes prompt by prompt; its drafted tokens are its draft's forward calls.")
UNEVEN_STEPS = 0.1  # the target alone, peer against served: beyond the several % a host varies between runs
LATENCY_TITLES = {"ttft_ms": "TTFT", "tpot_ms": "TPOT", "itl_ms": "ITL", "e2e_ms": "E2E"}


def machine_info() -> dict:
    import torch
    import transformers
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            cpu = next((line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"platform": platform.platform(), "machine": platform.machine(), "cpu": cpu, "cpu_count": os.cpu_count(),
            "python": sys.version.split()[0], "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "transformers": transformers.__version__,
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def write_json(result: dict, path: Path) -> None:
    path.write_text(json.dumps(result, indent=2, allow_nan=False))


def _cell(value, digits: int = 2) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}"


def _ratio(value) -> str:
    return "-" if value is None else f"{value:.2f}x"


def metric_rows() -> list[tuple[str, str, int]]:
    """(label, metric path, decimals) in table order."""
    rows = [("requests/s", "request_throughput", 3), ("output tokens/s", "output_throughput", 2)]
    for name in LATENCIES:
        for stat in ("mean", "p50", "p95", "p99"):
            rows.append((f"{LATENCY_TITLES[name]} {stat} (ms)", f"{name}.{stat}", 1))
    rows += [("acceptance rate", "acceptance_rate", 3), ("mean acceptance length", "mean_acceptance_length", 2),
             ("lookup tokens verified", "lookup_tokens", 0), ("lookup tokens accepted", "lookup_accepted_tokens", 0),
             ("suffix tokens verified", "suffix_tokens", 0), ("suffix tokens accepted", "suffix_accepted_tokens", 0),
             ("alternatives verified", "alternative_tokens", 0),
             ("alternatives committed", "alternative_accepted_tokens", 0),
             ("completed / failed", "", 0)]
    return rows


# entry key -> column title: on vs off, on vs the peer at its best k, the peer's own speedup
RATIOS = {"speedup_on_vs_off": "on/off", "speedup_on_vs_peer": "on/HF", "speedup_peer_vs_peer_off": "HF/HF off"}


def ab_modes(entry: dict) -> list[str]:
    """The A/B tables' modes that ran: on, off, the peer at its best constant k, the peer's target alone
    (the fixed ks of a sweep and the peer's other ks have their own lines)."""
    best = entry.get("peer", {}).get("best_mode")
    return [mode for mode in (DEFAULT, OFF, best, PEER_OFF) if mode in entry["modes"]]


def _done_failed(overall: dict) -> str:
    return f"{overall['completed']} / {overall['failed']}"


def configuration_table(entry: dict) -> str:
    """Metrics as rows; spec on, spec off and the peer (best k, target alone) as columns with the speedups."""
    modes = entry["modes"]
    columns = ab_modes(entry)
    ratios = [key for key in RATIOS if key in entry]
    header = (f"{'metric':<26}" + "".join(f"{mode_title(m):>15}" for m in columns)
              + "".join(f"{RATIOS[key]:>10}" for key in ratios))
    lines = [f"== {entry['name']} ({modes[columns[0]]['overall']['num_requests']} requests) ==", header,
             "-" * len(header)]
    for label, metric, digits in metric_rows():
        if not metric:
            lines.append(f"{label:<26}" + "".join(f"{_done_failed(modes[m]['overall']):>15}" for m in columns))
            continue
        lines.append(f"{label:<26}" + "".join(f"{_cell(lookup(modes[m]['overall'], metric), digits):>15}"
                                              for m in columns)
                     + "".join(f"{_ratio(entry[key].get(metric)):>10}" for key in ratios))
    return "\n".join(lines + pass_lines(entry) + peer_lines(entry) + output_lines(entry))


def output_lines(entry: dict) -> list[str]:
    """Greedy prompts: whether every mode's output was the first mode's, token for token."""
    outputs = entry.get("outputs")
    if outputs is None:
        return []
    if outputs["identical"]:
        return [f"greedy outputs: identical in all {len(outputs['modes'])} modes ({outputs['prompts']} prompts)"]
    return [f"greedy outputs: DIFFER from {mode_title(outputs['reference'])} on prompts "
            f"{outputs['differing_prompts']} (modes {', '.join(map(mode_title, outputs['modes']))})"]


def peer_lines(entry: dict) -> list[str]:
    """With the peer: its output tokens/s at each constant k, and the k its A/B column shows."""
    peer = entry.get("peer")
    if peer is None:
        return []
    by_k = ", ".join(f"k={k} {_cell(entry['modes'][peer_k(k)]['overall']['output_throughput'])}" for k in peer["ks"])
    best = "-" if peer["best_k"] is None else f"k={peer['best_k']}"
    return [f"HF assisted output tokens/s by constant k: {by_k}; best {best}", *uneven_lines(peer)]


def uneven_lines(peer: dict) -> list[str]:
    """The target alone, served and in the peer's process: the same step, so they should take the same time."""
    steps = peer.get("target_step_ms")
    if steps is None:
        return []
    line = (f"target alone: {steps['peer']:.1f} ms a step in the peer's process, {steps['served']:.1f} in the "
            f"target service ({steps['peer_over_served']:.2f}x)")
    if abs(steps["peer_over_served"] - 1) <= UNEVEN_STEPS:
        return [line]
    return [line + ": UNEVEN, this host ran the same step at different speeds in the two processes, so on/HF "
                   "favours the faster one; compare on/off with HF/HF off instead"]


def pass_lines(entry: dict) -> list[str]:
    """With --repeats: each pass's output tokens/s per mode, and on/off pass by pass (the run's noise)."""
    modes = entry["modes"]
    passes = {mode: figures["passes"] for mode, figures in modes.items() if "passes" in figures}
    if not passes:
        return []
    lines = ["output tokens/s by pass: " + "; ".join(
        f"{mode_title(mode)} " + ", ".join(_cell(p["output_throughput"]) for p in figures)
        for mode, figures in passes.items())]
    if "speedup_on_vs_off_by_pass" in entry:
        ratios = entry["speedup_on_vs_off_by_pass"]
        known = [r for r in ratios if r is not None]
        median = f" (median {_ratio(statistics.median(known))})" if len(known) > 2 else ""
        lines.append("on/off by pass: " + ", ".join(_ratio(r) for r in ratios) + median)
    return lines


def kind_table(result: dict) -> str:
    """Per configuration and prompt kind: acceptance and output tokens/s, on vs off, and the peer at the
    configuration's best constant k vs its target alone."""
    header = (f"{'configuration':<18}{'kind':<10}{'accept':>8}{'acc.len':>9}{'tok/s on':>10}{'tok/s off':>11}"
              f"{'on/off':>8}{'tok/s HF':>10}{'HF k':>6}{'HF off':>8}{'HF/HF off':>11}")
    lines = ["== by prompt kind (tokens/s over each kind's own request time) ==", header, "-" * len(header)]
    for entry in result["configurations"]:
        modes, peer = entry["modes"], entry.get("peer", {})
        for kind, on in modes[DEFAULT]["per_kind"].items():
            off, best, alone = (kind_throughput(modes, mode, kind) for mode in (OFF, peer.get("best_mode"), PEER_OFF))
            lines.append(f"{entry['name']:<18}{kind:<10}{_cell(on['acceptance_rate'], 3):>8}"
                         f"{_cell(on['mean_acceptance_length']):>9}{_cell(on['output_throughput']):>10}"
                         f"{_cell(off):>11}{_ratio(_divide(on['output_throughput'], off)):>8}{_cell(best):>10}"
                         f"{_best_k(peer):>6}{_cell(alone):>8}{_ratio(_divide(best, alone)):>11}")
    return "\n".join(lines)


def _best_k(peer: dict) -> str:
    return "-" if peer.get("best_k") is None else str(peer["best_k"])


def summary_table(result: dict) -> str:
    """One line per configuration: the headline figures, and the peer at its best constant k."""
    header = (f"{'configuration':<18}{'tok/s on':>10}{'tok/s off':>11}{'speedup':>9}{'tok/s HF':>10}{'HF k':>6}"
              f"{'HF/HF off':>11}{'TTFT p50':>10}{'TPOT p50':>10}{'ITL p50':>9}{'E2E p50':>10}{'accept':>8}"
              f"{'acc.len':>9}")
    lines = ["== summary (latencies: spec on, ms; HF: the peer at its best k) ==", header, "-" * len(header)]
    for entry in result["configurations"]:
        modes, peer = entry["modes"], entry.get("peer", {})
        on = modes[DEFAULT]["overall"]
        off = modes.get(OFF, {}).get("overall", {})
        best = modes.get(peer.get("best_mode"), {}).get("overall", {})
        lines.append(f"{entry['name']:<18}{_cell(on['output_throughput']):>10}"
                     f"{_cell(off.get('output_throughput')):>11}"
                     f"{_ratio(entry.get('speedup_on_vs_off', {}).get('output_throughput')):>9}"
                     f"{_cell(best.get('output_throughput')):>10}{_best_k(peer):>6}"
                     f"{_ratio(entry.get('speedup_peer_vs_peer_off', {}).get('output_throughput')):>11}"
                     + "".join(f"{_cell(on[name]['p50'], 1):>{w}}" for name, w in
                               (("ttft_ms", 10), ("tpot_ms", 10), ("itl_ms", 9), ("e2e_ms", 10)))
                     + f"{_cell(on['acceptance_rate'], 3):>8}{_cell(on['mean_acceptance_length']):>9}")
    return "\n".join(lines)


def concurrency_table(result: dict) -> str:
    """One row per configuration and mode: how throughput and latency move with concurrency, also as
    ratios to the lowest concurrency of the same mode and temperature (the batching criteria read so)."""
    header = (f"{'configuration':<18}{'mode':<16}{'tok/s':>9}{'ITL p50':>9}{'ITL p99':>9}{'TPOT p50':>10}"
              f"{'TTFT p50':>10}{'E2E p50':>10}{'tok/s/c1':>10}{'ITLp99/c1':>11}{'done/failed':>13}")
    lines = ["== by concurrency (ms; /c1: ratio to the lowest concurrency) ==", header, "-" * len(header)]
    lowest: dict[tuple, dict] = {}  # (temperature, mode) -> figures at the lowest concurrency
    for entry in sorted(result["configurations"], key=lambda e: e["max_concurrency"]):
        for mode in ab_modes(entry):
            lowest.setdefault((entry["temperature"], mode), entry["modes"][mode]["overall"])
    for entry in result["configurations"]:
        for mode in ab_modes(entry):
            overall, base = entry["modes"][mode]["overall"], lowest[entry["temperature"], mode]
            lines.append(f"{entry['name']:<18}{mode_title(mode):<16}{_cell(overall['output_throughput']):>9}"
                         f"{_cell(overall['itl_ms']['p50'], 1):>9}{_cell(overall['itl_ms']['p99'], 1):>9}"
                         f"{_cell(overall['tpot_ms']['p50'], 1):>10}{_cell(overall['ttft_ms']['p50'], 1):>10}"
                         f"{_cell(overall['e2e_ms']['p50'], 1):>10}"
                         f"{_ratio(_divide(overall['output_throughput'], base['output_throughput'])):>10}"
                         f"{_ratio(_divide(overall['itl_ms']['p99'], base['itl_ms']['p99'])):>11}"
                         f"{_done_failed(overall):>13}")
    return "\n".join(lines)


def sweep_table(entry: dict) -> str:
    """One row per fixed k, the default policy and off; then where the default stands."""
    sweep = entry["draft_length_sweep"]
    header = (f"{'mode':<10}{'tok/s':>9}{'vs off':>8}{'TTFT p50':>10}{'ITL p50':>9}{'accept':>8}"
              f"{'acc.len':>9}")
    lines = [f"== draft-length sweep, {entry['name']} (ms; vs off: output tokens/s over speculation off's) ==",
             header, "-" * len(header)]
    for mode in [*map(fixed_k, sweep["fixed_ks"]), DEFAULT, OFF]:
        overall = entry["modes"][mode]["overall"]
        lines.append(f"{'default' if mode == DEFAULT else mode:<10}{_cell(overall['output_throughput']):>9}"
                     f"{_ratio(sweep['output_throughput_vs_off'].get(mode)):>8}"
                     f"{_cell(overall['ttft_ms']['p50'], 1):>10}{_cell(overall['itl_ms']['p50'], 1):>9}"
                     f"{_cell(overall['acceptance_rate'], 3):>8}{_cell(overall['mean_acceptance_length']):>9}")
    return "\n".join(lines + [standing_line(sweep)])


def standing_line(standing: dict) -> str:
    """default policy: 3.10 tok/s = 1.43x off, 96% of the best fixed k (k=6, 3.23 tok/s)"""
    share = standing["default_vs_best_fixed_k"]
    best = "-" if standing["best_fixed_k"] is None else f"k={standing['best_fixed_k']}"
    return (f"default policy: {_cell(standing['default_output_throughput'])} tok/s = "
            f"{_ratio(standing['default_vs_off'])} off, {'-' if share is None else f'{share:.0%}'} of the best "
            f"fixed k ({best}, {_cell(standing['best_fixed_k_output_throughput'])} tok/s)")


def sweep_kind_table(result: dict) -> str:
    """Per configuration and prompt kind: the default policy against that kind's best fixed k and off."""
    header = (f"{'configuration':<18}{'kind':<10}{'default':>9}{'best k':>8}{'tok/s k':>9}{'off':>8}"
              f"{'default/off':>13}{'default/best':>14}")
    lines = ["== draft-length sweep by prompt kind (tokens/s over each kind's own request time) ==", header,
             "-" * len(header)]
    for entry in result["configurations"]:
        for kind, standing in entry.get("draft_length_sweep", {}).get("per_kind", {}).items():
            best = "-" if standing["best_fixed_k"] is None else f"k={standing['best_fixed_k']}"
            lines.append(f"{entry['name']:<18}{kind:<10}{_cell(standing['default_output_throughput']):>9}"
                         f"{best:>8}{_cell(standing['best_fixed_k_output_throughput']):>9}"
                         f"{_cell(standing['off_output_throughput']):>8}{_ratio(standing['default_vs_off']):>13}"
                         f"{_ratio(standing['default_vs_best_fixed_k']):>14}")
    return "\n".join(lines)


ROUND_COLUMNS = (("drafted", "drafted_per_round", 2), ("draft", "draft_busy_ms", 1), ("target", "target_busy_ms", 1),
                 ("overlap", "overlap_ms", 1), ("wire", "wire_ms", 1), ("orch.", "idle_ms", 1),
                 ("round", "wall_ms", 1), ("between", "between_ms", 1), ("decode", "decode_ms", 1))


def round_table(result: dict) -> str | None:
    """Per configuration and mode: where a decode round's time went (orchestrator.bench.round_parts);
    None where no mode has the figures."""
    header = f"{'configuration':<18}{'mode':<16}{'rounds':>8}" + "".join(f"{t:>9}" for t, _, _ in ROUND_COLUMNS)
    lines = []
    for entry in result["configurations"]:
        for mode, figures in entry["modes"].items():
            parts = figures.get("round_parts")
            if parts is not None:
                lines.append(f"{entry['name']:<18}{mode_title(mode):<16}{parts['rounds']:>8}"
                             + "".join(f"{_cell(parts.get(key), d):>9}" for _, key, d in ROUND_COLUMNS))
    if not lines:
        return None
    return "\n".join(["== where a decode round's time goes (ms a round, rounds after the first token) ==", header,
                      "-" * len(header), *lines, ROUND_NOTE])


ROUND_NOTE = ("drafted: draft tokens a round; draft, target: their forward time; overlap: of the two at once "
              "(pipelined); wire: calls' time beyond forward; orch.: the rest of the round (for the peer: "
              "transformers' own loop); round: the round's own clock; between: streaming and the loop between "
              "rounds; decode: a round as the client saw it (time after the first token over rounds).")


def _divide(value, base):
    return value / base if value is not None and base else None


def print_report(result: dict, out=None) -> None:
    out = out or sys.stdout  # looked up now: whatever stdout is at the call (a test's capture included)
    for entry in result["configurations"]:
        print(configuration_table(entry) + "\n", file=out)
    print(kind_table(result) + "\n", file=out)
    print(concurrency_table(result) + "\n", file=out)
    print(summary_table(result), file=out)
    if any("peer" in entry for entry in result["configurations"]):
        print("\n" + PEER_NOTE, file=out)
    rounds = round_table(result)
    if rounds is not None:
        print("\n" + rounds, file=out)
    swept = [entry for entry in result["configurations"] if "draft_length_sweep" in entry]
    for entry in swept:
        print("\n" + sweep_table(entry), file=out)
    if swept:
        print("\n" + sweep_kind_table(result), file=out)
