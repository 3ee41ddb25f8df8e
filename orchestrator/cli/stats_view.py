"""`specmesh stats`: a live terminal view of the orchestrator's Prometheus metrics.

The orchestrator already exports everything worth watching (specmesh/server/metrics.py);
this view scrapes that text endpoint rather than adding an RPC, so it works against
any running server, needs no extra port, and reads the same numbers a dashboard does.
Counters are summed over all label sets (optionally narrowed to one `prompt_class`
or `model`), and latency percentiles are estimated from the histogram buckets the
way PromQL's `histogram_quantile` does, so both views agree.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import urllib.parse
import urllib.request
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, TextIO

from prometheus_client.parser import text_string_to_metric_families

CLEAR_SCREEN = "\x1b[2J\x1b[H"
BAR_LEVELS = " ▁▂▃▄▅▆▇█"
LATENCIES = {"ttft": "specmesh_time_to_first_token_seconds", "tpot": "specmesh_time_per_output_token_seconds",
             "itl": "specmesh_inter_token_latency_seconds", "e2e": "specmesh_e2e_request_latency_seconds"}


@dataclass(frozen=True)
class Summary:
    """The figures one refresh shows; frozen so a previous snapshot cannot drift."""

    requests: int
    drafts: int
    draft_tokens: int
    accepted_tokens: int
    generation_tokens: int
    acceptance_rate: float | None
    mean_acceptance_length: float | None
    tokens_per_round: float | None
    target_forward_passes: int
    passes_saved: int
    draft_fallbacks: int
    ttft_p50: float | None
    ttft_p95: float | None
    tpot_p50: float | None
    tpot_p95: float | None
    itl_p50: float | None
    itl_p95: float | None
    e2e_p50: float | None
    e2e_p95: float | None
    requests_running: int
    requests_waiting: int
    acceptance_by_position: list[int]


def metrics_url(endpoint: str) -> str:
    """Accept `host:port` as typed on the command line as well as a full URL."""
    url = endpoint.strip()
    if "://" not in url:
        url = "http://" + url
    parts = urllib.parse.urlsplit(url)
    if parts.path in ("", "/"):
        parts = parts._replace(path="/metrics")
    return urllib.parse.urlunsplit(parts)


def fetch_metrics(url: str, timeout: float) -> str:
    """Scrape the exposition text; raises OSError (URLError, timeouts) for the caller to report."""
    with urllib.request.urlopen(metrics_url(url), timeout=timeout) as response:
        return response.read().decode("utf-8")


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Estimate quantile `q` from cumulative (upper_bound, count) buckets, as PromQL does.

    Linear interpolation inside the bucket holding the rank; a rank in the +Inf
    bucket answers the highest finite bound, since nothing better is known.
    None when there are no observations or the buckets lack +Inf.
    """
    ordered = sorted(buckets)
    if len(ordered) < 2 or not math.isinf(ordered[-1][0]) or ordered[-1][1] <= 0:
        return None
    if q < 0:
        return -math.inf
    if q > 1:
        return math.inf
    rank = q * ordered[-1][1]
    b = next(i for i, (_, count) in enumerate(ordered) if count >= rank)
    if b == len(ordered) - 1:
        return ordered[-2][0]
    if b == 0 and ordered[0][0] <= 0:
        return ordered[0][0]
    start, prev_count = (ordered[b - 1][0], ordered[b - 1][1]) if b > 0 else (0.0, 0.0)
    end, in_bucket = ordered[b][0], ordered[b][1] - prev_count
    if in_bucket <= 0:
        return start
    return start + (end - start) * (rank - prev_count) / in_bucket


class _Samples:
    """Samples by exposition name, already narrowed to the requested label values."""

    def __init__(self, text: str, filters: dict[str, str]):
        self._by_name: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                # A filter skips series that carry the label with another value; series without
                # the label (the model-only gauges under a prompt_class filter) still count.
                if all(sample.labels.get(k, v) == v for k, v in filters.items()):
                    self._by_name[sample.name].append((sample.labels, sample.value))

    def total(self, name: str) -> float:
        return sum(value for _, value in self._by_name.get(name, []))

    def by_label(self, name: str, label: str) -> dict[str, float]:
        sums: dict[str, float] = defaultdict(float)
        for labels, value in self._by_name.get(name, []):
            sums[labels.get(label, "")] += value
        return sums

    def quantile(self, q: float, histogram: str) -> float | None:
        """Sum buckets of all label sets by bound, then estimate; merging first is what PromQL's sum by (le) does."""
        buckets = self.by_label(histogram + "_bucket", "le")
        return histogram_quantile(q, [(float(le), count) for le, count in buckets.items()])


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator > 0 else None


