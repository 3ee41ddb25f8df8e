"""`specmesh bench` end to end on the tiny models: the JSON has every field, the plots exist."""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from harness import load, start_stack
from orchestrator.bench import sweep
from orchestrator.bench.clients import RunClient
from orchestrator.bench.metrics import percentile
from orchestrator.prompts.sets import BUILTIN, KINDS, PromptFileError, load_jsonl, select_prompts
from orchestrator.bench.report import standing_line
from orchestrator.bench.modes import DEFAULT, OFF, request_speculation
from orchestrator.bench.round_parts import RoundParts
from orchestrator.bench.runner import (MAX_PASSES, Configuration, LoadSettings, wants_another_pass, arrival_times,
                                       run_modes, warm_up)
from orchestrator.cli.main import main as specmesh_main
from orchestrator.serving.http_api import create_app, start_http_server, stop_http_server
from orchestrator.decoding.request import LoopConfig
from orchestrator.control.build import OrchestratorOptions
from orchestrator.control.build import create_servicer

ROOT = Path(__file__).resolve().parents[1]
RESULT_KEYS = {"command", "started_at", "finished_at", "config", "server", "machine", "prompts", "configurations",
               "requests"}
CONFIGURATION_KEYS = {"name", "max_concurrency", "temperature", "modes"}
AGGREGATE_KEYS = {"num_requests", "completed", "failed", "duration_s", "total_prompt_tokens", "total_output_tokens",
                  "request_throughput", "output_throughput", "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "draft_tokens",
                  "accepted_tokens", "rounds", "acceptance_rate", "mean_acceptance_length", "lookup_tokens",
                  "lookup_accepted_tokens", "suffix_tokens", "suffix_accepted_tokens", "alternative_tokens",
                  "alternative_accepted_tokens"}
LATENCY_KEYS = {"mean", "p50", "p95", "p99"}
REQUEST_KEYS = {"configuration", "kind", "mode", "index", "repeat", "ok", "error", "start_s", "ttft_ms", "tpot_ms", "e2e_ms",
                "itl_ms", "prompt_tokens", "output_tokens", "draft_tokens", "accepted_tokens", "rounds",
                "lookup_tokens", "lookup_accepted_tokens", "suffix_tokens", "suffix_accepted_tokens",
                "alternative_tokens", "alternative_accepted_tokens", "n",
                "completion_tokens", "output_digest"}
PLOTS = ("latency_distributions.png", "throughput_by_concurrency.png", "itl_by_concurrency.png",
         "acceptance_by_kind.png")
JSONL = [
    {"kind": "code", "prompt": "def add(a, b):", "max_tokens": 6},
    {"kind": "code", "prompt": "the quick brown fox", "max_tokens": 8},
    {"kind": "chat", "messages": [{"role": "user", "content": "write a function"}], "max_tokens": 6},
    {"kind": "story", "prompt": "once upon a time", "temperature": 1.0, "max_tokens": 5},
]


NOT_SPECULATIVE = {"off", "peer-off"}


def check_aggregate(figures: dict, requests: int, speculative: bool) -> None:
    assert set(figures) == AGGREGATE_KEYS
    assert figures["num_requests"] == figures["completed"] == requests and figures["failed"] == 0
    assert figures["total_output_tokens"] > 0 and figures["output_throughput"] > 0
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        stats = figures[name]
        assert set(stats) == LATENCY_KEYS and 0 <= stats["p50"] <= stats["p95"] <= stats["p99"], (name, stats)
    if speculative:
        assert figures["draft_tokens"] > 0 and 0 <= figures["acceptance_rate"] <= 1
        assert 1 <= figures["mean_acceptance_length"]
    else:
        assert figures["draft_tokens"] == 0 and figures["acceptance_rate"] is None


