"""benchmarks/online_distill_shift.py on the tiny models: a real `specmesh serve` with an unrelated draft
runs one online distillation cycle under the closed loop; the timeline and its plot are written, no
request fails, and every greedy output is the target's own."""

from __future__ import annotations

import csv
import json

from workloads import load_script, word_prompts

# Few, cheap steps: the test needs a cycle to finish, whatever its verdict.
QUICK_DISTILL = ("--lora-rank 16 --learning-rate 1e-2 --steps 4 --batch-size 32 --max-new-tokens 8 "
                 "--held-out-fraction 0.25 --k 4")


def test_the_shift_benchmark_times_a_cycle_under_load(tiny_llama_dir, tiny_llama_unrelated_dir, tmp_path, capsys,
                                                     monkeypatch):
    monkeypatch.chdir(tmp_path)  # started outside the repository, with a relative result directory
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": text}) + "\n" for text in word_prompts(32, seed=21)))
    result_dir = tmp_path / "shift"
    summary = load_script("online_distill_shift").main([
        "--target", str(tiny_llama_dir), "--draft", str(tiny_llama_unrelated_dir), "--prompts", str(prompts),
        "--result-dir", "shift", "--concurrency", "4", "--max-tokens", "8", "--k", "4",
        # the first cycle once the evidence holds its least (24 prompts); the loop ends when it does
        "--distill-tokens", "1", "--distill-interval", "0", "--distill-args", QUICK_DISTILL,
        "--until-cycles", "1", "--tail-s", "0", "--duration", "240", "--sample-s", "0.5", "--check-greedy",
        "--check-greedy-prompts", "3", "--think-s", "0.01", "--paired", "4"])
    assert sum(summary["cycles"].values()) >= 1, summary
    assert summary["requests"] >= 24 and summary["failed_requests"] == 0, summary
    assert summary["greedy_check"]["prompts"] == 3 and summary["greedy_check"]["differ"] == 0
    timeline = json.loads((result_dir / "timeline.json").read_text())["timeline"]
    assert any(row["cycle_running"] for row in timeline) and timeline[-1]["cycles_done"] >= 1
    with (result_dir / "timeline.csv").open() as handle:
        assert len(list(csv.DictReader(handle))) == len(timeline)
    assert (result_dir / "timeline.png").stat().st_size > 0
    out = capsys.readouterr().out
    assert out.startswith("machine: ") and "command: python -m benchmarks.online_distill_shift --target" in out
    assert "acceptance before the first rollout: " in out and "after the last rollout: " in out
    assert "greedy check: " in out and ": ok" in out
    assert "paired acceptance" in out and ("paired" in summary)


def test_paired_acceptance_compares_the_cycles_prompts_served_again_after_the_rollout():
    pairs = load_script("shift_pairs")
    Served = pairs.Served
    served = [Served(0, 1.0, 4.0, 10, 9),  # before the cycle: in its evidence, never replayed
              Served(1, 6.0, 9.0, 10, 5), Served(2, 7.0, 11.0, 10, 6),  # while it ran, old draft
              Served(3, 9.5, 14.0, 10, 7)]  # finished after the rollout: partly the new draft's
    replay = pairs.to_replay(served, cycle_started_s=5.0, old_draft_until_s=12.0)
    assert replay == [1, 2]
    assert pairs.paired(served) is None  # nothing sent again yet
    served += [Served(1, 20.0, 22.0, 10, 8, replay_of=1), Served(2, 22.0, 25.0, 10, 9, replay_of=2)]
    result = pairs.paired(served)
    assert result["prompts"] == 2 and result["acceptance_before"] == 0.55 and result["acceptance_after"] == 0.85
    assert abs(result["relative_change"] - (0.85 / 0.55 - 1)) < 1e-12
    assert "0.550 -> 0.850 (+54.5%)" in pairs.paired_line(result)


def test_a_cycle_starts_at_the_first_sample_of_its_latest_run():
    shift = load_script("online_distill_shift")
    rows = [{"t_s": t, "cycle_running": running} for t, running in
            [(0, 0), (5, 1), (10, 0), (15, 1), (20, 1), (25, 0)]]
    assert shift.cycle_started_s(rows) == 15
    assert shift.cycle_started_s(rows[:3]) == 5
