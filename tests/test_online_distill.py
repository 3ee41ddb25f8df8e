"""Online distillation while serving: evidence kept bounded, cycles judged by distill's verdict,
rolled out through the ordinary rollout, rolled back when live acceptance falls.

The first tests drive the online loop over a stand-in for the pools (the rollout is a call
recorded), with cycles whose result the test decides. The last three share one real local
deployment (child processes, a real `specmesh distill` child) started with a draft unrelated
to the target, and run in file order: a cycle that raises live acceptance, a crashed and an
overrun cycle that serving does not notice, and a rollback after an injected fall.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from harness import eventually, load
from orchestrator.decoding.request import LoopConfig
from orchestrator.distill.online_cycle import CycleResult, DistillJob, distill_command, result_of
from orchestrator.distill.online import MAX_CONTINUATION, OnlineDistiller, OnlineDistillOptions, continuation_args
from orchestrator.distill.online_evidence import EvidenceStore, served_length
from orchestrator.control.options import RestartPolicy
from orchestrator.serving.pool import PoolSpec
from orchestrator.control.pools import Pools
from orchestrator.control.options import PoolsOptions
from orchestrator.control.build import servicer_over_pools
from orchestrator.distill.examples import load_examples
from parity import target_greedy
from pools import RESTART_WAIT_S
from specmesh.server.metrics import OrchestratorMetrics
from specmesh.server.service import ReplicaConfig, ServiceOptions
from specmesh.v1 import generation_pb2
from workloads import word_prompts

CYCLE_WAIT_S = 600.0  # a distill child and a new draft replica start on a shared 2-core machine
K = 4
MAX_TOKENS = 16
# The flags that raised this pair's held-out acceptance in tests/test_distill.py's `distilled`, fewer steps.
TRAFFIC = 80  # prompts served before the first cycle: 52 train, 8 validate, 20 held out
FAST_DISTILL = ("--lora-rank", "16", "--learning-rate", "1e-2", "--steps", "40", "--batch-size", "32",
                "--max-new-tokens", "16", "--held-out-fraction", "0.25", "--k", str(K))


# ---- the evidence store

@pytest.mark.unit
def test_evidence_is_bounded_on_disk_and_drops_the_oldest_first(tmp_path):
    store = EvidenceStore(tmp_path, max_bytes=800, sample=1.0)
    for n in range(200):
        assert store.add([n, n + 1, n + 2])
    files = list(tmp_path.glob("segment-*.jsonl"))
    assert sum(f.stat().st_size for f in files) <= 800 and store.bytes <= 800
    store.snapshot(tmp_path / "prompts.jsonl")
    kept = [json.loads(line)["prompt_token_ids"] for line in (tmp_path / "prompts.jsonl").read_text().splitlines()]
    assert kept[-1] == [199, 200, 201] and [0, 1, 2] not in kept and len(kept) == store.prompts
    reopened = EvidenceStore(tmp_path, max_bytes=800, sample=1.0)  # a restart keeps the evidence
    assert reopened.prompts == store.prompts
    assert not EvidenceStore(tmp_path / "none", 800, sample=0.0).add([1, 2])


@pytest.mark.unit
def test_logged_rejection_contexts_join_the_evidence_once(tmp_path):
    log_path = tmp_path / "disagreements.jsonl"
    seen = {"context_hash": "a", "context_token_ids": [5, 6, 7]}
    records = [seen, seen, {"context_hash": "b"}]  # the same context twice, and one without ids
    log_path.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"context_hash": "c", "cont')
    store = EvidenceStore(tmp_path / "evidence", max_bytes=10_000, sample=0.0)
    assert store.add_disagreements(log_path) == 1 and store.prompts == 1
    assert store.add_disagreements(log_path) == 0  # read from where it stopped; the half line waits


@pytest.mark.unit
def test_evidence_keeps_each_served_completions_length_beside_its_prompt(tmp_path):
    store = EvidenceStore(tmp_path / "evidence", max_bytes=10_000, sample=1.0)
    for n in range(1, 11):
        assert store.add([7, n], completion_tokens=n)
    store.add([8, 8], sampled=False)  # a logged rejection context: nothing was served for it
    store.snapshot(tmp_path / "prompts.jsonl")
    assert served_length(tmp_path / "prompts.jsonl") == 9  # the 90th percentile of 1..10
    examples = load_examples(tmp_path / "prompts.jsonl", tokenizer=None, max_prompt_tokens=256)
    assert [e.prompt_token_ids for e in examples] == [(7, n) for n in range(1, 11)] + [(8, 8)]
    (tmp_path / "old.jsonl").write_text('{"prompt_token_ids":[1,2]}\n')  # a store from before lengths
    assert served_length(tmp_path / "old.jsonl") is None


# ---- the loop over a stand-in for the pools

class StandInPools:
    """What the online loop uses of orchestrator.control.pools.Pools; a rollout is a recorded call."""

    def __init__(self, draft: str):
        spec = lambda model, log=None: SimpleNamespace(spec=SimpleNamespace(replica=SimpleNamespace(  # noqa: E731
            service=SimpleNamespace(model=model), disagreement_log=log)))
        self.controllers = {"target": spec("target-model"), "draft": spec(draft)}
        self.options = SimpleNamespace(backend="local")
        self.rollouts: list[str] = []

    async def replace_model(self, role: str, model: str):
        self.rollouts.append(model)
        self.controllers[role].spec.replica.service.model = model


def candidate(improved: bool, code: int):
    """A runner standing in for `specmesh distill`: writes a candidate and its report, exits with `code`."""
    async def run(job: DistillJob) -> CycleResult:
        assert job.prompts.read_text().count("prompt_token_ids") >= 3
        job.output.mkdir()
        (job.output / "model.safetensors").write_bytes(b"weights")
        stats = lambda rate: {"tokens_per_round": 1 + rate, "acceptance_rate": rate}  # noqa: E731
        job.report.write_text(json.dumps({
            "improved": improved, "before": stats(0.5), "after": stats(0.6 if improved else 0.3),
            "tokens_per_round_relative_change": 0.067 if improved else -0.13, "settings": {"k": 4},
            "train_prompts": 3, "validation_prompts": 1, "held_out_prompts": 1}))
        return result_of(job, code, 10.0)
    return run


async def stand_in_distiller(tmp_path, runner, **options) -> tuple[OnlineDistiller, StandInPools, OrchestratorMetrics]:
    pools, metrics = StandInPools("original-draft"), OrchestratorMetrics()
    options = OnlineDistillOptions(directory=tmp_path, tokens=10, interval_s=0.0, min_prompts=3, poll_s=0.01,
                                   **options)
    distiller = OnlineDistiller(pools, options, metrics, runner=runner)
    for n in range(4):
        distiller.served([1, 2, n], completion_tokens=5)
    return distiller, pools, metrics


def count(metrics: OrchestratorMetrics, name: str, **labels) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


@pytest.mark.unit
@pytest.mark.parametrize("improved, code", [(False, 3), (False, 0), (True, 2)])
async def test_a_candidate_that_does_not_beat_the_draft_is_never_rolled_out(tmp_path, caplog, improved, code):
    """distill's NO GAIN (exit 3), a report that says no gain whatever the status, and a crash after a report."""
    distiller, pools, metrics = await stand_in_distiller(tmp_path, candidate(improved, code))
    distiller.start()
    with caplog.at_level(logging.INFO):
        await eventually(lambda: len(distiller.outcomes), 1)
        await distiller.stop()
    outcome = "failed" if code == 2 else "no_gain"
    assert distiller.outcomes == [outcome] and pools.rollouts == []
    assert count(metrics, "specmesh_online_distill_cycles_total", outcome=outcome) == 1
    assert not (tmp_path / "drafts" / "v1").exists()  # the candidate is gone
    assert any(f"cycle v1: {outcome}" in r.message for r in caplog.records)
    if code == 3:
        assert metrics.registry.get_sample_value("specmesh_online_distill_last_gain") == pytest.approx(-0.13)
        assert "tokens per round 1.500 -> 1.300" in caplog.text


