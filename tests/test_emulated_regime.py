"""The emulated GPU regime: step-time profiles (benchmarks/gpu_profiles.py), the set-acceptance pair's
forwards padded to them (benchmarks/modeling_set_acceptance.py), served through the real services, and
the bound a served run is held against (benchmarks/regime_bound.py). Wall times are lower bounds only:
the host is shared and noisy."""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from benchmarks.gpu_profiles import PROFILES, StepTable, from_config, scaled, to_config
from benchmarks.modeling_set_acceptance import (SetAcceptanceConfig, draft_next, emulated_step_ms, step_shape,
                                                target_next)
from benchmarks.regime_bound import E, pipelined_bound, sequential_bound
from benchmarks.set_acceptance_pair import build_pair
from harness import start_stack
from specmesh.engine.batching import Part
from specmesh.engine.ragged import Segment, ragged_forward

PROFILE = "h100-8b"
PROMPTS = ["def add(a, b):", "the quick brown fox"]
K = 4
MAX_TOKENS = 24
SLOPED = StepTable(((4, 2.0), (8, 4.0)), per_session_ms=0.5)
FLAT_TAIL = StepTable(((1, 6.0), (16, 6.0), (32, 7.0), (64, 7.0)))


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> dict[str, Path]:
    return build_pair(tmp_path_factory.mktemp("emulated-pair"), [0.8], small=True, profile=PROFILE)


def hf(path: Path, **config_overrides):
    return AutoModelForCausalLM.from_pretrained(str(path), trust_remote_code=True, **config_overrides).eval()


def timed_forward(model, token_id: int) -> float:
    """Seconds of one one-row forward."""
    with torch.inference_mode():
        started = time.perf_counter()
        model(torch.tensor([[token_id]]))  # [1, 1]
        return time.perf_counter() - started


def greedy(model, ids: list[int], pad_token_id: int) -> list[int]:
    with torch.inference_mode():
        return model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                              pad_token_id=pad_token_id)[0].tolist()


@pytest.mark.unit
def test_a_table_is_flat_before_its_first_point_linear_between_and_extended_past_its_last():
    assert SLOPED.ms(1) == SLOPED.ms(4) == 2.0
    assert SLOPED.ms(6) == pytest.approx(3.0)
    assert SLOPED.ms(16) == pytest.approx(8.0)  # the last segment's 0.5 ms/row, extended
    assert SLOPED.ms(8, sessions=3) == pytest.approx(4.0 + 2 * 0.5)
    assert FLAT_TAIL.ms(24) == pytest.approx(6.5) and FLAT_TAIL.ms(1000) == 7.0
    assert StepTable(((1, 3.0),)).ms(500, sessions=1) == 3.0


@pytest.mark.unit
def test_a_table_round_trips_through_a_config_and_refuses_nonsense():
    for table in [SLOPED, FLAT_TAIL, *(t for p in PROFILES.values() for t in (p.target, p.draft))]:
        assert from_config(to_config(table)) == table
    for points in [(), ((4, 1.0), (4, 2.0)), ((0, 1.0),), ((1, 0.0),)]:
        with pytest.raises(ValueError):
            StepTable(points)


@pytest.mark.unit
def test_the_modeling_files_interpolation_agrees_with_the_step_tables():
    tables = [SLOPED, FLAT_TAIL, StepTable(((1, 3.0),), 0.25),
              *(t for p in PROFILES.values() for t in (p.target, p.draft))]
    for table in tables:
        config = to_config(table)
        for rows in [*range(1, 300, 3), 511, 512, 513, 1023, 1024, 1025, 4096]:
            for sessions in (0, 1, 2, 7):
                assert emulated_step_ms(config, rows, sessions) == pytest.approx(table.ms(rows, sessions), abs=1e-9)


@pytest.mark.unit
def test_the_8b_drafts_step_stays_at_least_015_of_the_targets_at_every_row_count():
    profile = PROFILES[PROFILE]
    for rows in range(1, 4097):
        assert profile.draft.ms(rows) >= 0.15 * profile.target.ms(rows), rows
    assert all(profile.sources for profile in PROFILES.values())


@pytest.mark.unit
def test_the_rules_choose_the_same_tokens_on_python_ints_as_on_tensors():
    """A forward of a few rows steers them with Python ints (SCALAR_STEER_ROWS): exactly the tensors' hash."""
    config = SetAcceptanceConfig(alpha=0.8, steer_low=300, steer_high=32000, steer_seed=7)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 2**31 - 1, (4096,), generator=generator)  # the hash's whole domain
    positions = torch.randint(0, 2**31 - 1, (4096,), generator=generator)
    for rule in (target_next, draft_next):
        on_tensors = rule(tokens, positions, config).tolist()
        assert [rule(token, position, config) for token, position in zip(tokens.tolist(), positions.tolist())] == on_tensors


