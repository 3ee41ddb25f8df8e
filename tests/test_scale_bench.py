"""The scale benchmark's small run (`python -m benchmarks.scale --small`), run as a user runs it: one orchestrator
attached to two emulated target services and one draft service, speculation off then on, every cell's figures
reported, greedy outputs identical to target-only. Speed is the benchmark's to report, not asserted here."""

from __future__ import annotations

from benchmarks.scale import SMALL, engines_bound, replica_shares
from benchmark_runs import run_small

FIGURES = ("tokens_per_s", "bound_tokens_per_s", "bound_h1_tokens_per_s", "of_bound", "committed_tokens",
           "orchestrator_cpu_share", "itl_p50_ms", "itl_p99_ms", "sessions_per_target_step", "wall_s")


def test_the_small_run_reports_every_cell_against_the_engines_bound(tmp_path):
    result, out = run_small("benchmarks.scale", tmp_path)
    assert result["emulated"] is True and result["profile"]  # every figure says it is emulated, and whence
    cells = {cell["speculation"]: cell for cell in result["cells"]}
    assert set(cells) == {"off", "on"}
    for cell in cells.values():
        assert (cell["targets"], cell["drafts"], cell["concurrency"]) == (2, 1, 2)
        assert all(cell.get(name) is not None for name in FIGURES), cell
        assert cell["failed"] == 0 and cell["tokens_per_s"] > 0 and cell["committed_tokens"] > 0
        assert set(cell["cpu_s_per_1k_tokens"]) == {"orchestrator", "target", "draft"}
        assert cell["cpu_s_per_1k_tokens"]["orchestrator"] > 0
        assert 1.0 <= cell["sessions_per_target_step"] <= cell["concurrency"]
        assert cell["greedy_identical"] is True  # over two target replicas as over one
    assert cells["on"]["bound_h1_tokens_per_s"] > cells["off"]["bound_tokens_per_s"]  # drafting can pay here
    assert out.with_suffix(".md").read_text().count("\n") == 2 + len(cells)


def test_the_bound_splits_sessions_evenly_over_target_replicas():
    assert replica_shares(5, 2) == [3, 2] and replica_shares(1, 4) == [1, 0, 0, 0]
    one = engines_bound(SMALL, (1, 1), 1, speculation=False, hit=0.0)["bound_tokens_per_s"]
    # Sessions alone on their replicas each step at one session's step time: n replicas, n times the tokens.
    assert engines_bound(SMALL, (4, 1), 4, speculation=False, hit=0.0)["bound_tokens_per_s"] == 4 * one
    # Lockstep batching: 4 sessions on one replica step together, slower than alone but far more than one's.
    batched = engines_bound(SMALL, (1, 1), 4, speculation=False, hit=0.0)["bound_tokens_per_s"]
    assert one < batched < 4 * one
    drafting = engines_bound(SMALL, (1, 1), 1, speculation=True, hit=0.5)
    assert one < drafting["bound_tokens_per_s"] <= drafting["bound_h1_tokens_per_s"]
