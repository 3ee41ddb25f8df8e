"""The regime benchmark's small sweep (`python -m benchmarks.regime --small`), run as a user runs it: the emulated pair
served by `specmesh serve` attached to its services, directly and over a delay line, every cell's figures
reported, greedy outputs identical to target-only. Speed is the benchmark's to report, not asserted here."""

from __future__ import annotations

from benchmark_runs import run_small

FIGURES = ("tokens_per_s", "speedup", "bound_sequential", "bound_pipelined", "bound_pipelined_h1",
           "predraft_hit_rate", "bytes_per_round", "bytes_per_token", "target_busy_ms_per_token",
           "overhead_ms_per_round", "round_ms", "cpu_ms_per_round", "tokens_per_round", "sessions_per_target_step")


def test_the_small_sweep_reports_every_cell_against_its_bound(tmp_path):
    result, out = run_small("benchmarks.regime", tmp_path)
    assert result["emulated"] is True and result["profiles"]["h100-8b"]  # every figure says it is emulated
    cells = {cell["placement"]: cell for cell in result["cells"]}
    assert set(cells) == {"direct", "beside-target"}
    for cell in cells.values():
        assert all(cell.get(name) is not None for name in FIGURES), cell
        assert cell["tokens_per_s"] > 0 and cell["baseline_tokens_per_s"] > 0
        assert cell["greedy_identical"] is True  # lossless over the link as without it
        assert cell["bound_pipelined_h1"] >= cell["bound_pipelined"] >= cell["bound_sequential"] > 1.0
        assert {"orchestrator", "target", "draft"} <= set(cell["cpu_ms_per_round"])
        assert 1.0 <= cell["sessions_per_target_step"] <= cell["concurrency"]
    direct, linked = cells["direct"], cells["beside-target"]
    assert direct["bytes_per_round"] == 0 and linked["bytes_per_round"] > 0  # only links count bytes
    assert (linked["rtt_ms"], linked["bandwidth"]) == (5.0, "1gbit")
    assert linked["bound_sequential"] < direct["bound_sequential"]  # the link's round trip costs every round
    assert out.with_suffix(".md").read_text().count("\n") == 2 + len(cells)
    assert out.with_suffix(".png").stat().st_size > 0