@pytest.mark.unit
def test_a_forwards_sessions_are_its_cached_segments_or_else_its_batch():
    ids = torch.zeros(3, 2, dtype=torch.long)  # [batch, seq]
    assert step_shape(ids, None, None) == (6, 3)
    assert step_shape(None, torch.zeros(1, 5, 8), None) == (5, 1)  # inputs_embeds [batch, seq, hidden]
    segments = [Segment(DynamicCache(), 0, 2, None), Segment(DynamicCache(), 2, 3, None), Segment(None, 5, 3, None)]
    assert step_shape(torch.zeros(1, 8, dtype=torch.long), None, segments) == (8, 2)  # padding rows count, not as a session


@pytest.mark.unit
def test_a_profiled_forward_takes_at_least_the_profiles_step_and_counts_it(pair):
    profile = PROFILES[PROFILE]
    for name, table in (("target", profile.target), ("draft-0.8", profile.draft)):
        model = hf(pair[name])
        assert model.config.step_profile == to_config(table)
        before = model.emulated_steps
        assert timed_forward(model, 300) >= table.ms(1) / 1e3
        assert model.emulated_steps == before + 1


@pytest.mark.unit
def test_padding_never_changes_the_targets_tokens(pair):
    tokenizer = AutoTokenizer.from_pretrained(str(pair["target"]))
    padded, unpadded = hf(pair["target"]), hf(pair["target"], step_profile=None)
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        assert greedy(padded, ids, tokenizer.pad_token_id) == greedy(unpadded, ids, tokenizer.pad_token_id)
    assert padded.emulated_steps >= MAX_TOKENS and unpadded.emulated_steps == 0


@pytest.mark.unit
def test_a_ragged_step_of_several_sessions_is_lean_and_steers_as_the_network_does(pair):
    """A step of several sessions (specmesh.engine.ragged) on the profiled pair skips the network's
    attention, yet each kept row gets the network's token and each session's cache grows by its rows."""
    padded, unpadded = hf(pair["target"]), hf(pair["target"], step_profile=None)
    feeds = [([300, 301, 302], 1), ([400], 1), ([500, 501], 2)]  # (new rows, kept rows) per session

    def step(model) -> tuple[list[list[int]], list[int]]:
        sessions = [type("Session", (), {"cache": DynamicCache()})() for _ in feeds]
        for session in sessions:  # a few cached positions first, so positions differ by session
            with torch.inference_mode():
                model(torch.tensor([[7, 8]]), past_key_values=session.cache, use_cache=True)
        parts = [Part(session, ids, keep) for session, (ids, keep) in zip(sessions, feeds)]
        logits = ragged_forward(model, parts, padding=2, device=torch.device("cpu"), logits_device=torch.device("cpu"))
        return [rows.argmax(-1).tolist() for rows in logits], [s.cache.get_seq_length() for s in sessions]

    layer_calls = []
    padded.model.layers[0].register_forward_hook(lambda *_: layer_calls.append(1))
    before = padded.emulated_steps
    assert step(padded) == step(unpadded)
    assert not layer_calls  # the network's layers never ran
    assert step(padded)[1] == [2 + len(ids) for ids, _ in feeds]
    assert padded.emulated_steps == before + 2 * (len(feeds) + 1)  # each session's prefill, then the ragged step


class OversleepingClock:
    """time.sleep and time.perf_counter of a host whose sleeps last 0.3 ms longer than asked."""

    def __init__(self, oversleep_s: float = 0.0003):
        self.now, self.oversleep_s = 100.0, oversleep_s

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds + self.oversleep_s


@pytest.mark.unit
def test_padded_steps_ask_for_less_sleep_as_the_host_oversleeps_and_take_the_profiles_time(pair, monkeypatch):
    model = hf(pair["draft-0.8"])
    clock = OversleepingClock()
    monkeypatch.setattr(sys.modules[type(model).__module__], "time", clock)
    steps = []
    for _ in range(100):
        started = clock.now
        model.pad_step(started, 0.001)
        steps.append(clock.now - started)
    assert steps[0] == pytest.approx(0.0013)  # nothing measured yet: the host's whole oversleep
    assert model.oversleep_s == pytest.approx(0.0003, rel=0.01)
    assert steps[-1] == pytest.approx(0.001, rel=0.01)


@pytest.mark.unit
def test_a_forward_slower_than_its_profile_is_counted_as_an_overrun_and_warned_once(pair, caplog):
    model = hf(pair["target"], step_profile={"points": [[1, 1e-6]], "per_session_ms": 0.0})  # 1 ns: always overrun
    with caplog.at_level(logging.WARNING):
        timed_forward(model, 300)
        timed_forward(model, 301)
    assert model.emulation_overruns == model.emulated_steps == 2
    assert len([r for r in caplog.records if "overrun" in r.getMessage()]) == 1