def summarize(text: str, prompt_class: str | None = None, model: str | None = None) -> Summary:
    """Reduce one scrape to the figures a speculative-decoding operator watches."""
    filters = {k: v for k, v in (("prompt_class", prompt_class), ("model", model)) if v is not None}
    s = _Samples(text, filters)
    requests = s.total("specmesh_requests_total")
    drafts = s.total("specmesh_spec_decode_num_drafts_total")
    draft_tokens = s.total("specmesh_spec_decode_num_draft_tokens_total")
    accepted = s.total("specmesh_spec_decode_num_accepted_tokens_total")
    generated = s.total("specmesh_generation_tokens_total")
    passes = s.total("specmesh_target_forward_passes_total")
    per_pos = s.by_label("specmesh_spec_decode_num_accepted_tokens_per_pos_total", "position")
    latencies = {f"{key}_p{int(q * 100)}": s.quantile(q, name) for key, name in LATENCIES.items() for q in (0.5, 0.95)}
    return Summary(
        requests=round(requests), drafts=round(drafts), draft_tokens=round(draft_tokens),
        accepted_tokens=round(accepted), generation_tokens=round(generated),
        acceptance_rate=_ratio(accepted, draft_tokens),
        mean_acceptance_length=_ratio(accepted, drafts),
        # every request spends one pass on prefill, which also yields its first token
        tokens_per_round=_ratio(generated - requests, passes - requests),
        target_forward_passes=round(passes),
        passes_saved=round(s.total("specmesh_target_forward_passes_saved_total")),
        draft_fallbacks=round(s.total("specmesh_draft_fallbacks_total")),
        requests_running=round(s.total("specmesh_requests_running")),
        requests_waiting=round(s.total("specmesh_requests_waiting")),
        acceptance_by_position=[round(per_pos[p]) for p in sorted(per_pos, key=lambda p: int(p))],
        **latencies)


def _fmt(value: float | None, spec: str, scale: float = 1.0, suffix: str = "") -> str:
    return "-" if value is None else format(value * scale, spec) + suffix


def position_bar(counts: list[int], drafts: int) -> str:
    """One glyph per position, scaled to the share of rounds that accepted it; the shape shows where drafts fail."""
    if not counts:
        return "-"
    top = drafts if drafts > 0 else max(max(counts), 1)
    glyphs = "".join(BAR_LEVELS[min(len(BAR_LEVELS) - 1, round(c / top * (len(BAR_LEVELS) - 1)))] for c in counts)
    shares = " ".join(f"{c / top:.0%}" for c in counts[:8])
    return f"{glyphs}  ({shares}{' ...' if len(counts) > 8 else ''})"


def render(summary: Summary, previous: Summary | None = None) -> str:
    """A compact table; with `previous`, also the requests finished since that snapshot."""
    s = summary
    rows = [
        ("requests", f"{s.requests}" + (f"  (+{s.requests - previous.requests})" if previous else "")),
        ("running / waiting", f"{s.requests_running} / {s.requests_waiting}"),
        ("acceptance", f"{_fmt(s.acceptance_rate, '.1%')}  ({s.accepted_tokens}/{s.draft_tokens} draft tokens)"),
        ("mean accept length", _fmt(s.mean_acceptance_length, ".2f") + " tokens/round"),
        ("tokens / round", _fmt(s.tokens_per_round, ".2f")),
        ("target passes", f"{s.target_forward_passes}  (saved {s.passes_saved})"),
        ("draft fallbacks", f"{s.draft_fallbacks}"),
    ]
    for key, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "e2e")):
        p50, p95 = getattr(s, f"{key}_p50"), getattr(s, f"{key}_p95")
        rows.append((f"{label} p50 / p95", f"{_fmt(p50, '.1f', 1e3)} / {_fmt(p95, '.1f', 1e3)} ms"))
    rows.append(("accepted by position", position_bar(s.acceptance_by_position, s.drafts)))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows) + "\n"


def _snapshot(endpoint: str, timeout: float, prompt_class: str | None, model: str | None) -> Summary:
    return summarize(fetch_metrics(endpoint, timeout), prompt_class=prompt_class, model=model)


def _report_error(endpoint: str, error: Exception) -> None:
    reason = getattr(error, "reason", error)
    print(f"specmesh stats: cannot read metrics from {metrics_url(endpoint)}: {reason}", file=sys.stderr)


def run(endpoint: str, interval: float, once: bool, prompt_class: str | None, out: TextIO | None = None,
        model: str | None = None, sleep: Callable[[float], None] = time.sleep) -> int:
    """Print one summary (`once`) or redraw every `interval` s until Ctrl-C.

    `out` defaults to the sys.stdout of call time (not import time) so captured output works.
    Once: an unreachable endpoint is an error (exit 2). Live: it is reported and retried,
    since the server may simply be restarting.
    """
    out = out or sys.stdout
    timeout = max(1.0, interval) if not once else 5.0
    previous: Summary | None = None
    try:
        while True:
            try:
                summary = _snapshot(endpoint, timeout, prompt_class, model)
            except (OSError, ValueError) as error:
                _report_error(endpoint, error)
                if once:
                    return 2
            else:
                out.write(render(summary) if once else CLEAR_SCREEN + render(summary, previous))
                out.flush()
                if once:
                    return 0
                previous = summary
            sleep(interval)
    except KeyboardInterrupt:
        return 0


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `stats`; dispatch goes through `args.handler(args)` so cli.py needs one line."""
    stats = subparsers.add_parser("stats", help="live view of a running orchestrator's metrics")
    stats.add_argument("--endpoint", required=True, help="metrics address: HOST:PORT or http://HOST:PORT/metrics")
    stats.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    stats.add_argument("--once", action="store_true", help="print one summary and exit")
    stats.add_argument("--prompt-class", default=None, help="only requests of this prompt_class")
    stats.add_argument("--model", default=None, help="only series of this model")
    stats.set_defaults(handler=lambda args: run(args.endpoint, args.interval, args.once, args.prompt_class,
                                                model=args.model))
    return stats
