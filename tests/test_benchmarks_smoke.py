"""Benchmark scripts still run against the code they measure (tiny models, seconds)."""

from __future__ import annotations

import json

import pytest

from workloads import load_script, word_prompts


def test_batched_logits_compares_every_kept_row_of_every_round(tiny_llama_dir, capsys):
    batched_logits = load_script("batched_logits")
    summary = batched_logits.main(["--model", str(tiny_llama_dir), "--sessions", "4", "--rounds", "2", "--k", "3",
                                   "--prompt-tokens", "4", "40", "--no-calibrate"])
    assert summary["rows"] >= 4 * 2  # at least one logit row per session per round
    assert summary["argmax_agrees"] and summary["max_abs_delta"] < batched_logits.NOISE_BOUND
    assert "check (max |Δlogit| < 1e-04 and every argmax agrees): met" in capsys.readouterr().out


def test_draft_precision_prices_and_scores_every_precision(tiny_llama_dir, tiny_llama_perturbed_dir, capsys):
    rows = load_script("draft_precision").main(["--target", str(tiny_llama_dir), "--draft", str(tiny_llama_perturbed_dir),
                                                "--dtypes", "float32", "int8", "--tokens", "6",
                                                "--head-tokens", "1000000", "4"])
    assert set(rows) == {"float32", "int8", "float32/1000000", "int8/1000000", "float32/4", "int8/4"}
    assert all(row["one_row_ms"] > 0 and 0 <= row["agreement"] <= 1 for row in rows.values())
    assert rows["float32"]["batching_delta"] < 1e-4  # padded rows of a batch are computed as if alone
    for dtype in ("float32", "int8"):  # a head past the vocabulary cuts nothing; four ids leave most tokens out
        assert rows[f"{dtype}/1000000"]["agreement"] == rows[dtype]["agreement"]
        assert rows[f"{dtype}/4"]["agreement"] < rows[dtype]["agreement"]
    assert "int8/4" in capsys.readouterr().out


@pytest.mark.unit
def test_plan_cost_times_both_ways_of_planning_at_each_load(capsys):
    table = load_script("plan_cost").main(["--requests", "1", "4", "--rounds", "2", "--repeats", "1"])
    assert set(table) == {1, 4} and all(us > 0 for row in table.values() for us in row.values())
    assert "per request" in capsys.readouterr().out


def test_cpu_linear_prices_both_kernels_and_compares_their_outputs(tiny_llama_dir, capsys):
    table = load_script("cpu_linear").main(["--model", str(tiny_llama_dir), "--rows", "1", "3", "--tokens", "6"])
    assert set(table) == {"torch", "onednn"}
    assert all(ms > 0 for rows in table.values() for ms in rows.values())
    assert "identical for 3 of 3 prompts" in capsys.readouterr().out


def test_openmp_contention_times_both_services_alone_and_beside_each_other(tiny_llama_dir, tiny_llama_perturbed_dir,
                                                                           capsys):
    table = load_script("openmp_contention").main(["--target", str(tiny_llama_dir), "--draft", str(tiny_llama_perturbed_dir),
                                                   "--draft-dtype", "float32", "--seconds", "0.3",
                                                   "--spin-counts", "2000"])
    rows = table["2000"]
    assert [row["model"] for row in rows] == [str(tiny_llama_dir), str(tiny_llama_perturbed_dir)]
    assert all(row["alone_ms"] > 0 and row["beside_ms"] > 0 and row["steps"] >= 1 for row in rows)
    assert "GOMP_SPINCOUNT" in capsys.readouterr().out


def test_openmp_contention_takes_turns_as_the_sequential_loop_does(tiny_llama_dir, tiny_llama_perturbed_dir, capsys):
    """--alternate 2: rounds of two draft steps and one target step; a round holds both sides' steps."""
    table = load_script("openmp_contention").main(["--target", str(tiny_llama_dir), "--draft", str(tiny_llama_perturbed_dir),
                                                   "--draft-dtype", "float32", "--seconds", "0.3", "--alternate", "2",
                                                   "--spin-counts", "2000"])
    row = table["2000"]
    assert row["rounds"] >= 1 and row["round_ms"] >= max(row["draft_ms"], row["target_ms"])  # each round holds both
    assert row["draft_ms"] > 0 and row["target_ms"] > 0 and all(ms > 0 for ms in row["alone_ms"])
    assert "round ms" in capsys.readouterr().out


