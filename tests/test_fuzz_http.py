"""Property-based fuzzing of the OpenAI HTTP API's request fields (hypothesis).

Any JSON value in any field (wrong types, huge integers, NaN and infinities, lone surrogates,
unknown fields) gets a 2xx or a 4xx in OpenAI's error shape, never a 5xx; and a normal request
still works afterwards."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from front_door import assert_openai_error, fuzz_door  # noqa: F401 - fuzz_door is the `door` fixture

FUZZ = settings(max_examples=60, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
HTTP_4XX = {400, 401, 404, 413, 429}
SAMPLING_FIELDS = ["model", "max_tokens", "temperature", "top_p", "n", "stream", "stop", "seed", "top_k",
                   "num_speculative_tokens", "speculation", "prompt_class", "max_completion_tokens",
                   # OpenAI's, implemented or not: either way never silently ignored
                   "logprobs", "top_logprobs", "echo", "best_of", "presence_penalty", "frequency_penalty",
                   "logit_bias", "user", "stream_options", "suffix", "response_format", "tools"]

special_numbers = st.sampled_from([0, 1, -1, 2**31 - 1, 2**31, 2**40, 2**63, 2**64, -2**63, 10**30,
                                   0.5, 1e308, -1e-308, float("nan"), float("inf"), float("-inf")])
any_text = st.text(st.characters(exclude_categories=()), max_size=12)  # surrogates included
json_leaf = st.none() | st.booleans() | st.integers() | st.floats() | special_numbers | any_text
json_value = st.recursive(json_leaf, lambda inner: st.lists(inner, max_size=3)
                          | st.dictionaries(any_text, inner, max_size=3), max_leaves=6)
plausible = st.integers(-2, 300) | st.floats(-1, 3) | st.booleans() | st.text(max_size=4)  # gets past the types
value = st.one_of(json_value, plausible, plausible)  # one_of is uniform: the duplicate weighs plausible values


def overrides(extra_names: list[str]):
    names = st.one_of(st.sampled_from(SAMPLING_FIELDS + extra_names), st.sampled_from(SAMPLING_FIELDS), any_text)
    return st.dictionaries(names, value, max_size=3)


any_int = st.integers(-2, 300) | st.integers() | special_numbers.filter(lambda n: isinstance(n, int))
any_float = st.floats(-1, 3) | st.floats() | special_numbers
well_typed = st.fixed_dictionaries({}, optional={  # each field its own type, any value of it
    "max_tokens": st.integers(1, 8) | any_int, "temperature": any_float, "top_p": any_float, "top_k": any_int,
    "seed": st.integers(0, 2**64 - 1) | any_int, "n": st.just(1) | any_int, "stream": st.booleans(), "stop": any_text | st.lists(any_text, max_size=3),
    "num_speculative_tokens": any_int, "speculation": st.booleans(), "prompt_class": any_text,
    "model": st.sampled_from(["", None]) | any_text})
nonempty_text = st.text(st.characters(exclude_categories=()), min_size=1, max_size=12)
typed_prompt = st.one_of(nonempty_text, nonempty_text, st.lists(st.integers(0, 400) | any_int, min_size=1, max_size=6),
                         st.lists(any_text, max_size=2))

message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]) | json_value,
                                 "content": any_text | json_value})
messages = st.one_of(st.lists(message, min_size=1, max_size=3), json_value)


async def post(door, route: str, body: dict):
    """POST the body as JSON (NaN and Infinity written as Python's json writes them) and read it all."""
    content = json.dumps(body, allow_nan=True)  # ensure_ascii: a lone surrogate travels as "\ud800"
    async with door.http.stream("POST", f"/v1/{route}", content=content,
                                headers={"content-type": "application/json"}) as response:
        text = (await response.aread()).decode()
    return response, text


def check_answer(response, text: str, streaming: bool) -> None:
    assert response.status_code < 500, text
    if response.status_code >= 400:
        assert response.status_code in HTTP_4XX, text
        assert_openai_error(response)
    elif streaming:
        assert text.rstrip().endswith("data: [DONE]"), text[-200:]
    else:
        assert json.loads(text)["choices"]


async def assert_still_serving(door) -> None:
    response = await door.http.post("/v1/completions", json={"prompt": "The quick", "max_tokens": 3,
                                                            "temperature": 0})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3


@FUZZ
@given(fields=overrides(["prompt"]), prompt=st.one_of(any_text, any_text, json_value))
async def test_completions_fuzz(door, fields, prompt):
    body = {"prompt": prompt, "max_tokens": 2, **fields} if "prompt" not in fields else {"max_tokens": 2, **fields}
    response, text = await post(door, "completions", body)
    check_answer(response, text, body.get("stream") is True)


@FUZZ
@given(fields=overrides(["messages"]), chat=messages)
async def test_chat_completions_fuzz(door, fields, chat):
    body = {"messages": chat, "max_tokens": 2, **fields}
    response, text = await post(door, "chat/completions", body)
    check_answer(response, text, body.get("stream") is True)


@FUZZ
@given(fields=well_typed, prompt=typed_prompt, chat=st.booleans())
async def test_well_typed_fields_fuzz(door, fields, prompt, chat):
    """Values of the right type but any size or content reach validation and generation."""
    if chat:
        body = {"messages": [{"role": "user", "content": prompt if isinstance(prompt, str) else "hi"}],
                "max_completion_tokens": fields.pop("max_tokens", 2), **fields}
    else:
        body = {"prompt": prompt, "max_tokens": 2, **fields}
    response, text = await post(door, "chat/completions" if chat else "completions", body)
    check_answer(response, text, body.get("stream") is True)


async def test_the_server_still_serves_after_fuzzing(door):
    await assert_still_serving(door)