@pytest.mark.unit
async def test_the_running_gauge_reads_1_while_a_cycle_runs_and_0_after(tmp_path):
    running = []

    async def recorded(job: DistillJob) -> CycleResult:
        running.append(metrics.registry.get_sample_value("specmesh_online_distill_cycle_running"))
        return await candidate(False, 3)(job)
    distiller, _, metrics = await stand_in_distiller(tmp_path, recorded)
    distiller.start()
    await eventually(lambda: distiller.outcomes, ["no_gain"])
    await distiller.stop()
    assert running == [1.0] and metrics.registry.get_sample_value("specmesh_online_distill_cycle_running") == 0


@pytest.mark.unit
@pytest.mark.parametrize("flags, expected", [
    ((), ("--max-new-tokens", "5")),  # as long as what was served
    (("--steps", "9"), ("--steps", "9", "--max-new-tokens", "5")),
    (("--max-new-tokens", "7"), ("--max-new-tokens", "7")),  # the operator's choice stands
    (("--max-new-tokens=7",), ("--max-new-tokens=7",)),
])
async def test_a_cycle_trains_on_continuations_as_long_as_the_served_ones(tmp_path, flags, expected):
    jobs = []

    async def recorded(job: DistillJob) -> CycleResult:
        jobs.append(job)
        return await candidate(False, 3)(job)
    distiller, _, _ = await stand_in_distiller(tmp_path, recorded, distill_args=flags)  # 4 served, 5 tokens each
    distiller.start()
    await eventually(lambda: distiller.outcomes, ["no_gain"])
    await distiller.stop()
    assert jobs[0].extra_args == expected
    assert continuation_args((), 100_000) == ("--max-new-tokens", str(MAX_CONTINUATION))
    assert continuation_args(("--k", "3"), None) == ("--k", "3")


