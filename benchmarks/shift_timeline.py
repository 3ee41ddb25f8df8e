"""The timeline of benchmarks/online_distill_shift.py: samples of the orchestrator's metrics, what
they add up to, and the files it writes (timeline.json, timeline.csv, timeline.png).

A row is one sample: the client's cumulative counts (requests, failures, output tokens) and the
orchestrator's (tokens drafted and accepted by the draft model, the serving draft's version,
whether a cycle is running, rollbacks, cycles by outcome). Each row after the first also holds
what happened since the one before it: the live acceptance, output tokens/s, and whether a cycle
ran in that interval.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after choosing the backend

from benchmarks.bench_pipeline import total  # noqa: E402

GAUGES = {"drafted": "specmesh_draft_model_draft_tokens_total",
          "accepted": "specmesh_draft_model_accepted_tokens_total",
          "draft_version": "specmesh_online_distill_draft_version",
          "cycle_running": "specmesh_online_distill_cycle_running",
          "rollbacks": "specmesh_online_distill_rollbacks_total"}
CYCLES = "specmesh_online_distill_cycles_total"
CSV_FIELDS = ("t_s", "requests", "failed", "tokens", "drafted", "accepted", "draft_version", "cycle_running",
              "rollbacks", "cycles_done", "in_cycle", "acceptance", "tokens_per_s", "event")


def sample_row(samples: dict, t_s: float, requests: int, failed: int, tokens: int) -> dict:
    """One sample from a scrape of the orchestrator's /metrics (bench_pipeline.scrape) and the client's counts."""
    row = {"t_s": round(t_s, 3), "requests": requests, "failed": failed, "tokens": tokens}
    row.update({name: total(samples, metric) for name, metric in GAUGES.items()})
    row["cycles"] = {dict(labels)["outcome"]: value for (name, labels), value in samples.items() if name == CYCLES}
    row["cycles_done"] = sum(row["cycles"].values())
    return row


def add_intervals(rows: list[dict]) -> list[dict]:
    """Each row's interval since the row before: acceptance, tokens/s, whether a cycle ran, and the event
    that ended it (a rollout: the draft's version changed without a rollback; a rollback)."""
    for before, row in zip(rows, rows[1:]):
        seconds = row["t_s"] - before["t_s"]
        row["acceptance"] = rate(before, row)
        row["tokens_per_s"] = (row["tokens"] - before["tokens"]) / seconds if seconds > 0 else None
        # A cycle that started and ended between two samples still shows in the count of finished cycles.
        row["in_cycle"] = bool(before["cycle_running"] or row["cycle_running"]
                               or row["cycles_done"] > before["cycles_done"])
        row["event"] = ("rollback" if row["rollbacks"] > before["rollbacks"] else
                        "rollout" if row["draft_version"] != before["draft_version"] else "")
    if rows:
        rows[0].update(acceptance=None, tokens_per_s=None, in_cycle=bool(rows[0]["cycle_running"]), event="")
    return rows


def rate(first: dict, last: dict) -> float | None:
    """The draft's acceptance between two samples; None when it drafted nothing."""
    drafted = last["drafted"] - first["drafted"]
    return (last["accepted"] - first["accepted"]) / drafted if drafted > 0 else None


def relative(after: float | None, before: float | None) -> float | None:
    return after / before - 1 if after is not None and before else None


def throughput(rows: list[dict], in_cycle: bool) -> float | None:
    """Output tokens/s over the intervals with (or without) a cycle running."""
    chosen = [(before, row) for before, row in zip(rows, rows[1:]) if row["in_cycle"] == in_cycle]
    seconds = sum(row["t_s"] - before["t_s"] for before, row in chosen)
    return sum(row["tokens"] - before["tokens"] for before, row in chosen) / seconds if seconds > 0 else None


def summarise(rows: list[dict]) -> dict:
    """Acceptance before the first rollout and after the last; tok/s outside and inside cycles; cycles."""
    rollouts = [index for index, row in enumerate(rows) if row["event"] == "rollout"]
    before = rate(rows[0], rows[rollouts[0]] if rollouts else rows[-1])
    after = rate(rows[rollouts[-1]], rows[-1]) if rollouts else None
    outside, during = throughput(rows, False), throughput(rows, True)
    change = relative(during, outside)
    return {"acceptance_before_first_rollout": before, "acceptance_after_last_rollout": after,
            "acceptance_relative_change": relative(after, before),
            "tokens_per_s_outside_cycles": outside, "tokens_per_s_while_cycle_runs": during,
            "throughput_lost_while_cycle_runs": None if change is None else 0.0 - change,  # never -0.0
            "cycles": {outcome: int(count) for outcome, count in rows[-1]["cycles"].items() if count},
            "rollouts": len(rollouts), "rollbacks": int(rows[-1]["rollbacks"]),
            "requests": rows[-1]["requests"], "failed_requests": rows[-1]["failed"],
            "seconds": rows[-1]["t_s"]}


def _figure(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _percent(value: float | None) -> str:
    return "" if value is None else f" ({value:+.1%})"


def summary_lines(summary: dict) -> list[str]:
    s = summary
    after = (_figure(s["acceptance_after_last_rollout"]) + _percent(s["acceptance_relative_change"])
             if s["rollouts"] else "- (no rollout)")
    lost = s["throughput_lost_while_cycle_runs"]
    cycles = ", ".join(f"{count} {outcome}" for outcome, count in sorted(s["cycles"].items())) or "none"
    return [f"acceptance before the first rollout: {_figure(s['acceptance_before_first_rollout'])}; "
            f"after the last rollout: {after}",
            f"output tokens/s outside cycles: {_figure(s['tokens_per_s_outside_cycles'], 1)}; while a cycle runs: "
            f"{_figure(s['tokens_per_s_while_cycle_runs'], 1)}"
            + ("" if lost is None else f" (throughput lost while a cycle runs: {lost:.1%})"),
            f"cycles: {cycles}; rollouts {s['rollouts']}, rollbacks {s['rollbacks']}",
            f"requests: {s['requests']} completed, {s['failed_requests']} failed "
            + ("ok" if s["failed_requests"] == 0 else "FAILED") + f" (in {s['seconds']:.0f} s)"]


def write_files(rows: list[dict], result: dict, directory: Path) -> list[Path]:
    """timeline.json (the rows and `result`), timeline.csv (the rows) and timeline.png."""
    paths = [directory / "timeline.json", directory / "timeline.csv", directory / "timeline.png"]
    paths[0].write_text(json.dumps({**result, "timeline": rows}, indent=2))
    with paths[1].open("w", newline="") as handle:
        writer = csv.DictWriter(handle, CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, paths[2])
    return paths


def cycle_spans(rows: list[dict]) -> list[tuple[float, float]]:
    """(start, end) seconds of each run of intervals in which a cycle ran."""
    spans: list[tuple[float, float]] = []
    for before, row in zip(rows, rows[1:]):
        if not row["in_cycle"]:
            continue
        if spans and spans[-1][1] == before["t_s"]:
            spans[-1] = (spans[-1][0], row["t_s"])
        else:
            spans.append((before["t_s"], row["t_s"]))
    return spans


def plot(rows: list[dict], path: Path) -> None:
    """Acceptance and output tokens/s per interval over time; cycles shaded, rollouts and rollbacks marked."""
    figure, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(10, 6))
    times = [row["t_s"] for row in rows[1:]]
    top.plot(times, _gaps([row["acceptance"] for row in rows[1:]]), marker=".", color="tab:blue")
    bottom.plot(times, _gaps([row["tokens_per_s"] for row in rows[1:]]), marker=".", color="tab:orange")
    top.set_ylabel("live acceptance")
    bottom.set_ylabel("output tokens/s")
    bottom.set_xlabel("seconds")
    for axes in (top, bottom):
        for number, (start, end) in enumerate(cycle_spans(rows)):
            axes.axvspan(start, end, color="tab:gray", alpha=0.25, label="cycle running" if number == 0 else None)
        for row in rows:
            if row["event"]:
                colour = "tab:green" if row["event"] == "rollout" else "tab:red"
                axes.axvline(row["t_s"], color=colour, linestyle="--", label=row["event"])
    by_label = dict(zip(*reversed(top.get_legend_handles_labels())))  # one legend entry per label
    if by_label:
        top.legend(by_label.values(), by_label.keys(), loc="best")
    top.set_title("online distillation under traffic: acceptance and throughput")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def _gaps(values: list[float | None]) -> list[float]:
    """None (nothing drafted in an interval) as NaN: a gap in the line."""
    return [float("nan") if value is None else value for value in values]