async def test_the_profiled_pair_served_gives_the_targets_greedy_output(pair):
    tokenizer = AutoTokenizer.from_pretrained(str(pair["target"]))
    target = hf(pair["target"], step_profile=None)
    expected = [greedy(target, tokenizer.encode(prompt), tokenizer.pad_token_id) for prompt in PROMPTS]
    stack = await start_stack(pair["target"], pair["draft-0.8"], k=K, trust_remote_code=True)
    try:
        for prompt, sequence in zip(PROMPTS, expected):
            tokens, _, _ = await stack.generate(prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0)
            assert tokens == sequence[len(tokenizer.encode(prompt)):]
    finally:
        await stack.stop()
    assert stack.target_engine.model.emulated_steps > 0 and stack.draft_engine.model.emulated_steps > 0


@pytest.mark.unit
def test_expected_tokens_per_round():
    assert E(0.8, 4) == pytest.approx(3.3616)
    assert E(1.0, 4) == 5.0 and E(0.0, 7) == 1.0


@pytest.mark.unit
def test_the_bounds_reproduce_the_worked_example():
    """regime-bound.md: t(r <= 16) = 6 ms, d = 1 ms, alpha 0.8, no links."""
    t = lambda rows: 0.006  # noqa: E731
    speedup, k = sequential_bound(0.8, t, 0.001, 0.0, 0.0)
    assert (round(speedup, 2), k) == (2.02, 4)  # k = 5 gives 2.01: "2.0x at k = 4-5"
    speedup, k = pipelined_bound(0.8, t, 0.001, 0.0, 0.0, hit=1.0)
    assert (round(speedup, 2), k) == (3.95, 6) and speedup == pytest.approx(E(0.8, 6))
    speedup, k = pipelined_bound(0.8, t, 0.001, 0.0, 0.0, hit=0.5)
    assert (round(speedup, 2), k) == (2.63, 6)
    assert pipelined_bound(0.8, t, 0.001, 0.0, 0.0, hit=0.0) == sequential_bound(0.8, t, 0.001, 0.0, 0.0)


@pytest.mark.unit
def test_links_lower_the_bounds_and_the_profiles_give_the_cited_speedups():
    t = lambda rows: 0.006  # noqa: E731
    assert sequential_bound(0.8, t, 0.001, 0.002, 0.002)[0] < sequential_bound(0.8, t, 0.001, 0.0, 0.0)[0]
    assert pipelined_bound(0.8, t, 0.001, 0.014, 0.0, hit=1.0)[0] < pipelined_bound(0.8, t, 0.001, 0.0, 0.0, hit=1.0)[0]
    for name, alpha, expected in (("h100-8b", 0.8, 2.02), ("h100x8-70b", 0.7, 1.85)):
        profile = PROFILES[name]
        speedup, _ = sequential_bound(alpha, lambda rows: profile.target.ms(rows) / 1e3, profile.draft.ms(1) / 1e3,
                                      0.0, 0.0)
        assert round(speedup, 2) == expected, name


@pytest.mark.unit
def test_a_scaled_profile_stretches_every_time_and_leaves_the_bound_as_it_was():
    """gpu_profiles.scaled: a host too slow for the profile's shortest step runs the same GPU slower; step
    times and link delays stretched alike, the speedup bound (a ratio) does not move."""
    profile, scale = PROFILES["h100-8b"], 1.5
    target, draft = scaled(profile.target, scale), scaled(profile.draft, scale)
    assert target.ms(1) == pytest.approx(profile.target.ms(1) * scale)
    assert target.ms(300, sessions=4) == pytest.approx(profile.target.ms(300, sessions=4) * scale)

    def bound(table, draft_table, factor):
        return pipelined_bound(0.8, lambda rows: table.ms(rows) / 1e3, draft_table.ms(1) / 1e3, 0.005 * factor,
                               0.0, hit=0.7)
    assert bound(target, draft, scale) == pytest.approx(bound(profile.target, profile.draft, 1.0))
    with pytest.raises(ValueError):
        scaled(profile.target, 0.0)


@pytest.mark.unit
def test_target_only_is_in_the_bound_with_what_its_placement_costs():
    """k = 0 is the round trip-free choice beside the target (1x) and one target round trip a token beside
    the draft: a link so slow that no draft pays leaves the bound at target-only through the placement."""
    t = lambda rows: 0.006  # noqa: E731
    assert sequential_bound(0.8, t, 0.001, 0.020, 0.0) == (1.0, 0)  # beside the target
    assert pipelined_bound(0.8, t, 0.001, 0.040, 0.0, hit=0.5) == (1.0, 0)
    speedup, k = sequential_bound(0.8, t, 0.001, 0.0, 0.020)  # beside the draft: every round pays 20 ms
    assert k > 0 and 0.006 / 0.026 < speedup < 1.0
