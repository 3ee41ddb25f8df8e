"""A session's rounds as messages on one bidirectional stream per service (LoopConfig.round_calls "stream",
the default).

Real servers on 127.0.0.1:0 and the orchestrator's own clients: the stream answers each message as the
unary call answers it, keeps one stream for a session's rounds, and drops it (the next round opens
another) on a failed message, a missed deadline or a cancelled caller; the loop stays lossless on it.
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from harness import TargetHold, load, make_engine, start_model_server, start_stack
from orchestrator.decoding.request import LoopConfig
from orchestrator.control.build import OrchestratorOptions, connect_backends
from orchestrator.serving.clients import TargetClient, UpstreamError, open_channel
from orchestrator.serving.round_streams import broken_as_unavailable
from parity import MAX_TOKENS, greedy_outputs_then_stop, target_greedy
from specmesh.server.drain import drain_of
from specmesh.server.grpc_server import INTERNAL_DETAILS_PREFIX
from specmesh.engine.sampling_params import SamplingParams
from specmesh.server.security import token_interceptors
from specmesh.server.telemetry import VERIFY_ROUNDS
from specmesh.v1 import target_pb2
from target_service.server import create_server
from benchmarks.tiny_models import TINY_PROMPTS

GREEDY = SamplingParams(temperature=0.0)
PROMPT_IDS = list(range(10, 30))


class CountedOpens:
    """The client's way of opening a round stream, counting the streams it opens."""

    def __init__(self, client):
        self.opened, self._open = 0, client._open_stream
        client._open_stream = self

    def __call__(self):
        self.opened += 1
        return self._open()


@contextlib.asynccontextmanager
async def served_target(engine, **config):
    """A target server over `engine` on 127.0.0.1:0 and a channel to it: yields (server, channel, address);
    the channel is closed and the server stopped after."""
    server, port = await start_model_server("target", engine, **config)
    address = f"127.0.0.1:{port}"
    channel = open_channel(address)
    try:
        yield server, channel, address
    finally:
        await channel.close()
        await server.stop(None)


async def verify_rounds(client: TargetClient, request_id: str, rounds: int) -> list[target_pb2.VerifyResponse]:
    """Open a session and verify `rounds` rounds of two draft tokens each (the same tokens every time)."""
    opened = await client.open(request_id, PROMPT_IDS, GREEDY, timeout=30)
    position, responses = opened.committed_length, []
    for number in range(1, rounds + 1):
        response = await client.verify(request_id, number, position, [5, 6], [], timeout=30)
        responses.append(response)
        position = response.committed_length
    return responses


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("target_name, draft_name", [("tiny_llama_dir", "tiny_llama_perturbed_dir"),
                                                     ("tiny_qwen2_dir", "tiny_qwen2_draft_dir")])
async def test_greedy_output_over_unary_round_calls_is_the_targets_own(request, device, k, target_name, draft_name):
    """Round streams are the default (test_greedy_parity runs on them); the unary calls stay lossless too."""
    target_dir = str(request.getfixturevalue(target_name))
    stack = await start_stack(target_dir, request.getfixturevalue(draft_name), k=k, device=device,
                              loop_options=dict(round_calls="unary"))
    results = await greedy_outputs_then_stop(stack)
    for prompt, (token_ids, _, last) in zip(TINY_PROMPTS, results):
        assert tuple(token_ids) == target_greedy(target_dir, device, prompt, MAX_TOKENS), prompt
        assert last.stats.draft_tokens > 0 and not last.stats.draft_fallback


@pytest.mark.parametrize("round_calls", ["unary", "stream", "batch"])
async def test_the_orchestrators_clients_take_the_configured_round_calls(tiny_llama_dir, round_calls):
    draft, draft_port = await start_model_server("draft", make_engine(tiny_llama_dir, role_name="draft"))
    _, tokenizer = load(str(tiny_llama_dir), "cpu")
    try:
        async with served_target(make_engine(tiny_llama_dir)) as (_, _, target_address):
            backends = await connect_backends(tokenizer, OrchestratorOptions(
                target_address, f"127.0.0.1:{draft_port}", LoopConfig(round_calls=round_calls)))
            assert backends.target.round_calls == backends.draft.round_calls == round_calls
    finally:
        await draft.stop(None)