def test_random_pair_builds_two_unrelated_models_that_load_with_one_vocabulary(tmp_path):
    from specmesh.loading.models import load_model, vocab_fingerprint
    built = load_script("random_pair").main([str(tmp_path / "pair"), "--small"])
    loaded = {role: load_model(str(path)) for role, path in built.items()}  # what `--target DIR` loads
    models = {role: model for role, (model, _) in loaded.items()}
    tokenizers = {role: tokenizer for role, (_, tokenizer) in loaded.items()}
    assert vocab_fingerprint(tokenizers["target"]) == vocab_fingerprint(tokenizers["draft"])
    assert all(model.config.vocab_size == len(tokenizers["target"]) for model in models.values())
    assert models["target"].config.num_hidden_layers > models["draft"].config.num_hidden_layers
    embeddings = [model.get_input_embeddings().weight[:, :8] for model in models.values()]
    assert not embeddings[0].allclose(embeddings[1])  # different seeds: the draft is no copy of the target


def test_prompt_lookup_replay_counts_every_round(tiny_llama_dir, capsys):
    summary = load_script("prompt_lookup_replay").main(["--model", str(tiny_llama_dir), "--kinds", "code",
                                                        "--num-prompts", "3", "--max-tokens", "24"])
    total = summary["all"]
    # Every round commits its accepted lookup tokens plus one: rounds + accepted covers the tokens.
    assert total["rounds"] + total["accepted"] == total["tokens"] > 0
    assert total["accepted"] <= total["proposed"] and total["accepted_at"][0] <= total["reached"][0]
    assert "acceptance by position" in capsys.readouterr().out


def test_draft_stop_replay_prices_every_rule_and_a_draft_that_is_the_target_is_always_accepted(tiny_llama_dir,
                                                                                                 capsys):
    tables = load_script("draft_stop_replay").main(["--target", str(tiny_llama_dir), "--draft", str(tiny_llama_dir),
                                                    "--draft-dtype", "float32", "--kinds", "code", "--num-prompts",
                                                    "2", "--max-tokens", "16", "--k", "3"])
    rules = tables["all"]
    assert {"k=1", "k=3", "conf<0.4", "run<0.4"} <= set(rules)
    tokens_per_s, drafted, tokens, accepted, expected = rules["k=3"]
    assert drafted == 3 and accepted > 0 and tokens_per_s > 0
    assert tokens > 3  # every drafted token accepted: 4 a round, less only where an output ends mid-round
    assert all(rule[1] <= 3 for rule in rules.values())  # no rule drafts past --k
    assert "the policy's T would be" in capsys.readouterr().out
    # a draft that is the target is never rejected: no alternative is ever committed
    assert rules["run<0.4+alt"][2] == rules["run<0.4"][2]


def test_hostile_load_keeps_authenticated_calls_working_under_idle_connections_and_a_flood(tiny_llama_dir, tmp_path):
    config = tmp_path / "limits.yaml"
    config.write_text("handshake-timeout: 2\n")
    results = load_script("hostile_load").main(["--target", str(tiny_llama_dir), "--config", str(config),
                                                "--idle", "300", "--idle-s", "4", "--flood", "300", "--floods", "1",
                                                "--baseline-s", "2"])
    assert results["idle"] == {} and results["log_growth"] < 1_000_000
    (statuses, failures), = results["floods"]
    assert failures == {} and set(statuses) == {"UNAUTHENTICATED"}


def test_soak_rss_finds_every_session_closed_and_every_process_drained(tiny_llama_dir, tiny_llama_perturbed_dir):
    results = load_script("soak_rss").main(["--target", str(tiny_llama_dir), "--draft", str(tiny_llama_perturbed_dir),
                                            "--streams", "40", "--checkpoint", "10", "--concurrency", "8",
                                            "--cancel-fraction", "0.5", "--prompt-tokens", "4", "40",
                                            "--max-tokens", "4", "16", "--kernels", "torch"])
    result = results["torch"]
    assert set(result["rss"]) == set(result["closed"]) == set(result["stopped"]) == {"orchestrator", "draft", "target"}
    assert sum(result["outcomes"].values()) == 40 and set(result["outcomes"]) <= {"completed", "cancelled"}
    assert all(isinstance(seconds, float) for seconds in result["closed"].values()), result["closed"]
    assert all(stopped == (0, True) for stopped in result["stopped"].values()), result["stopped"]


