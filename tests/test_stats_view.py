"""`specmesh stats`: derived figures from a real registry served over HTTP on 127.0.0.1.

The registry is the orchestrator's own (specmesh/server/metrics.py), so a renamed series or a
changed suffix breaks these tests rather than silently showing zeros in the view.
"""

from __future__ import annotations

import argparse
import io
import math
import socket

import pytest

from orchestrator.cli.stats_view import (CLEAR_SCREEN, add_parser, fetch_metrics, histogram_quantile, metrics_url,
                                         render, run, summarize)
from specmesh.server.metrics import OrchestratorMetrics, serve_metrics

MODEL = "tiny-target"
# prompt_class -> (requests, rounds, draft tokens, accepted, generated, target passes, fallbacks, per-position)
TRAFFIC = {
    "code": (2, 4, 16, 10, 20, 7, 0, (4, 3, 2, 1)),
    "chat": (1, 2, 8, 2, 10, 4, 1, (2,)),
}
TTFT = {"code": (0.15, 0.15), "chat": (0.3,)}


def _populate(m: OrchestratorMetrics) -> None:
    """Three requests with hand-picked counts, so every expected figure below is computable by hand."""
    for cls, (reqs, rounds, drafted, accepted, generated, passes, fallbacks, per_pos) in TRAFFIC.items():
        labels = {"model": MODEL, "prompt_class": cls}
        m.requests.labels(**labels, finish_reason="stop").inc(reqs)
        m.num_drafts.labels(**labels).inc(rounds)
        m.num_draft_tokens.labels(**labels).inc(drafted)
        m.num_accepted_tokens.labels(**labels).inc(accepted)
        m.generation_tokens.labels(**labels).inc(generated)
        m.target_forward_passes.labels(**labels).inc(passes)
        m.target_forward_passes_saved.labels(**labels).inc(generated - passes)
        m.draft_fallbacks.labels(**labels).inc(fallbacks)
        for position, count in enumerate(per_pos):
            m.num_accepted_tokens_per_pos.labels(**labels, position=str(position)).inc(count)
        for seconds in TTFT[cls]:
            m.ttft.labels(**labels).observe(seconds)
    m.e2e.labels(model=MODEL, prompt_class="chat").observe(200.0)  # beyond the last finite bucket
    m.requests_running.labels(model=MODEL).set(2)
    m.requests_waiting.labels(model=MODEL).set(1)


@pytest.fixture(scope="module")
def endpoint() -> str:
    metrics = OrchestratorMetrics()
    _populate(metrics)
    return f"127.0.0.1:{serve_metrics(metrics.registry, '127.0.0.1', 0)}"