def check_result(result_dir: Path, names: list[str], modes: set[str], requests: int, kinds: set[str]) -> dict:
    result = json.loads((result_dir / "result.json").read_text())
    assert set(result) == RESULT_KEYS
    assert [entry["name"] for entry in result["configurations"]] == names
    for entry in result["configurations"]:
        expected_modes = modes if entry["max_concurrency"] == 1 else {m for m in modes if not m.startswith("peer")}
        assert CONFIGURATION_KEYS <= set(entry) and set(entry["modes"]) == expected_modes
        for mode, figures in entry["modes"].items():
            check_aggregate(figures["overall"], requests, mode not in NOT_SPECULATIVE)
            assert set(figures["per_kind"]) == kinds
            assert sum(k["num_requests"] for k in figures["per_kind"].values()) == requests
        assert set(entry["speedup_on_vs_off"]) >= {"output_throughput", "ttft_ms.p50", "e2e_ms.p99"}
    assert len(result["requests"]) == sum(len(e["modes"]) for e in result["configurations"]) * requests
    assert all(set(r) == REQUEST_KEYS for r in result["requests"])
    for plot in PLOTS:
        assert (result_dir / plot).stat().st_size > 1000
    return result


async def test_bench_draft_length_sweep(tmp_path, capsys, tiny_llama_dir, tiny_llama_perturbed_dir):
    """--sweep-k 1 3 against a server whose own k is a fixed 6: a row for k=1, k=3, the default and off, the
    fixed ks drafted no more than their k per round while the default drafted more (so the k was sent), and
    the standing line names the best fixed k of the run."""
    stack = await start_stack(tiny_llama_dir, tiny_llama_perturbed_dir, k=6)
    try:
        code = await asyncio.to_thread(specmesh_main, [
            "bench", "--endpoint", f"127.0.0.1:{stack.port}", "--kinds", "code", "chat",
            "--tokenizer", str(tiny_llama_dir), "--num-prompts", "2", "--max-tokens", "12", "--temperature", "0", "--sweep-k", "3", "1", "--num-warmups", "1",
            "--no-progress", "--result-dir", str(tmp_path)])
    finally:
        await stack.stop()
    assert code == 0
    result = check_result(tmp_path, ["c=1 T=0"], {"on", "off", "k=1", "k=3"}, 2, {"code", "chat"})
    entry = result["configurations"][0]
    figures = entry["draft_length_sweep"]
    for mode, k in (("k=1", 1), ("k=3", 3), ("on", 6)):
        records = [r for r in result["requests"] if r["mode"] == mode]
        assert all(r["draft_tokens"] <= k * r["rounds"] for r in records), (mode, records)
    default = entry["modes"]["on"]["overall"]
    assert default["draft_tokens"] > 3 * default["rounds"]  # the server's own k drafts more than k=3 asked
    throughput = {k: entry["modes"][f"k={k}"]["overall"]["output_throughput"] for k in (1, 3)}
    best = max((1, 3), key=lambda k: throughput[k])
    assert figures["fixed_ks"] == [1, 3] and figures["best_fixed_k"] == best
    assert figures["default_vs_best_fixed_k"] == pytest.approx(default["output_throughput"] / throughput[best])
    assert set(figures["per_kind"]) == {"code", "chat"}
    out = capsys.readouterr().out
    table = out.split("== draft-length sweep, c=1 T=0", 1)[1].split("\n\n", 1)[0].splitlines()
    rows = {line.split()[0]: line.split()[1:] for line in table[3:-1]}
    assert list(rows) == ["k=1", "k=3", "default", "off"]
    assert rows["off"][1] == "1.00x" and float(rows["default"][0]) == round(default["output_throughput"], 2)
    assert table[-1].startswith("default policy: ") and f"of the best fixed k (k={best}, " in table[-1]
    assert "== draft-length sweep by prompt kind" in out
    assert (tmp_path / "tokens_by_k.png").stat().st_size > 1000