def inject_rounds(metrics: OrchestratorMetrics, model: str, rounds: int, drafted: int, accepted: int) -> None:
    metrics.draft_model_rounds.labels(draft_model=model).inc(rounds)
    metrics.draft_model_draft_tokens.labels(draft_model=model).inc(drafted)
    metrics.draft_model_accepted_tokens.labels(draft_model=model).inc(accepted)


@pytest.mark.unit
@pytest.mark.parametrize("accepted, rolled_back", [(300, False), (100, True)])
async def test_a_rollout_whose_live_acceptance_falls_is_rolled_back(tmp_path, accepted, rolled_back):
    distiller, pools, metrics = await stand_in_distiller(tmp_path, candidate(True, 0), rollback_window=50)
    inject_rounds(metrics, "original-draft", 100, 400, 200)  # the draft before: 0.5
    distiller.start()
    await eventually(lambda: distiller.outcomes, ["rolled_out"])
    new = str(tmp_path / "drafts" / "v1")
    assert pools.rollouts == [new] and metrics.registry.get_sample_value(
        "specmesh_online_distill_draft_version") == 1
    inject_rounds(metrics, new, 50, 400, accepted)  # 0.75 or 0.25 over one window
    if rolled_back:
        await eventually(lambda: pools.rollouts, [new, "original-draft"])
        await eventually(lambda: count(metrics, "specmesh_online_distill_rollbacks_total"), 1.0)
        assert metrics.registry.get_sample_value("specmesh_online_distill_draft_version") == 0
    else:
        await eventually(lambda: distiller.watch.since[0], 50.0)  # judged: the next window starts
        assert pools.rollouts == [new]
    await distiller.stop()


# ---- a real deployment