@pytest.fixture
def dead_endpoint() -> str:
    """A port nobody listens on: bound then released, so connecting is refused at once."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


def test_summary_over_all_classes(endpoint: str) -> None:
    s = summarize(fetch_metrics(endpoint, timeout=5))
    assert (s.requests, s.drafts, s.draft_tokens, s.accepted_tokens) == (3, 6, 24, 12)
    assert s.acceptance_rate == pytest.approx(0.5)
    assert s.mean_acceptance_length == pytest.approx(2.0)
    assert s.tokens_per_round == pytest.approx((30 - 3) / (11 - 3))
    assert (s.target_forward_passes, s.passes_saved, s.draft_fallbacks) == (11, 19, 1)
    assert (s.requests_running, s.requests_waiting) == (2, 1)
    assert s.acceptance_by_position == [6, 3, 2, 1]
    # TTFT buckets: le=0.1 -> 0, le=0.2 -> 2, le=0.4 -> 3
    assert s.ttft_p50 == pytest.approx(0.1 + 0.1 * 1.5 / 2)
    assert s.ttft_p95 == pytest.approx(0.2 + 0.2 * 0.85)
    assert s.e2e_p50 == pytest.approx(160.0)  # rank in +Inf: the highest finite bound
    assert s.tpot_p50 is s.tpot_p95 is s.itl_p50 is None


def test_summary_filtered_by_prompt_class(endpoint: str) -> None:
    s = summarize(fetch_metrics(f"http://{endpoint}/metrics", timeout=5), prompt_class="chat")
    assert (s.requests, s.drafts, s.draft_tokens, s.accepted_tokens) == (1, 2, 8, 2)
    assert s.acceptance_rate == pytest.approx(0.25)
    assert s.mean_acceptance_length == pytest.approx(1.0)
    assert s.tokens_per_round == pytest.approx((10 - 1) / (4 - 1))
    assert s.acceptance_by_position == [2]
    assert s.ttft_p50 == pytest.approx(0.3)
    assert s.requests_running == 2  # model-only gauges survive a prompt_class filter
    empty = summarize(fetch_metrics(endpoint, timeout=5), model="other")
    assert empty.requests == 0 and empty.acceptance_rate is None and empty.tokens_per_round is None
    assert empty.ttft_p50 is None and empty.acceptance_by_position == []


@pytest.mark.unit
@pytest.mark.parametrize("q, expected", [(0.25, 1.0), (0.5, 1.5), (0.9, 3.2), (1.0, 4.0), (0.0, 0.0)])
def test_histogram_quantile_interpolates(q: float, expected: float) -> None:
    buckets = [(2.0, 30.0), (1.0, 10.0), (math.inf, 40.0), (4.0, 40.0)]  # order must not matter
    assert histogram_quantile(q, buckets) == pytest.approx(expected)


@pytest.mark.unit
def test_histogram_quantile_edges() -> None:
    assert histogram_quantile(0.5, [(1.0, 1.0), (math.inf, 4.0)]) == 1.0
    assert histogram_quantile(0.25, [(0.0, 2.0), (1.0, 4.0), (math.inf, 8.0)]) == 0.0
    assert histogram_quantile(0.5, [(1.0, 0.0), (math.inf, 0.0)]) is None
    assert histogram_quantile(0.5, [(1.0, 2.0), (2.0, 3.0)]) is None  # no +Inf bucket
    assert histogram_quantile(0.5, []) is None


def test_run_once_prints_acceptance(endpoint: str) -> None:
    out = io.StringIO()
    assert run(endpoint, interval=2.0, once=True, prompt_class=None, out=out) == 0
    text = out.getvalue()
    assert "50.0%" in text and "12/24" in text
    assert "175.0 / 370.0 ms" in text
    assert CLEAR_SCREEN not in text


@pytest.mark.unit
def test_run_once_unreachable(dead_endpoint: str, capsys: pytest.CaptureFixture[str]) -> None:
    out = io.StringIO()
    assert run(dead_endpoint, interval=2.0, once=True, prompt_class=None, out=out) == 2
    assert out.getvalue() == ""
    assert f"cannot read metrics from http://{dead_endpoint}/metrics" in capsys.readouterr().err


def test_run_live_redraws_and_retries(endpoint: str, dead_endpoint: str, capsys: pytest.CaptureFixture[str]) -> None:
    ticks: list[float] = []

    def sleep(seconds: float) -> None:
        ticks.append(seconds)
        if len(ticks) == 2:
            raise KeyboardInterrupt

    out = io.StringIO()
    assert run(endpoint, interval=0.5, once=False, prompt_class="code", out=out, sleep=sleep) == 0
    assert out.getvalue().count(CLEAR_SCREEN) == 2 and "(+0)" in out.getvalue()
    ticks.clear()
    assert run(dead_endpoint, interval=0.5, once=False, prompt_class=None, out=out, sleep=sleep) == 0
    assert ticks == [0.5, 0.5] and capsys.readouterr().err.count("cannot read metrics") == 2


def test_render_handles_missing_figures(endpoint: str) -> None:
    text = render(summarize(fetch_metrics(endpoint, timeout=5), model="other"))
    assert "acceptance" in text and "- / - ms" in text


@pytest.mark.unit
def test_metrics_url_normalises() -> None:
    assert metrics_url("h:9") == "http://h:9/metrics"
    assert metrics_url("http://h:9") == "http://h:9/metrics"
    assert metrics_url("http://h:9/custom") == "http://h:9/custom"


@pytest.mark.unit
def test_add_parser_dispatches() -> None:
    parser = argparse.ArgumentParser(prog="specmesh")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["stats", "--endpoint", "h:9", "--once", "--prompt-class", "code"])
    assert (args.endpoint, args.interval, args.once, args.prompt_class) == ("h:9", 2.0, True, "code")
    assert callable(args.handler)
