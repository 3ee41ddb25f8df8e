"""Nothing outlives its request: every session on every service closes when its stream ends, however it
ends (cancelled before its first token, while the draft's session is still opening in the background,
mid-round, or finished), on either CPU kernel; a draining service then finishes at once."""

from __future__ import annotations

import asyncio
import random
import threading
from types import SimpleNamespace

import grpc
import pytest

from harness import WORK_TIMEOUT_S, draft_stub, eventually, make_engine, start_stack
from orchestrator.decoding.loop import close_after
from orchestrator.serving.clients import CLOSE_ATTEMPTS, DraftClient
from specmesh.engine.closed_sessions import ClosedSessions
from specmesh.loading.cpu_linear import onednn_usable
from specmesh.server.drain import drain_of
from specmesh.errors import SessionClosed
from specmesh.engine.sampling_params import SamplingParams
from specmesh.v1 import common_pb2, draft_pb2, generation_pb2
from benchmarks.tiny_models import TINY_PROMPTS

KERNELS = ["torch", pytest.param("onednn", marks=pytest.mark.skipif(not onednn_usable("cpu"),
                                                                   reason="this torch has no oneDNN"))]
FREED_WITHIN_S = 10.0  # after the last stream ends, every service's sessions are closed by then
WAVE = 64  # streams per wave


@pytest.fixture(params=KERNELS)
async def stack(request, tiny_llama_dir, tiny_llama_perturbed_dir, device):
    if request.param == "onednn" and device != "cpu":
        pytest.skip("oneDNN linear is a CPU kernel")
    stack = await start_stack(tiny_llama_dir, tiny_llama_perturbed_dir, k=3, device=device, cpu_linear=request.param)
    yield stack
    await stack.stop()


def generate(stack, rng: random.Random, max_tokens: int = 40):
    prompt = rng.choice(TINY_PROMPTS)
    return stack.stub.Generate(generation_pb2.GenerateRequest(
        prompt=prompt, max_tokens=max_tokens, temperature=rng.choice([0.0, 0.8])), timeout=WORK_TIMEOUT_S)


async def read_then_cancel(call, responses: int) -> None:
    """Read up to `responses` responses (0: none at all), then cancel the stream if it still runs."""
    try:
        for _ in range(responses):
            if await call.read() is grpc.aio.EOF:
                return
    except grpc.aio.AioRpcError:
        return
    call.cancel()


async def wave_during_the_drafts_open(stack, rng: random.Random) -> None:
    """The draft's worker is held, so every draft session's prefill (started in the background once the
    target's first token is out) is still in flight when its stream is cancelled."""
    holding, gate = threading.Event(), threading.Event()

    def hold_the_draft() -> None:
        holding.set()
        gate.wait(WORK_TIMEOUT_S)
    held = asyncio.ensure_future(stack.draft_engine.run(hold_the_draft))
    try:
        assert await asyncio.to_thread(holding.wait, WORK_TIMEOUT_S)
        calls = [generate(stack, rng) for _ in range(WAVE)]
        await asyncio.gather(*(read_then_cancel(call, rng.choice([0, 1, 1])) for call in calls))
    finally:
        gate.set()
        await held


async def wave_at_random_points(stack, rng: random.Random) -> None:
    """Streams cancelled after 0 to 8 responses, some finishing first."""
    calls = [generate(stack, rng, max_tokens=rng.randint(4, 40)) for _ in range(WAVE)]
    await asyncio.gather(*(read_then_cancel(call, rng.randint(0, 8)) for call in calls))


async def test_streams_cancelled_at_random_points_leave_no_session_open(stack):
    rng = random.Random(39)
    for wave in (wave_during_the_drafts_open, wave_at_random_points, wave_during_the_drafts_open):
        await wave(stack, rng)
    await eventually(lambda: (len(stack.target_engine.sessions), len(stack.draft_engine.sessions)), (0, 0),
                     timeout_s=FREED_WITHIN_S)
    assert stack.draft_engine.kv.running == 0 and stack.target_engine.kv.running == 0
    for name, engine in (("draft", stack.draft_engine), ("target", stack.target_engine)):
        drain = drain_of(stack.servers[name])
        drain.begin(WORK_TIMEOUT_S)
        assert await asyncio.wait_for(drain.wait(), FREED_WITHIN_S) == 0