@pytest.fixture(scope="module")
async def deployment(tmp_path_factory, tiny_llama_dir, tiny_llama_unrelated_dir):
    online = OnlineDistillOptions(directory=tmp_path_factory.mktemp("online"), tokens=1, interval_s=0.0,
                                  min_prompts=TRAFFIC, poll_s=0.1, distill_args=FAST_DISTILL,
                                  rollback_window=10 ** 9, timeout_s=CYCLE_WAIT_S)
    service = lambda model: ServiceOptions(model=str(model), shutdown_grace_s=1.0)  # noqa: E731
    options = PoolsOptions(backend="local", target=PoolSpec(ReplicaConfig("target", service(tiny_llama_dir))),
                           draft=PoolSpec(ReplicaConfig("draft", service(tiny_llama_unrelated_dir)), drain_grace_s=1.0),
                           check_interval_s=0.1, acquire_timeout_s=RESTART_WAIT_S,
                           restart_policy=RestartPolicy(initial_backoff_s=0.05), online_distill=online)
    metrics = OrchestratorMetrics()
    pools = Pools.from_options(options, metrics=metrics)
    _, tokenizer = load(str(tiny_llama_dir), "cpu")
    servicer = await servicer_over_pools(tokenizer, pools, LoopConfig(num_speculative_tokens=K))
    yield SimpleNamespace(pools=pools, servicer=servicer, metrics=metrics, online=pools.online)
    await pools.stop()


async def generate(deployment, prompt: str) -> tuple[list[int], generation_pb2.GenerationStats]:
    request = generation_pb2.GenerateRequest(prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                                             num_speculative_tokens=K)
    tokens, last = [], None
    async for response in deployment.servicer.generate(request):
        tokens.extend(response.token_ids)
        last = response
    return tokens, last.stats


async def drive(deployment, prompts: list[str], target_dir: Path, concurrency: int = 16) -> float:
    """Serve every prompt (none may fail), check each output is the target's own; the acceptance rate."""
    results = []
    for start in range(0, len(prompts), concurrency):
        batch = prompts[start:start + concurrency]
        results += await asyncio.gather(*(generate(deployment, p) for p in batch))
    for prompt, (tokens, _) in zip(prompts, results):
        assert tuple(tokens) == target_greedy(str(target_dir), "cpu", prompt, MAX_TOKENS), prompt
    drafted = sum(stats.draft_tokens for _, stats in results)
    assert drafted > 0
    return sum(stats.accepted_tokens for _, stats in results) / drafted


def draft_model(deployment) -> str:
    return deployment.pools.state("draft").model


async def test_a_cycle_rolls_out_a_better_draft_and_live_acceptance_rises(deployment, tiny_llama_dir, caplog):
    before = await drive(deployment, word_prompts(TRAFFIC, seed=11), tiny_llama_dir)
    online = deployment.online
    await eventually(lambda: online.cycle is not None, True)  # started by the tokens served
    online.options = replace(online.options, tokens=10 ** 9)  # the next cycles only when a test asks
    with caplog.at_level(logging.INFO):
        await eventually(lambda: deployment.online.outcomes, ["rolled_out"], timeout_s=CYCLE_WAIT_S)
    assert draft_model(deployment) == str(deployment.online.drafts / "v1")  # `specmesh replicas` names the version
    after = await drive(deployment, word_prompts(32, seed=12), tiny_llama_dir)
    assert after >= 1.2 * before and after > before + 0.05, (before, after)
    metrics = deployment.metrics.registry.get_sample_value
    assert metrics("specmesh_online_distill_cycles_total", {"outcome": "rolled_out"}) == 1
    assert metrics("specmesh_online_distill_draft_version") == 1 and metrics("specmesh_online_distill_last_gain") > 0
    assert "online distillation cycle v1: rolled_out; held-out at k = 4: tokens per round" in caplog.text


