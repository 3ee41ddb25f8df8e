"""Property-based fuzzing of the gRPC Generate request (hypothesis).

Any value of each field's type, and any bytes at all as the message, get a completed stream or
INVALID_ARGUMENT carrying a google.rpc BadRequest; never UNKNOWN or INTERNAL, and the server
keeps serving."""

from __future__ import annotations

import grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from front_door import bad_request_fields, fuzz_door  # noqa: F401 - fuzz_door is the `door` fixture
from specmesh.v1 import generation_pb2

FUZZ = settings(max_examples=60, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
FIELD_NAMES = {field.name for field in generation_pb2.GenerateRequest.DESCRIPTOR.fields} | {""}

int32 = st.integers(-2**31, 2**31 - 1)
small = st.integers(-2, 40)
text = st.text(max_size=16)  # protobuf strings cannot hold lone surrogates: the client refuses them
floats = st.floats(width=32) | st.sampled_from([0.0, 1.0, -0.0, float("nan"), float("inf"), 3.4e38])
optional = {
    "max_tokens": st.integers(1, 6) | int32, "temperature": st.floats(0, 2, width=32) | floats,
    "top_k": small | int32, "top_p": st.floats(0, 1, width=32) | floats, "seed": st.integers(0, 2**64 - 1),
    "num_speculative_tokens": small | int32, "speculation": st.booleans(),
}
prompt_text = {"prompt": st.text(min_size=1, max_size=16) | text}
prompt_ids = {"prompt_token_ids": st.lists(st.integers(0, 319), min_size=1, max_size=6) | st.lists(int32, max_size=6)}
prompts = st.one_of(st.fixed_dictionaries(prompt_text), st.fixed_dictionaries(prompt_ids),
                    st.fixed_dictionaries({**prompt_text, **prompt_ids}))
others = st.fixed_dictionaries({}, optional={
    **optional, "stop": st.lists(text, max_size=3), "request_id": text | st.text(min_size=129, max_size=140),
    "prompt_class": text | st.sampled_from(["code", "chat"])})
request_fields = st.builds(lambda prompt, rest: {**prompt, **rest}, prompts, others)
VALID = generation_pb2.GenerateRequest(prompt="The quick brown", max_tokens=3, temperature=0.0,
                                       stop=["fox"]).SerializeToString()


def mutated(flips: list[tuple[int, int]], cut: int) -> bytes:
    data = bytearray(VALID)
    for index, byte in flips:
        data[index % len(data)] = byte
    return bytes(data[:cut])


raw_messages = st.binary(max_size=48) | st.builds(
    mutated, st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=4),
    st.integers(0, len(VALID)))


async def assert_completes_or_names_a_field(call) -> None:
    try:
        last = None
        async for last in call:
            pass
    except grpc.aio.AioRpcError as error:
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (error.code(), error.details())
        fields = bad_request_fields(error)
        assert fields and set(fields) <= FIELD_NAMES, (fields, error.details())
    else:
        assert last is not None and last.finish_reason != generation_pb2.FINISH_REASON_UNSPECIFIED


@FUZZ
@given(fields=request_fields)
async def test_generate_request_fields_fuzz(door, fields):
    await assert_completes_or_names_a_field(door.stub.Generate(generation_pb2.GenerateRequest(**fields), timeout=60))


@FUZZ
@given(data=raw_messages)
async def test_generate_raw_bytes_fuzz(door, data):
    await assert_completes_or_names_a_field(door.raw_generate(data))


async def test_the_server_still_serves_after_fuzzing(door):
    request = generation_pb2.GenerateRequest(prompt="The quick", max_tokens=3, temperature=0.0)
    token_ids, finish = await door.generate(request)
    assert len(token_ids) == 3 and finish == generation_pb2.FINISH_REASON_LENGTH