async def test_a_sessions_rounds_share_one_stream_and_are_answered_as_unary_calls(tiny_llama_dir):
    async with served_target(make_engine(tiny_llama_dir)) as (_, channel, _):
        streamed, unary = TargetClient(channel, round_calls="stream"), TargetClient(channel)
        opens = CountedOpens(streamed)
        by_stream = await verify_rounds(streamed, "streamed", 6)
        by_calls = await verify_rounds(unary, "unary", 6)
        assert opens.opened == 1
        assert [(r.accepted_count, r.next_token_id, r.committed_length) for r in by_stream] == \
            [(r.accepted_count, r.next_token_id, r.committed_length) for r in by_calls]
        await streamed.close("streamed")
        assert "streamed" not in streamed._streams
        await verify_rounds(streamed, "again", 1)  # a new session, a new stream
        assert opens.opened == 2


async def test_a_failed_message_ends_its_stream_only_and_the_next_round_opens_another(tiny_llama_dir):
    async with served_target(make_engine(tiny_llama_dir)) as (_, channel, _):
        client, bystander = TargetClient(channel, round_calls="stream"), TargetClient(channel, round_calls="stream")
        opens = CountedOpens(client)
        seen = (await verify_rounds(bystander, "bystander", 1))[0]
        opened = await client.open("bad", PROMPT_IDS, GREEDY, timeout=30)
        with pytest.raises(UpstreamError) as refused:  # a position that is not the committed length
            await client.verify("bad", 1, opened.committed_length + 3, [5], [], timeout=30)
        assert refused.value.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)
        assert "position" in str(refused.value) and "bad" not in client._streams
        good = await client.verify("bad", 2, opened.committed_length, [5], [], timeout=30)  # a new stream
        assert good.committed_length > opened.committed_length and opens.opened == 2
        after = await bystander.verify("bystander", 2, seen.committed_length, [5], [], timeout=30)  # its stream
        assert after.committed_length > seen.committed_length


async def test_undecodable_bytes_on_a_stream_are_invalid_argument_and_the_server_stays_up(tiny_llama_dir):
    async with served_target(make_engine(tiny_llama_dir)) as (_, channel, _):
        raw = channel.stream_stream(VERIFY_ROUNDS, request_serializer=lambda b: b, response_deserializer=lambda b: b)
        call = raw()
        await call.write(b"\x0a\x02\xff\xfe")  # request_id (field 1): invalid UTF-8
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call.read()
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in refused.value.details()
        assert len(await verify_rounds(TargetClient(channel, round_calls="stream"), "after", 2)) == 2


async def committed_length(engine, request_id: str) -> int:
    """The session's committed length once its earlier jobs (a held or abandoned verification) have run."""
    session = engine.sessions[request_id]
    return await engine.run(lambda: len(session.token_ids), session=session)


@contextlib.asynccontextmanager
async def held_verification(model_dir, request_id: str, timeout: float):
    """A streamed client whose session's first verification is held in the engine: yields (client, the
    verification's task, its hold, the engine, the client's stream opens)."""
    engine = make_engine(model_dir)
    async with served_target(engine) as (_, channel, _):
        client = TargetClient(channel, round_calls="stream")
        opens = CountedOpens(client)
        hold = TargetHold(engine)  # the open's prefill runs; the verification after it is held
        opened = await client.open(request_id, PROMPT_IDS, GREEDY, timeout=30)
        verifying = asyncio.ensure_future(client.verify(request_id, 1, opened.committed_length, [5], [], timeout))
        await hold.wait_held()  # the message is on the server, its answer still to come
        yield client, verifying, hold, engine, opens


async def test_a_message_past_its_deadline_raises_deadline_exceeded_and_drops_the_stream(tiny_llama_dir):
    async with held_verification(tiny_llama_dir, "held", timeout=1.0) as (client, waiting, hold, engine, opens):
        with pytest.raises(UpstreamError) as late:
            await waiting
        assert late.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and "held" not in client._streams
        hold.release()
        position = await committed_length(engine, "held")  # the abandoned round may have committed, as a call's may
        after = await client.verify("held", 2, position, [5], [], timeout=30)
        assert after.round == 2 and after.committed_length > position and opens.opened == 2  # on a new stream