@pytest.mark.parametrize("case", ["crash", "deadline"])
async def test_a_failed_cycle_is_counted_and_logged_and_serving_goes_on(deployment, tiny_llama_dir, caplog, case):
    online = deployment.online
    flags = ("--no-such-flag",) if case == "crash" else FAST_DISTILL
    online.options = replace(online.options, distill_args=flags, timeout_s=0.5 if case == "deadline" else 60.0)
    outcome = {"crash": "failed", "deadline": "timed_out"}[case]
    with caplog.at_level(logging.INFO):
        online.run_now()
        served = asyncio.ensure_future(drive(deployment, word_prompts(16, seed=13), tiny_llama_dir))
        await eventually(lambda: online.outcomes[-1], outcome, timeout_s=CYCLE_WAIT_S)
        await served  # every request during the cycle succeeded with the target's output
    assert deployment.metrics.registry.get_sample_value("specmesh_online_distill_cycles_total",
                                                        {"outcome": outcome}) == 1
    assert re.search(f"cycle v[23]: {outcome}", caplog.text) and draft_model(deployment) == str(online.drafts / "v1")


async def test_a_real_cycle_without_gain_rolls_nothing_out(deployment, tiny_llama_dir, caplog):
    """distill itself says NO GAIN (exit 3): training that cannot move the weights matches the draft at best."""
    online = deployment.online
    frozen = ("--lora-rank", "16", "--learning-rate", "1e-12", "--steps", "1", "--max-new-tokens", "16",
              "--held-out-fraction", "0.25", "--k", str(K))
    online.options = replace(online.options, distill_args=frozen, timeout_s=CYCLE_WAIT_S)
    cycles = len(online.outcomes)
    with caplog.at_level(logging.INFO):
        online.run_now()
        await eventually(lambda: online.outcomes[cycles:], ["no_gain"], timeout_s=CYCLE_WAIT_S)
    assert draft_model(deployment) == str(online.drafts / "v1") and sorted(online.drafts.iterdir()) == [
        online.drafts / "v1"]  # no candidate left behind
    assert re.search(r"cycle v\d+: no_gain; held-out at k = 4: tokens per round (\S+) -> \1 \(\+0\.0%\)", caplog.text)
    await drive(deployment, word_prompts(8, seed=15), tiny_llama_dir)


async def test_a_fall_in_live_acceptance_rolls_the_previous_draft_back(deployment, tiny_llama_dir,
                                                                       tiny_llama_unrelated_dir):
    online, metrics = deployment.online, deployment.metrics
    assert online.watch is not None and online.watch.baseline > 0
    online.options = replace(online.options, rollback_window=50)
    inject_rounds(metrics, online.watch.model, rounds=50, drafted=10 ** 7, accepted=0)  # the fall
    await eventually(lambda: metrics.registry.get_sample_value("specmesh_online_distill_rollbacks_total"), 1.0,
                     timeout_s=CYCLE_WAIT_S)
    assert draft_model(deployment) == str(tiny_llama_unrelated_dir)
    assert metrics.registry.get_sample_value("specmesh_online_distill_draft_version") == 0
    await drive(deployment, word_prompts(8, seed=14), tiny_llama_dir)


def test_the_distill_child_refuses_a_bad_flag_before_it_loads_torch(tmp_path):
    """The child runs at nice 19: on a busy node, torch's import first would leave a bad flag unreported for minutes."""
    command = distill_command(DistillJob("target", "draft", tmp_path / "p.jsonl", tmp_path / "v1", tmp_path / "r.json",
                                         tmp_path / "distill.log", extra_args=("--no-such-flag",)))
    module = command.index("-m") + 1
    probe = ("import runpy, sys\n"
             "try:\n"
             f"    runpy.run_module({command[module]!r}, run_name='__main__')\n"
             "finally:\n"
             "    print('torch loaded' if 'torch' in sys.modules else 'no torch', file=sys.stderr)\n")
    done = subprocess.run([sys.executable, "-c", probe, *command[module + 1:]], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1], timeout=120)
    assert done.returncode == 2 and "--no-such-flag" in done.stderr, done.stderr
    assert done.stderr.rstrip().endswith("no torch"), done.stderr
