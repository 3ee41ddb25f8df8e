"""Pre-draft pieces: branch selection, branch adoption in the draft, the time breakdown, mode choice."""

from __future__ import annotations

import argparse

import pytest
import torch

from draft_service.engine import CommitSpec, DraftEngine
from engine_helpers import commit_alone, next_logits_cached, next_logits_fresh
from harness import make_engine
from orchestrator.decoding.costs import BatchLoad, RoundCosts
from orchestrator.decoding.pipelined import Predraft, extra_branches, pipeline_enabled, separate_compute
from orchestrator.decoding.timing import RoundClock
from specmesh.engine.sampling_params import SamplingParams
from specmesh.server.service import parse_cpu_list
from specmesh.v1 import common_pb2, draft_pb2

pytestmark = pytest.mark.unit


class BranchStream:
    """Stands in for the PreDraft call: yields the given branches, then ends."""

    def __init__(self, branches: list[draft_pb2.DraftBranch]):
        self.branches = branches
        self.cancelled = False

    def __aiter__(self):
        return self._iterate()

    async def _iterate(self):
        for branch in self.branches:
            yield branch

    def cancel(self) -> None:
        self.cancelled = True


def branch(accepted: int, next_token: int, position: int, round_number: int = 4, request_id: str = "r",
           planned: tuple[tuple[int, int], ...] = ()) -> draft_pb2.DraftBranch:
    return draft_pb2.DraftBranch(request_id=request_id, round=round_number, accepted_count=accepted,
                                 next_token_id=next_token, position=position, token_ids=[7, 8],
                                 planned_accepted_counts=[a for a, _ in planned],
                                 planned_next_token_ids=[t for _, t in planned])


async def test_only_the_branch_for_the_verified_outcome_is_taken():
    # Round 4 pre-drafts after the 3 tokens at positions 10..12: all accepted + bonus 50 starts at 14.
    stream = BranchStream([
        branch(3, 50, 14, planned=((0, 60), (1, 61), (2, 62))),
        branch(0, 60, 11, round_number=3),  # a stale round
        branch(1, 61, 13),  # a wrong position for one accepted token (12)
        branch(2, 62, 13, request_id="other"),  # another session's
    ])
    ahead = Predraft(stream, 4, "r", 10, 3, extra_branches=3)
    assert (await ahead.take(3, 50, wait_s=5)).position == 14
    assert await ahead.take(3, 51, wait_s=5) is None  # the bonus guess was wrong
    assert await ahead.take(0, 60, wait_s=5) is None
    assert await ahead.take(1, 61, wait_s=5) is None
    assert await ahead.take(2, 62, wait_s=5) is None
    assert await ahead.take(2, 99, wait_s=5) is None
    ahead.stop()
    assert stream.cancelled


@pytest.mark.parametrize("temperature", [0.0, 1.0])
async def test_commit_adopts_the_matching_branch_and_drops_the_rest(tiny_llama_perturbed_dir, device, temperature):
    engine = DraftEngine(make_engine(tiny_llama_perturbed_dir, device, role_name="draft"))
    reference = DraftEngine(make_engine(tiny_llama_perturbed_dir, device, role_name="draft"))
    sampling, prompt = SamplingParams(temperature, seed=3), [5, 6, 7, 8, 9]
    for draft in (engine, reference):
        await draft.open("r", prompt, sampling)
    proposal = await engine.propose("r", 1, None, 5, 4)
    branches = [b async for b in engine.predraft("r", 2, None, 5, proposal.token_ids, 3, 2)]
    rejection = branches[1]  # the likeliest rejection, with the draft's guess of the recovered token
    accepted = proposal.token_ids[: rejection.accepted_count]
    commit = CommitSpec(5, tuple(accepted) + (rejection.next_token_id,))
    # The branch's tokens are exactly what a fresh proposal after that commit draws.
    await commit_alone(reference, "r", 1, commit)
    fresh = await reference.propose("r", 2, None, rejection.proposal.position, 3)
    assert fresh.token_ids == rejection.proposal.token_ids
    # Adopting it keeps its cache; an outcome nobody pre-drafted rolls back to a clean state.
    wanted = prompt + list(commit.token_ids) + rejection.proposal.token_ids
    await commit_alone(engine, "r", 3, CommitSpec(5, tuple(wanted[5:])))
    session = engine.engine.get("r")
    assert session.token_ids == wanted and session.cached_length == len(wanted) - 1
    assert session.ahead.branches == []
    assert torch.allclose(next_logits_cached(engine.engine, "r"), next_logits_fresh(engine.engine, wanted), atol=1e-4)
    other = CommitSpec(6, (311,))
    await commit_alone(engine, "r", 4, other)
    assert torch.allclose(next_logits_cached(engine.engine, "r"), next_logits_fresh(engine.engine, wanted[:6] + [311]),
                          atol=1e-4)


