"""Pre-drafts as parts of the draft's batch stream (ProposeBatch.predrafts): no PreDraft call per round.

Real draft servers over a tiny model. Each pre-draft sent in a batch must give the branches its PreDraft
call gives, fail alone, board the batch's step, stop listening when cancelled, and never hold a drain.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from draft_service.engine import DraftEngine
from harness import WORK_TIMEOUT_S, eventually, make_engine, start_model_server
from orchestrator.serving.clients import DraftClient, open_channel
from specmesh.engine.sampling_params import SamplingParams
from specmesh.server.drain import drain_of
from specmesh.v1 import draft_pb2, draft_pb2_grpc

PROMPT = [5, 6, 7, 8]


async def draft_server(model_dir):
    engine = make_engine(model_dir, role_name="draft")
    server, port = await start_model_server("draft", engine)
    return engine, server, open_channel(f"127.0.0.1:{port}")


def predraft_request(session: str, assumed: list[int], **fields) -> draft_pb2.PreDraftRequest:
    fields = {"round": 2, "position": len(PROMPT), "num_tokens": 3, **fields}
    return draft_pb2.PreDraftRequest(request_id=session, assumed_token_ids=assumed, **fields)


def branch_keys(branches) -> list[tuple]:
    return [(b.accepted_count, b.next_token_id, b.position, tuple(b.token_ids)) for b in branches]


async def test_a_batchs_predrafts_give_their_calls_branches_and_fail_alone(tiny_llama_perturbed_dir):
    engine, server, channel = await draft_server(tiny_llama_perturbed_dir)
    steps: list[frozenset[str]] = []
    engine.scheduler.observers.append(lambda parts, ns: steps.append(frozenset(p.session.request_id for p in parts)))
    stub = draft_pb2_grpc.DraftServiceStub(channel)
    try:
        client = DraftClient(channel)
        for session in ("a", "b", "twin"):
            await client.open(session, PROMPT, SamplingParams(0.0), timeout=WORK_TIMEOUT_S)
        assumed = [9, 10]
        call = stub.ProposeBatches(timeout=WORK_TIMEOUT_S)
        await call.write(draft_pb2.ProposeBatch(
            batch_id=4, parts=[draft_pb2.ProposeRequest(request_id="a", round=1, position=len(PROMPT), num_tokens=2)],
            predrafts=[predraft_request("b", assumed, extra_branches=1),
                       predraft_request("nobody", assumed),
                       predraft_request("twin", assumed, num_tokens=0)]))
        await call.done_writing()
        proposed, branches = {}, {0: [], 1: [], 2: []}
        async for result in call:  # the stream ends once every part has had its last answer
            assert result.batch_id == 4
            proposed.update({part.index: part for part in result.parts})
            for part in result.branches:
                assert not branches[part.index] or not branches[part.index][-1].last  # nothing after the last
                branches[part.index].append(part)
        assert list(proposed) == [0] and len(proposed[0].response.token_ids) == 2
        assert all(parts[-1].last for parts in branches.values())
        assert branches[1][-1].error.code == grpc.StatusCode.NOT_FOUND.value[0]
        assert branches[2][-1].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "num_tokens" in branches[2][-1].error.message
        got = [part.branch for part in branches[0] if part.HasField("branch")]
        # the refused pre-draft left its session whole: the same pre-draft as a call gives the same branches
        wanted = [branch async for branch in stub.PreDraft(predraft_request("twin", assumed, extra_branches=1),
                                                           timeout=WORK_TIMEOUT_S)]
        assert len(got) == 2 and branch_keys(got) == branch_keys(wanted)
        assert any({"a", "b"} <= step for step in steps)  # the pre-draft's first step drafted beside the Propose
    finally:
        await channel.close()
        await server.stop(None)


async def test_a_predraft_asked_beside_a_propose_goes_out_in_its_batch_and_a_cancelled_one_not_at_all(
        tiny_llama_perturbed_dir):
    engine, server, channel = await draft_server(tiny_llama_perturbed_dir)
    try:
        client = DraftClient(channel, round_calls="batch")
        for session in ("a", "b", "cancelled"):
            await client.open(session, PROMPT, SamplingParams(0.0), timeout=WORK_TIMEOUT_S)
        dropped = client.predraft("cancelled", 2, None, len(PROMPT), [9, 10], 3, 0, timeout=WORK_TIMEOUT_S)
        assert dropped.cancel()
        stream = client.predraft("b", 2, None, len(PROMPT), [9, 10], 3, 0, timeout=WORK_TIMEOUT_S)
        proposal = await client.propose("a", 1, None, len(PROMPT), 2, timeout=WORK_TIMEOUT_S)
        branches = [branch async for branch in stream]
        assert client.batches.batches_sent == 1
        assert len(proposal.token_ids) == 2
        assert len(branches) == 1 and branches[0].round == 2 and len(branches[0].token_ids) == 3
        assert [branch async for branch in dropped] == []
        assert engine.sessions["cancelled"].ahead.calls == 0  # the draft never heard of it
        # a pre-draft past its deadline ends as its call would
        late = client.predraft("b", 3, None, len(PROMPT), [9, 10], 3, 0, timeout=0.0)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            [branch async for branch in late]
        assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        await channel.close()
        await server.stop(None)


async def test_a_predraft_in_flight_ends_with_its_stream_and_holds_no_drain(monkeypatch, tiny_llama_perturbed_dir):
    held, release = asyncio.Event(), asyncio.Event()
    branches = DraftEngine.predraft_branches

    async def held_branches(self, *args):
        held.set()
        await release.wait()
        async for branch in branches(self, *args):
            yield branch
    monkeypatch.setattr(DraftEngine, "predraft_branches", held_branches)
    engine, server, channel = await draft_server(tiny_llama_perturbed_dir)
    try:
        client = DraftClient(channel, round_calls="batch")
        await client.open("b", PROMPT, SamplingParams(0.0), timeout=WORK_TIMEOUT_S)
        stream = client.predraft("b", 2, None, len(PROMPT), [9, 10], 3, 0, timeout=WORK_TIMEOUT_S)
        listening = asyncio.ensure_future(asyncio.wait_for(stream.__anext__(), WORK_TIMEOUT_S))
        await asyncio.wait_for(held.wait(), WORK_TIMEOUT_S)
        drain = drain_of(server)
        assert drain.in_flight == 2  # the open session and its pre-draft (not the stream's call itself)
        client.batches._stream.call.cancel()  # the stream ends under the pre-draft (its orchestrator went away)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await listening
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
        await client.close("b")  # a drain waits for open sessions too
        await eventually(lambda: drain.in_flight, 0)  # and not for a pre-draft its stream lost
    finally:
        release.set()
        await channel.close()
        await server.stop(None)