@pytest.mark.unit
def test_sweep_standing_ties_and_failed_modes():
    """A tie goes to the smaller k; a fixed k whose requests all failed (no throughput) is never the best;
    with no fixed k measured the standing line prints dashes instead of failing."""
    modes = {"on": 4.0, "off": 2.0, "k=2": 5.0, "k=4": 5.0, "k=6": None}
    standing = sweep.standing(modes.get, [2, 4, 6])
    assert standing["best_fixed_k"] == 2 and standing["default_vs_best_fixed_k"] == pytest.approx(0.8)
    assert standing["default_vs_off"] == pytest.approx(2.0) and standing["best_fixed_k_vs_off"] == pytest.approx(2.5)
    assert standing_line(standing) == ("default policy: 4.00 tok/s = 2.00x off, 80% of the best fixed k "
                                       "(k=2, 5.00 tok/s)")
    nothing = sweep.standing({"on": 4.0, "off": 2.0}.get, [6])
    assert nothing["best_fixed_k"] is None and standing_line(nothing).endswith("- of the best fixed k (-, - tok/s)")


@pytest.mark.unit
@pytest.mark.parametrize("k", ["0", "40", "x"])
def test_sweep_k_outside_the_draft_limit_is_rejected(capsys, k):
    with pytest.raises(SystemExit) as exit_info:
        specmesh_main(["bench", "--sweep-k", "1", k])
    assert exit_info.value.code == 2 and "argument --sweep-k" in capsys.readouterr().err


def test_bench_self_started_ab_peer_jsonl(tmp_path, tiny_llama_dir, tiny_llama_perturbed_dir):
    """On and off served, then the peer at --peer-k 1 2 and with its target alone, beside concurrency 1 only;
    the tables compare on with the peer at its best k."""
    prompt_file = tmp_path / "prompts.jsonl"
    prompt_file.write_text("\n".join(json.dumps(line) for line in JSONL) + "\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli.main", "bench", "--target", str(tiny_llama_dir),
         "--draft", str(tiny_llama_perturbed_dir), "--num-speculative-tokens", "3",
         "--speculation-policy", "fixed", "--prompt-file", str(prompt_file),
         "--num-prompts", "4", "--max-concurrency", "1", "2", "--ab", "--peer-k", "1", "2", "--num-warmups", "1",
         "--result-dir", str(tmp_path / "out")], capture_output=True, text=True, env=env, cwd=ROOT, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    result = check_result(tmp_path / "out", ["c=1 T=default", "c=2 T=default"],
                          {"on", "off", "peer-off", "peer k=1", "peer k=2"}, 4, {"code", "chat", "story"})
    check_peer(result["configurations"][0], [r for r in result["requests"] if r["mode"].startswith("peer")],
               done.stdout)
    outputs = result["configurations"][0]["outputs"]  # the three greedy prompts (the story samples)
    assert outputs["identical"] and outputs["prompts"] == 3 and len(outputs["modes"]) == 5, outputs
    assert "greedy outputs: identical in all 5 modes (3 prompts)" in done.stdout
    c2_table = done.stdout.split("== c=2 T=default", 1)[1].split("\n\n", 1)[0]
    assert "peer" not in result["configurations"][1] and "HF" not in c2_table and "on/off" in c2_table
    limits = {line.get("prompt"): line["max_tokens"] for line in JSONL}
    for record in result["requests"]:  # each line's own max_tokens
        assert 0 < record["output_tokens"] <= limits[result["prompts"][record["index"]]["prompt"]]
    assert result["server"]["self_started"] and result["config"]["request_rate"] == "inf"
    # The peer runs what the services report running (their auto choices, resolved), not a timing of its own.
    weights = result["server"]["weights"]
    assert set(weights) == {"target", "draft"} and weights["target"]["precision"] == "float32"
    assert all(w["cpu_linear"] in ("onednn", "torch") and w["precision"] for w in weights.values())
    assert (f"({weights['target']['precision']}, {weights['target']['cpu_linear']} linear) and "
            in done.stderr and "as the services run them" in done.stderr)