async def test_a_draining_target_serves_its_sessions_streams_until_they_close(tiny_llama_dir):
    async with served_target(make_engine(tiny_llama_dir)) as (server, channel, _):
        client = TargetClient(channel, round_calls="stream")
        first = (await verify_rounds(client, "held", 1))[0]
        drain = drain_of(server)
        drain.begin(grace_s=60)
        assert drain.in_flight == 2  # the session's open stream, and the session (a model service holds its sessions)
        second = await client.verify("held", 2, first.committed_length, [5], [], timeout=30)
        assert second.committed_length > first.committed_length
        with pytest.raises(UpstreamError) as refused:  # new sessions go elsewhere
            await client.open("new", PROMPT_IDS, GREEDY, timeout=30)
        assert refused.value.code == grpc.StatusCode.UNAVAILABLE
        await client.close("held")
        assert await asyncio.wait_for(drain.wait(), 30) == 0


async def test_each_message_has_a_client_and_a_server_span_across_the_stream(tiny_llama_dir):
    exported = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exported))
    server, port, _ = await create_server(make_engine(tiny_llama_dir), tracer_provider=provider)
    channel = open_channel(f"127.0.0.1:{port}")
    try:
        await verify_rounds(TargetClient(channel, round_calls="stream", tracer_provider=provider), "traced", 3)
    finally:
        await channel.close()
        await server.stop(None)
    spans = [span for span in exported.get_finished_spans() if span.name == VERIFY_ROUNDS]
    clients = {span.context.span_id: span for span in spans if span.kind == SpanKind.CLIENT}
    servers = [span for span in spans if span.kind == SpanKind.SERVER]
    assert sorted(span.attributes["specmesh.round"] for span in clients.values()) == [1, 2, 3]
    assert len(servers) == 3 and all(span.parent.span_id in clients for span in servers)
    assert all(span.attributes["specmesh.forward_ns"] > 0 for span in servers)


async def test_round_streams_need_the_internal_token_like_every_call(tiny_llama_dir):
    async with served_target(make_engine(tiny_llama_dir), internal_token="secret") as (_, bare, address):
        keyed = open_channel(address, interceptors=token_interceptors("secret"))
        try:
            assert len(await verify_rounds(TargetClient(keyed, round_calls="stream"), "keyed", 2)) == 2
            batched = TargetClient(keyed, round_calls="batch")
            assert len(await verify_rounds(batched, "keyed-batch", 2)) == 2
            # the token went as the stream call's own metadata: no interceptor's queue and task per message
            assert "Intercepted" not in type(batched.batches._stream.call).__name__
            stranger = TargetClient(bare, round_calls="stream")
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stranger.stub.VerifyRounds().read()
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        finally:
            await keyed.close()


async def test_a_cancelled_caller_drops_its_stream_so_its_answer_never_reaches_the_next_round(tiny_llama_dir):
    async with held_verification(tiny_llama_dir, "cancelled", timeout=30) as (client, verifying, hold, engine, opens):
        verifying.cancel()
        with pytest.raises(asyncio.CancelledError):
            await verifying
        assert "cancelled" not in client._streams
        hold.release()
        position = await committed_length(engine, "cancelled")
        later = await client.verify("cancelled", 2, position, [6], [], timeout=30)
        assert later.round == 2 and later.committed_length > position and opens.opened == 2  # its own answer


def test_a_broken_stream_is_unavailable_but_a_services_own_internal_error_stays_internal():
    def error(code, details):
        return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)
    broken = broken_as_unavailable(error(grpc.StatusCode.INTERNAL, "Internal error from Core"))
    assert broken.code() == grpc.StatusCode.UNAVAILABLE and "Internal error from Core" in broken.details()
    own = error(grpc.StatusCode.INTERNAL, f"{INTERNAL_DETAILS_PREFIX}KeyError")
    assert broken_as_unavailable(own) is own
    refused = error(grpc.StatusCode.INVALID_ARGUMENT, "position")
    assert broken_as_unavailable(refused) is refused
