"""The peer's figures without models: its best constant k, its own speedup, and the report's columns,
from synthetic request records."""

from __future__ import annotations

import pytest

from orchestrator.bench.app import speedup_fields
from orchestrator.bench.args import peer_ks
from orchestrator.bench.metrics import RequestRecord, aggregate, aggregate_by_kind, output_agreement, token_digest
from orchestrator.bench.report import (PEER_NOTE, concurrency_table, configuration_table, kind_table, output_lines,
                                       print_report, summary_table)
from orchestrator.bench.sweep import best_k
from orchestrator.cli.main import build_parser

pytestmark = pytest.mark.unit

# mode -> output tokens of one 1-second request per kind: the peer's k=2 is best overall (60 tokens in 2 s)
# while k=1 is best on chat, so the by-kind table must still show k=2's chat figure
TOKENS = {"on": {"code": 40, "chat": 40}, "off": {"code": 20, "chat": 20}, "peer-off": {"code": 10, "chat": 10},
          "peer k=1": {"code": 15, "chat": 30}, "peer k=2": {"code": 40, "chat": 20}}


def synthetic_modes(tokens: dict[str, dict[str, int | None]]) -> dict[str, dict]:
    """None tokens: the request failed."""
    modes = {}
    for mode, by_kind in tokens.items():
        records = [RequestRecord(kind=kind, mode=mode, index=i, ok=count is not None, e2e_ms=1000.0, ttft_ms=100.0,
                                 output_tokens=count or 0, itl_ms=[10.0, 20.0])
                   for i, (kind, count) in enumerate(by_kind.items())]
        modes[mode] = {"overall": aggregate(records, float(len(records))), "per_kind": aggregate_by_kind(records)}
    return modes


def synthetic_result(tokens: dict[str, dict[str, int]] = TOKENS) -> dict:
    modes = synthetic_modes(tokens)
    entry = {"name": "c=1 T=0", "max_concurrency": 1, "temperature": 0.0, "modes": modes, **speedup_fields(modes)}
    return {"configurations": [entry]}


def table_row(table: str, start: str) -> list[str]:
    return next(line for line in table.splitlines() if line.startswith(start)).split()


def test_best_k_is_the_fastest_smallest_on_a_tie_and_none_when_all_failed():
    assert best_k({1: 3.0, 2: 5.0, 4: 5.0, 6: None}) == 2
    assert best_k({3: None, 5: 0.0}) is None


def test_speedup_fields_compare_on_with_the_peer_at_its_best_k_and_the_peer_with_its_target_alone():
    fields = synthetic_result()["configurations"][0]
    assert fields["peer"] == {"ks": [1, 2], "best_k": 2, "best_mode": "peer k=2"}
    assert fields["speedup_on_vs_off"]["output_throughput"] == pytest.approx(2.0)  # 40 against 20 tok/s
    assert fields["speedup_on_vs_peer"]["output_throughput"] == pytest.approx(40 / 30)
    assert fields["speedup_peer_vs_peer_off"]["output_throughput"] == pytest.approx(3.0)  # 30 against 10 tok/s


def test_tables_show_the_peer_at_its_best_k_beside_its_target_alone():
    result = synthetic_result()
    entry = result["configurations"][0]
    summary = summary_table(result)
    assert table_row(summary, "c=1 T=0")[2:9] == ["40.00", "20.00", "2.00x", "30.00", "2", "3.00x", "100.0"]
    chat = table_row(kind_table(result), "c=1 T=0           chat")[2:]  # k=2's chat figure, not k=1's 30.00
    assert chat[3:] == ["40.00", "20.00", "2.00x", "20.00", "2", "10.00", "2.00x"]
    table = configuration_table(entry)
    header = table.splitlines()[1].split()
    assert header == ["metric", "spec", "on", "spec", "off", "HF", "k=2", "HF", "target-only", "on/off", "on/HF",
                      "HF/HF", "off"]
    assert table_row(table, "output tokens/s")[2:] == ["40.00", "20.00", "30.00", "10.00", "2.00x", "1.33x", "3.00x"]
    assert table.splitlines()[-1] == "HF assisted output tokens/s by constant k: k=1 22.50, k=2 30.00; best k=2"
    modes = [line[18:34].strip() for line in concurrency_table(result).splitlines()[3:]]
    assert modes == ["spec on", "spec off", "HF k=2", "HF target-only"]