def check_peer(entry: dict, records: list[dict], out: str) -> None:
    """The best k is the faster of k=1 and k=2; the peer's speedup is its best k over its target alone; the
    target alone drafts nothing and k=1 at most one token a round."""
    throughput = {mode: figures["overall"]["output_throughput"] for mode, figures in entry["modes"].items()}
    best = max((1, 2), key=lambda k: throughput[f"peer k={k}"])
    steps = entry["peer"].pop("target_step_ms")  # the target alone, timed in both processes
    assert entry["peer"] == {"ks": [1, 2], "best_k": best, "best_mode": f"peer k={best}"}
    modes = entry["modes"]
    assert (steps["served"], steps["peer"]) == (modes["off"]["round_parts"]["target_busy_ms"],
                                                modes["peer-off"]["round_parts"]["target_busy_ms"])
    assert f"target alone: {steps['peer']:.1f} ms a step in the peer's process" in out
    assert entry["speedup_peer_vs_peer_off"]["output_throughput"] == pytest.approx(
        throughput[f"peer k={best}"] / throughput["peer-off"])
    assert entry["speedup_on_vs_peer"]["output_throughput"] == pytest.approx(throughput["on"] /
                                                                             throughput[f"peer k={best}"])
    assert all(r["draft_tokens"] == r["rounds"] == 0 for r in records if r["mode"] == "peer-off")
    # one draft forward a drafted token: k = 1 drafts one a round, none where only the last token is left
    assert all(r["rounds"] - 1 <= r["draft_tokens"] <= r["rounds"] and r["rounds"] > 0
               for r in records if r["mode"] == "peer k=1")
    for line in ("== c=1 T=default (4 requests) ==", "on/off", "on/HF", "HF/HF off", f"HF k={best}",
                 "HF target-only", "HF assisted output tokens/s by constant k: k=1 ", "its drafted tokens are its "
                 "draft's forward calls", "== summary", "== where a decode round's time goes"):
        assert line in out
    check_round_parts(entry["modes"])


def check_round_parts(modes: dict[str, dict]) -> None:
    """Every mode's decode rounds split into parts: the served from the orchestrator's clocks, the peer's from
    its forward hooks; a round drafts only where its mode drafts, and the parts add up to the round."""
    parts = {mode: figures["round_parts"] for mode, figures in modes.items()}
    assert set(parts) == {"on", "off", "peer-off", "peer k=1", "peer k=2"}
    for mode, figures in parts.items():
        assert figures["rounds"] > 0 and figures["target_busy_ms"] > 0, mode
        assert figures["decode_ms"] >= figures["wall_ms"] * 0.99, mode
        assembled = sum(figures[f"{part}_ms"] for part in ("draft_busy", "target_busy", "wire", "idle"))
        assert assembled - figures["overlap_ms"] == pytest.approx(figures["wall_ms"], rel=0.01, abs=0.5), mode
    assert parts["on"]["draft_busy_ms"] > 0 and 0 < parts["on"]["drafted_per_round"] <= 3
    assert parts["off"]["draft_busy_ms"] == parts["off"]["drafted_per_round"] == 0
    assert parts["peer-off"]["draft_busy_ms"] == parts["peer-off"]["drafted_per_round"] == 0
    assert parts["peer k=1"]["draft_busy_ms"] > 0 and 0 < parts["peer k=1"]["drafted_per_round"] <= 1
    assert 0 < parts["peer k=2"]["drafted_per_round"] <= 2