async def test_a_close_that_overtakes_its_open_leaves_no_session(stack):
    """The orchestrator closes a session whose open is still on its way; the service runs the close
    first: the late open is refused, and nothing stays open."""
    stub = draft_stub(stack)
    await stub.CloseSession(common_pb2.CloseSessionRequest(request_id="late/1"), timeout=WORK_TIMEOUT_S)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.OpenSession(draft_pb2.DraftOpenRequest(request_id="late/1", prompt_token_ids=[5, 6, 7]),
                               timeout=WORK_TIMEOUT_S)
    assert refused.value.code() == grpc.StatusCode.ABORTED
    assert not stack.draft_engine.sessions and stack.draft_engine.kv.running == 0


async def test_a_session_closed_while_it_waits_for_kv_room_is_refused_its_room(tiny_llama_dir, device):
    engine = make_engine(tiny_llama_dir, device, "draft")
    engine.kv.capacity = 16  # room for the first session only
    await engine.admit("first", [1] * 8, SamplingParams(), max_new_tokens=8)
    waiting = asyncio.ensure_future(engine.admit("second", [1] * 8, SamplingParams(), max_new_tokens=8))
    await eventually(lambda: engine.kv.waiting, 1)
    assert engine.close("second") is False  # not open yet: remembered
    engine.close("first")  # room for the second, which was closed meanwhile
    with pytest.raises(SessionClosed):
        await waiting
    assert not engine.sessions and engine.kv.running == 0 and engine.kv.waiting == 0


def test_the_ids_of_sessions_closed_before_they_opened_are_bounded():
    closed = ClosedSessions(max_ids=3)
    for index in range(5):
        closed.add(f"r/{index}")
    assert len(closed) == 3 and "r/1" not in closed and "r/4" in closed


async def test_the_drafts_close_waits_for_its_cancelled_open_to_end():
    """A cancelled open may take a while to end (its call unwinding); the close goes out after it."""
    events, started, unwound = [], asyncio.Event(), asyncio.Event()

    async def open_session() -> None:
        started.set()
        try:
            await asyncio.Event().wait()  # the open's call, in flight
        except asyncio.CancelledError:
            await unwound.wait()
            events.append("open ended")
            raise

    async def close(session_id: str) -> None:
        events.append(f"close {session_id}")
    opening = asyncio.ensure_future(open_session())
    await started.wait()
    opening.cancel()
    closing = asyncio.ensure_future(close_after(opening, SimpleNamespace(close=close), "r/1"))
    for _ in range(5):  # loop turns, not time: the closing task gets to run as far as it can
        await asyncio.sleep(0)
    assert events == [] and not closing.done()  # the open is still unwinding: no close yet
    unwound.set()
    await closing
    assert events == ["open ended", "close r/1"]


@pytest.mark.parametrize("code, attempts", [(grpc.StatusCode.DEADLINE_EXCEEDED, CLOSE_ATTEMPTS),
                                            (grpc.StatusCode.UNAVAILABLE, 1)])
async def test_a_close_that_times_out_is_sent_again(code, attempts):
    """A service busy with many streams ending at once may answer a close late: it is sent again (a dead
    service, UNAVAILABLE, has lost the session anyway)."""
    sent = []

    async def close_session(request, timeout):
        sent.append(request.request_id)
        raise grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata())
    async with grpc.aio.insecure_channel("127.0.0.1:1") as channel:  # never dialled: the stub is replaced
        client = DraftClient(channel)
        client.stub = SimpleNamespace(CloseSession=close_session)
        await client.close("r/1")
    assert sent == ["r/1"] * attempts