def test_draft_agreement_tells_a_matching_draft_from_an_unrelated_one(tiny_llama_dir, tiny_llama_unrelated_dir,
                                                                     tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(word_prompts(6, seed=3)) + "\n")
    results = load_script("draft_agreement").main([
        "--target", str(tiny_llama_dir), "--drafts", str(tiny_llama_dir), str(tiny_llama_unrelated_dir),
        "--prompts", str(prompts), "--last", "4", "--max-new-tokens", "8", "--window", "4", "--k", "3",
        "--draft-dtype", "float32"])
    same, unrelated = results
    assert same["agreement"] == 1.0 and same["by_window"] == [1.0, 1.0] and same["acceptance"] == 1.0
    assert unrelated["agreement"] < 0.5 and unrelated["acceptance"] < 0.5
    out = capsys.readouterr().out
    assert out.startswith("machine: ") and "4 prompts, 8 tokens each" in out


@pytest.mark.timeout(900)  # a server, three bench runs and five step-timing processes on two cores
def test_gpu_speculation_runs_every_mode_and_writes_the_issues_keys(tmp_path, capsys):
    """The GPU script end to end at test size on the CPU: the pair, one server per alpha, bench runs."""
    out = tmp_path / "gpu.json"
    summary = load_script("gpu_speculation").main([
        "--out", str(out), "--work", str(tmp_path / "work"), "--device", "cpu", "--dtype", "float32", "--small",
        "--alphas", "0.8", "--concurrency", "1", "2", "--speculative-concurrency", "1", "--sweep-k", "2",
        "--prompts-c1", "2", "--prompts-per-slot", "1", "--max-tokens", "6", "--commit", "abc",
        "--placement-seconds", "0.3", "--step-shapes", "1x1,2x3"])
    assert json.loads(out.read_text()) == summary and out.with_suffix(".png").is_file()
    assert summary["complete"] and summary["commit"] == "abc" and summary["copy_bandwidth_gb_s"] > 0 and summary["target_weights_read_ms"] > 0
    assert set(summary["target_only"]) == {"1", "2"} and summary["target_only"]["1"]["tok_s"] > 0
    assert summary["default_policy"]["0.8"]["1"]["tok_s"] > 0 and summary["best_fixed_k"]["0.8"]["1"]["k"] == 2
    assert 0 < summary["default_policy"]["0.8"]["1"]["rpc_share"] < 1  # the round clocks, from serve's /metrics
    assert summary["hf_assisted"]["0.8"]["1"]["tok_s"] > 0
    assert summary["outputs_identical"] is True  # served on, off, k=2 and the peer: the same greedy tokens
    placement = summary["placement"]  # each model alone, then both at once in two processes; no MPS on a CPU
    assert all(placement[key][role] > 0 for key in ("alone_ms", "shared_ms") for role in ("target", "draft"))
    assert placement["draft_on_cpu_ms"] > 0 and placement["mps_ms"] is None
    assert set(summary["engine_steps"]["ms"]) == {"off", "on"}  # graph steps, eager on a CPU
    assert all(summary["engine_steps"]["ms"][mode][shape] > 0 for mode in ("off", "on") for shape in ("1x1", "2x3"))
    assert "every output identical to target-only" in capsys.readouterr().out


@pytest.mark.parametrize("role", ["target", "draft"])
def test_round_calls_times_unary_and_stream_blocks_in_turn(tiny_llama_dir, capsys, role):
    blocks = load_script("round_calls").main(["--model", str(tiny_llama_dir), "--role", role, "--rounds", "4",
                                              "--blocks", "2"])
    assert [len(blocks["unary"]), len(blocks["stream"])] == [2, 2]
    assert all(ms > 0 for values in blocks.values() for ms in values)  # every round costs something beyond its forward
    out = capsys.readouterr().out
    assert out.startswith("machine: ") and "paired blocks" in out