async def test_bench_against_running_http_server(tmp_path, capsys, tiny_llama_dir, tiny_llama_perturbed_dir, device):
    """Over HTTP, at a request rate, two passes a mode (--repeats 2): each pass timed and reported."""
    stack = await start_stack(tiny_llama_dir, tiny_llama_perturbed_dir, k=3, device=device)
    _, tokenizer = load(str(tiny_llama_dir), device)
    servicer = await create_servicer(tokenizer, OrchestratorOptions(  # fixed k: "on" must draft
        f"127.0.0.1:{stack.target_port}", f"127.0.0.1:{stack.draft_port}", LoopConfig(3, adaptive_k=False)))
    server, port, task = await start_http_server(create_app(servicer), "127.0.0.1", 0)
    try:
        code = await asyncio.to_thread(specmesh_main, [
            "bench", "--endpoint", f"127.0.0.1:{port}", "--protocol", "http", "--num-prompts", "4",
            "--max-tokens", "5", "--temperature", "0", "1", "--request-rate", "50", "--max-concurrency", "2",
            "--ab", "--repeats", "2", "--num-warmups", "0", "--no-progress", "--result-dir", str(tmp_path)])
    finally:
        await stop_http_server(server, task)
        await stack.stop()
    assert code == 0
    result = check_result(tmp_path, ["c=2 T=0", "c=2 T=1"], {"on", "off"}, 8, set(KINDS))
    out = capsys.readouterr().out
    for entry in result["configurations"]:
        for mode, figures in entry["modes"].items():
            passes = figures["passes"]
            assert len(passes) == 2 and all(p["output_throughput"] > 0 for p in passes)
            assert sum(p["duration_s"] for p in passes) == pytest.approx(figures["overall"]["duration_s"])
            tokens = [sum(r["output_tokens"] for r in result["requests"] if r["configuration"] == entry["name"]
                          and r["mode"] == mode and r["repeat"] == repeat) for repeat in (0, 1)]
            assert [p["output_throughput"] * p["duration_s"] for p in passes] == pytest.approx(tokens)
        by_pass = entry["speedup_on_vs_off_by_pass"]
        assert by_pass == pytest.approx([on["output_throughput"] / off["output_throughput"] for on, off in
                                         zip(entry["modes"]["on"]["passes"], entry["modes"]["off"]["passes"])])
        assert "on/off by pass: " + ", ".join(f"{r:.2f}x" for r in by_pass) in out
    assert result["server"] == {"endpoint": f"127.0.0.1:{port}", "protocol": "http", "self_started": False,
                                "target": "qwen2.5-coder-1.5b", "draft": "qwen2.5-coder-0.5b",
                                "num_speculative_tokens": None, "weights": {}}  # a user's server: not asked


async def test_bench_concurrency_sweep_on_and_off_in_one_run(tmp_path, capsys, tiny_llama_dir,
                                                             tiny_llama_perturbed_dir):
    """The concurrency sweep, shrunk: concurrency 1 and 2, speculation on and off, against a gRPC server; a
    table row per concurrency and mode, and the throughput and ITL plots."""
    stack = await start_stack(tiny_llama_dir, tiny_llama_perturbed_dir, k=3)  # fixed k: "on" drafts
    try:
        code = await asyncio.to_thread(specmesh_main, [
            "bench", "--endpoint", f"127.0.0.1:{stack.port}", "--kinds", "code", "--num-prompts", "4",
            "--max-tokens", "12", "--temperature", "0", "--max-concurrency", "1", "2", "--ab", "--num-warmups", "0",
            "--no-progress", "--result-dir", str(tmp_path)])
    finally:
        await stack.stop()
    assert code == 0
    result = check_result(tmp_path, ["c=1 T=0", "c=2 T=0"], {"on", "off"}, 4, {"code"})
    table = capsys.readouterr().out.split("== by concurrency", 1)[1].split("\n\n", 1)[0]
    rows = {(line[:18].split()[0], line[18:31].strip()): line[31:].split() for line in table.splitlines()[3:]}
    assert set(rows) == {(c, m) for c in ("c=1", "c=2") for m in ("spec on", "spec off")}
    for entry in result["configurations"]:
        for mode, figures in entry["modes"].items():
            overall = figures["overall"]
            row = rows[entry["name"].split()[0], f"spec {mode}"]
            tokens_per_s, itl_p50, itl_p99 = map(float, row[:3])
            assert tokens_per_s == round(overall["output_throughput"], 2) > 0
            assert 0 < itl_p50 <= itl_p99 and itl_p99 == round(overall["itl_ms"]["p99"], 1)
            c1 = next(e for e in result["configurations"] if e["max_concurrency"] == 1)["modes"][mode]["overall"]
            assert row[6] == f"{overall['output_throughput'] / c1['output_throughput']:.2f}x"  # tok/s / c1
            # 12 tokens in at most 12 chunks: the gaps cannot add up to more than the whole request
            assert overall["itl_ms"]["p99"] <= overall["e2e_ms"]["p99"]