@pytest.mark.parametrize("peer_ms, uneven", [(450.0, False), (380.0, False), (590.0, True), (300.0, True)])
def test_the_target_alone_is_timed_in_both_processes_and_an_uneven_host_is_named(peer_ms, uneven):
    """The peer's target alone and the target service run the same one-row step: the report gives both
    times, and calls a gap beyond the host's noise what it is, rather than a lead of either design."""
    modes = synthetic_modes(TOKENS)
    modes["off"]["round_parts"] = {"target_busy_ms": 420.0}
    modes["peer-off"]["round_parts"] = {"target_busy_ms": peer_ms}
    entry = {"name": "c=1 T=0", "max_concurrency": 1, "temperature": 0.0, "modes": modes, **speedup_fields(modes)}
    steps = entry["peer"]["target_step_ms"]
    assert steps == {"served": 420.0, "peer": peer_ms, "peer_over_served": pytest.approx(peer_ms / 420.0)}
    line = configuration_table(entry).splitlines()[-1]
    assert line.startswith(f"target alone: {peer_ms:.1f} ms a step in the peer's process, 420.0 in the target service")
    assert ("UNEVEN" in line) is uneven
    del modes["peer-off"]["round_parts"]  # no round clocks (an --endpoint without /metrics): nothing to compare
    assert "target_step_ms" not in speedup_fields(modes)["peer"]


def test_a_peer_whose_assisted_requests_all_failed_has_no_best_k_and_prints_dashes(capsys):
    tokens = {**TOKENS, "peer k=1": {"code": None, "chat": None}, "peer k=2": {"code": None, "chat": None}}
    result = synthetic_result(tokens)
    entry = result["configurations"][0]
    assert entry["peer"] == {"ks": [1, 2], "best_k": None, "best_mode": None}
    assert "speedup_on_vs_peer" not in entry and "speedup_peer_vs_peer_off" not in entry
    assert table_row(summary_table(result), "c=1 T=0")[5:8] == ["-", "-", "-"]
    print_report(result)
    out = capsys.readouterr().out
    assert "HF target-only" in out and "best -" in out and PEER_NOTE in out


def test_without_the_peer_no_peer_columns_or_note(capsys):
    result = synthetic_result({mode: TOKENS[mode] for mode in ("on", "off")})
    entry = result["configurations"][0]
    assert "peer" not in entry and "HF" not in configuration_table(entry)
    print_report(result)
    assert PEER_NOTE not in capsys.readouterr().out


@pytest.mark.parametrize("argv, ks", [([], []), (["--peer"], [4]), (["--peer-k", "5", "2", "5"], [2, 5]),
                                      (["--peer", "--peer-k", "3"], [3])])
def test_peer_ks_default_to_the_servers_k_and_peer_k_implies_the_peer(argv, ks):
    args = build_parser().parse_args(["bench", "--num-speculative-tokens", "4", *argv])
    assert peer_ks(args) == ks


def test_peer_k_outside_the_draft_limit_is_rejected(capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["bench", "--peer-k", "0"])
    assert exit_info.value.code == 2 and "argument --peer-k" in capsys.readouterr().err


def digest_records(mode: str, outputs: dict[int, list[int]]) -> list[RequestRecord]:
    return [RequestRecord(kind="code", mode=mode, index=i, output_digest=token_digest([ids]))
            for i, ids in outputs.items()]


def test_greedy_outputs_are_compared_prompt_by_prompt_across_modes():
    same = {0: [5, 6], 1: [7], 2: [9, 9]}
    records = {"off": digest_records("off", same), "on": digest_records("on", same),
               "peer k=2": digest_records("peer k=2", {**same, 1: [8]})}
    agreement = output_agreement(records, greedy={0, 1, 2})
    assert agreement == {"reference": "off", "modes": ["off", "on", "peer k=2"], "prompts": 3, "identical": False,
                         "differing_prompts": [1]}
    assert output_lines({"outputs": agreement}) == [
        "greedy outputs: DIFFER from spec off on prompts [1] (modes spec off, spec on, HF k=2)"]
    assert output_agreement(records, greedy={0, 2})["identical"]  # a sampled prompt may differ
    assert output_agreement(records, greedy=set()) is None
    assert output_agreement({"on": records["on"]}, greedy={0, 1, 2}) is None  # one mode: nothing to compare