async def test_a_newer_call_interrupts_the_predraft(tiny_llama_perturbed_dir, device):
    engine = DraftEngine(make_engine(tiny_llama_perturbed_dir, device, role_name="draft"))
    await engine.open("r", [5, 6, 7], SamplingParams(0.0))
    proposal = await engine.propose("r", 1, None, 3, 3)
    branches = engine.predraft("r", 2, None, 3, proposal.token_ids, 4, 3)
    first = await anext(branches)
    assert len(first.planned) == 3
    # The verification rejected everything: the orchestrator proposes afresh for round 2.
    fresh = await engine.propose("r", 2, CommitSpec(3, (12,)), 4, 2)
    assert [b async for b in branches] == []  # the planned branches were never drafted
    assert engine.engine.get("r").token_ids == [5, 6, 7, 12] + fresh.token_ids


def test_round_clock_parts_add_up():
    clock = RoundClock()
    clock.draft_call(wall_s=0.010, forward_s=0.008)  # a wait for the pre-draft's remainder
    clock.target_call(wall_s=0.100, forward_s=0.090)
    clock.draft_behind(0.060)  # the next pre-draft ran during the verification
    parts = clock.finish(wall_s=0.115)
    assert parts.draft_busy_s == pytest.approx(0.068) and parts.target_busy_s == pytest.approx(0.090)
    assert parts.wire_s == pytest.approx(0.012) and parts.overlap_s == pytest.approx(0.060)
    busy = parts.draft_busy_s + parts.target_busy_s - parts.overlap_s
    assert parts.idle_s == pytest.approx(0.115 - busy - parts.wire_s)


def test_extra_branches_fit_in_the_drafts_idle_time():
    costs, batch = RoundCosts(), BatchLoad()
    assert extra_branches(costs, 4, batch) == 0  # nothing measured yet
    costs.observe_draft_forward(0.040, steps=4)  # 10 ms a step
    costs.observe(4, 0.040, 0.060, batch, verify_forward_s=0.060)  # the all-accepted branch (6 steps) fills it
    assert extra_branches(costs, 4, batch) == 0
    gpu = RoundCosts()
    gpu.observe_draft_forward(0.004, steps=4)  # 1 ms a step
    gpu.observe(4, 0.004, 0.020, batch, verify_forward_s=0.020)  # 20 - 6 = 14 ms idle: three more branches of 4 steps
    assert extra_branches(gpu, 4, batch) == 3


def info(host="a", device="cpu", cpus=(0, 1)) -> common_pb2.ModelInfo:
    return common_pb2.ModelInfo(host=host, device=device, cpu_affinity=cpus)


def test_pipeline_is_automatic_on_separate_compute():
    assert not separate_compute(info(), info())
    assert not separate_compute(info(cpus=(0, 1)), info(cpus=(1,)))
    assert separate_compute(info(cpus=(0,)), info(cpus=(1,)))
    assert separate_compute(info(host="a"), info(host="b"))
    assert separate_compute(info(device="cuda:0"), info(device="cpu"))
    assert not separate_compute(info(device="cuda:0"), info(device="cuda:0"))
    assert pipeline_enabled("on", info(), info()) and not pipeline_enabled("off", info(cpus=(0,)), info(cpus=(1,)))
    assert not pipeline_enabled("on", info(), None)
    with pytest.raises(ValueError):
        pipeline_enabled("sometimes", info(), info())


def test_cpu_lists():
    assert parse_cpu_list("0") == (0,) and parse_cpu_list("0,2-3") == (0, 2, 3)
    for bad in ("", "a", "3-x", "-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_cpu_list(bad)