@pytest.mark.unit
@pytest.mark.parametrize("line, field", [
    ('{"kind": "code"}', "prompt"),
    ('{"prompt": "a", "messages": [{"role": "user", "content": "b"}]}', "prompt"),
    ('{"prompt": "a", "max_tokens": 0}', "max_tokens"),
    ('{"prompt": "a", "temperature": "hot"}', "temperature"),
    ('{"messages": [{"role": "user"}]}', "messages"),
    ('{"prompt": "a", "kind": 3}', "kind"),
    ('{"prompt": "a", "n": 0}', "n"),
    ('{"prompt": "a", "n": 17}', "n"),
    ('{"prompt": "a", "n": 2.0}', "n"),
    ('{"prompt": "a", "n": true}', "n"),
])
def test_bad_jsonl_line_names_line_and_field(tmp_path, line, field):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "fine"}\n\n' + line + "\n")
    with pytest.raises(PromptFileError, match=rf"p.jsonl:3: field '{field}'"):
        load_jsonl(path)


@pytest.mark.unit
def test_bad_json_and_bench_exit_code(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("{not json\n")
    with pytest.raises(PromptFileError, match=r"p.jsonl:1: not valid JSON"):
        load_jsonl(path)
    assert specmesh_main(["bench", "--prompt-file", str(path)]) == 2


@pytest.mark.unit
def test_prompt_selection_interleaves_kinds_and_is_seeded():
    pool = [p for kind in BUILTIN.values() for p in kind]
    chosen = select_prompts(pool, 10, seed=3)
    assert [p.kind for p in chosen[:len(BUILTIN)]] == list(BUILTIN) and chosen == select_prompts(pool, 10, seed=3)
    assert chosen != select_prompts(pool, 10, seed=4)


@pytest.mark.unit
def test_percentiles_and_arrivals():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5 and percentile([5.0], 99) == 5.0
    assert percentile(list(map(float, range(101))), 95) == 95.0
    assert arrival_times(3, math.inf, 0) == [0.0, 0.0, 0.0]
    times = arrival_times(2000, 10.0, seed=1)
    assert times == arrival_times(2000, 10.0, seed=1) and times == sorted(times)
    assert 9.0 < len(times) / times[-1] < 11.0  # Poisson at 10 requests/s


class RecordingClient:
    """Answers every request at once and notes the order in which (mode, prompt index) arrived."""

    def __init__(self):
        self.sent: list[tuple[str, int]] = []

    async def send(self, item, params, record, run_start) -> None:
        self.sent.append((record.mode, record.index))
        record.ok, record.output_tokens = True, 1


@pytest.mark.unit
@pytest.mark.parametrize("concurrency, rate, interleaved", [(1, math.inf, True), (2, math.inf, False),
                                                           (1, 5.0, False)])
async def test_modes_take_turns_prompt_by_prompt_when_requests_run_one_at_a_time(concurrency, rate, interleaved):
    """At concurrency 1 with no arrival schedule the modes alternate request by request (a drifting
    machine then favours no mode); otherwise each mode runs the whole list in one go."""
    client = RecordingClient()
    prompts = BUILTIN["code"][:3]
    load = LoadSettings(max_tokens=4, request_rate=rate, seed=0, num_speculative_tokens=None, timeout_s=5.0,
                        progress=False)
    runs = await run_modes(client, prompts, Configuration(concurrency, 0.0), load, ["on", "off", "k=2"])
    if interleaved:
        assert client.sent == [(mode, i) for i in range(3) for mode in ("on", "off", "k=2")]
    else:
        assert [mode for mode, _ in client.sent] == ["on"] * 3 + ["off"] * 3 + ["k=2"] * 3
    for mode, (records, seconds) in runs.items():
        assert [r.index for r in records] == [0, 1, 2] and all(r.mode == mode for r in records)
        assert len(seconds) == 1 and seconds[0] >= 0
        assert [r.start_s for r in records] == sorted(r.start_s for r in records)


class RoundCountingPeer(RecordingClient):
    """A peer whose every request is one decode round of 10 ms of target time."""

    def __init__(self, sent: list):
        self.sent, self.parts = sent, {}

    async def send(self, item, params, record, run_start) -> None:
        await super().send(item, params, record, run_start)
        done = RoundParts(rounds=1)
        done.seconds["target_busy"] = 0.01
        self.parts[record.mode] = self.parts.get(record.mode, RoundParts()) + done

    async def round_parts(self, mode: str) -> RoundParts:
        return self.parts.get(mode, RoundParts())


@pytest.mark.unit
async def test_the_peer_takes_turns_with_the_served_modes_and_its_rounds_are_counted_by_mode():
    """The run's client sends a peer mode's requests to the peer, in turn with the served modes prompt by
    prompt; each mode gets the rounds of its own requests, and served modes without /metrics get none."""
    served = RecordingClient()
    client = RunClient(served, RoundCountingPeer(served.sent))
    load = LoadSettings(max_tokens=4, request_rate=math.inf, seed=0, num_speculative_tokens=None, timeout_s=5.0,
                        progress=False, repeats=2)
    modes = ["on", "off", "peer-off", "peer k=2"]
    await run_modes(client, BUILTIN["code"][:2], Configuration(1, 0.0), load, modes)
    assert served.sent == ([(mode, i) for i in range(2) for mode in modes]
                           + [(mode, i) for i in range(2) for mode in reversed(modes)])
    parts = client.rounds.take()
    assert set(parts) == {"peer-off", "peer k=2"} and client.rounds.take() == {}
    assert all(p.rounds == 4 and p.per_round()["target_busy_ms"] == pytest.approx(10.0) for p in parts.values())
    assert request_speculation("peer k=2", None) == (True, 2) and request_speculation("peer-off", 3) == (False, None)


@pytest.mark.unit
@pytest.mark.parametrize("concurrency", [1, 3])
async def test_repeated_passes_reverse_the_modes_order_every_other_pass(concurrency):
    """--repeats 3: on, off, then off, on, then on, off again (by prompt at concurrency 1, by whole list
    above), every record numbered with its pass and every pass timed, the suffix index emptied before each."""
    client = RecordingClient()
    prompts = BUILTIN["code"][:3]
    load = LoadSettings(max_tokens=4, request_rate=math.inf, seed=0, num_speculative_tokens=None, timeout_s=5.0,
                        progress=False, repeats=3)

    async def fresh_pass():  # where the bench empties the server's suffix index
        client.sent.append("fresh")
    runs = await run_modes(client, prompts, Configuration(concurrency, 0.0), load, ["on", "off"], fresh_pass)
    orders = [("on", "off"), ("off", "on"), ("on", "off")]
    if concurrency == 1:  # a pass is the modes' turns over every prompt
        expected = [sent for order in orders for sent in ["fresh"] + [(mode, i) for i in range(3) for mode in order]]
    else:  # a pass is one mode's whole list: no pass finds the same prompts answered by another
        expected = [sent for order in orders for mode in order for sent in ["fresh"] + [(mode, i) for i in range(3)]]
    assert client.sent == expected
    for mode, (records, seconds) in runs.items():
        assert [(r.repeat, r.index) for r in records] == [(p, i) for p in range(3) for i in range(3)]
        assert len(seconds) == 3 and all(s >= 0 for s in seconds)
        assert [r.start_s for r in records] == sorted(r.start_s for r in records)


@pytest.mark.unit
@pytest.mark.parametrize("repeats, passes", [(2, 8), (1, 7)])
async def test_min_seconds_adds_passes_two_at_a_time_up_to_the_cap(repeats, passes):
    """A configuration that never reaches --min-seconds runs pairs of passes after its --repeats (ABBA
    order kept), and stops at MAX_PASSES."""
    client = RecordingClient()
    prompts = BUILTIN["code"][:2]
    load = LoadSettings(max_tokens=4, request_rate=math.inf, seed=0, num_speculative_tokens=None, timeout_s=5.0,
                        progress=False, repeats=repeats, min_seconds=1e9)
    runs = await run_modes(client, prompts, Configuration(2, 0.0), load, ["on", "off"])
    orders = [("on", "off") if p % 2 == 0 else ("off", "on") for p in range(passes)]
    assert client.sent == [(mode, i) for order in orders for mode in order for i in range(2)]
    for records, seconds in runs.values():
        assert len(seconds) == passes and sorted({r.repeat for r in records}) == list(range(passes))


@pytest.mark.unit
def test_min_seconds_stops_adding_passes_once_every_mode_ran_that_long():
    load = LoadSettings(max_tokens=4, request_rate=math.inf, seed=0, num_speculative_tokens=None, timeout_s=5.0,
                        repeats=2, min_seconds=60.0)
    short = {"on": [20.0, 20.0], "off": [30.0, 30.0]}
    assert wants_another_pass(2, short, load)  # on has run 40 s of 60
    assert wants_another_pass(3, {"on": [20.0, 20.0, 20.0], "off": [30.0] * 3}, load)  # the pair's second pass
    assert not wants_another_pass(4, {"on": [20.0] * 4, "off": [30.0] * 4}, load)  # 80 s and 120 s: enough
    assert not wants_another_pass(2, short, replace(load, min_seconds=0.0))  # --repeats alone
    for garbage in (-60.0, math.nan):  # asks for nothing more than --repeats
        assert not wants_another_pass(2, short, replace(load, min_seconds=garbage))
    assert not wants_another_pass(MAX_PASSES, {"on": [1.0] * MAX_PASSES, "off": [1.0] * MAX_PASSES},
                                  replace(load, min_seconds=math.inf))  # the cap holds
    assert not wants_another_pass(MAX_PASSES, {"on": [1.0] * MAX_PASSES, "off": [1.0] * MAX_PASSES}, load)


class ConcurrencyClient(RecordingClient):
    """Records how many requests were in flight at once."""

    def __init__(self):
        super().__init__()
        self.in_flight = self.most_in_flight = 0

    async def send(self, item, params, record, run_start) -> None:
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        await asyncio.sleep(0)  # a yield, not a wait: the other slots start before this one ends
        await super().send(item, params, record, run_start)
        self.in_flight -= 1


@pytest.mark.unit
async def test_a_warm_up_before_a_higher_concurrency_fills_every_slot_in_both_modes():
    client = ConcurrencyClient()
    load = LoadSettings(max_tokens=32, request_rate=math.inf, seed=0, num_speculative_tokens=None, timeout_s=5.0,
                        progress=False)
    await warm_up(client, BUILTIN["code"][:3], 2, load, concurrency=5)
    assert [mode for mode, _ in client.sent] == [DEFAULT] * 5 + [OFF] * 5  # prompts reused to fill the slots
    assert client.most_in_flight == 5


async def test_a_server_that_cannot_say_what_its_replicas_run_leaves_the_peer_to_the_flags(capsys):
    """served_weights on a server without the Admin service: no weights (the peer loads as the flags
    say), said on stderr, instead of a bench that ends in a gRPC error."""
    import grpc
    from orchestrator.bench.clients import served_weights
    server = grpc.aio.server()
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        assert await served_weights(f"127.0.0.1:{port}") == {}
    finally:
        await server.stop(None)
    err = capsys.readouterr().err
    assert "could not read what the replicas run (UNIMPLEMENTED" in err and "--cpu-linear" in err
