"""benchmarks/online_distill_shift.py on the tiny models: a real `specmesh serve` with an unrelated draft
runs one online distillation cycle under the closed loop; the timeline and its plot are written, no
request fails, and every greedy output is the target's own."""

from __future__ import annotations

import csv
import json

from test_benchmarks_smoke import load_script
from test_distill import word_prompts

# Few, cheap steps: the test needs a cycle to finish, whatever its verdict.
QUICK_DISTILL = ("--lora-rank 16 --learning-rate 1e-2 --steps 4 --batch-size 32 --max-new-tokens 8 "
                 "--held-out-fraction 0.25 --k 4")


def test_the_shift_benchmark_times_a_cycle_under_load(tiny_llama_dir, tiny_llama_unrelated_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": text}) + "\n" for text in word_prompts(32, seed=21)))
    result_dir = tmp_path / "shift"
    summary = load_script("online_distill_shift").main([
        "--target", str(tiny_llama_dir), "--draft", str(tiny_llama_unrelated_dir), "--prompts", str(prompts),
        "--result-dir", str(result_dir), "--concurrency", "4", "--max-tokens", "8", "--k", "4",
        # the first cycle once the evidence holds its least (24 prompts); the loop ends when it does
        "--distill-tokens", "1", "--distill-interval", "0", "--distill-args", QUICK_DISTILL,
        "--until-cycles", "1", "--tail-s", "0", "--duration", "240", "--sample-s", "0.5", "--check-greedy",
        "--check-greedy-prompts", "3", "--think-s", "0.01"])
    assert sum(summary["cycles"].values()) >= 1, summary
    assert summary["requests"] >= 24 and summary["failed_requests"] == 0, summary
    assert summary["greedy_check"]["prompts"] == 3 and summary["greedy_check"]["differ"] == 0
    timeline = json.loads((result_dir / "timeline.json").read_text())["timeline"]
    assert any(row["cycle_running"] for row in timeline) and timeline[-1]["cycles_done"] >= 1
    with (result_dir / "timeline.csv").open() as handle:
        assert len(list(csv.DictReader(handle))) == len(timeline)
    assert (result_dir / "timeline.png").stat().st_size > 0
    out = capsys.readouterr().out
    assert out.startswith("machine: ") and "command: python benchmarks/online_distill_shift.py --target" in out
    assert "acceptance before the first rollout: " in out and "after the last rollout: " in out
    assert "greedy check: " in out and ": ok" in out
