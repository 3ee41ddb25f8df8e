"""Near-repeats: a prompt that re-asks an earlier one with other names is proposed the earlier output, renamed.

The alignment and the renaming on token lists; the index's twin document (proposed while the
request runs, gone when it ends, inside the memory bound); and through the loop over a real
target, a re-asked request whose earlier answer renamed is the target's own: the twin proposes
nearly all of it, and the output is the target's greedy output token for token.
"""

from __future__ import annotations

import pytest

from harness import load, make_engine, start_model_server
from orchestrator.decoding.loop import SpeculativeGeneration
from orchestrator.decoding.proposals import SUFFIX
from orchestrator.decoding.renamed_repeats import MAX_NAME_TOKENS, rename, renaming
from orchestrator.decoding.request import GenerationRequest, LoopConfig
from orchestrator.decoding.suffix_index import TOKEN_BYTES, SuffixIndex
from orchestrator.serving.clients import TargetClient, open_channel
from parity import VerifyAll, target_greedy
from specmesh.engine.sampling_params import SamplingParams
from benchmarks.tiny_models import TINY_PROMPTS

PROMPT = [10, 11, 12, 13, 14, 15, 16, 17, 12, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28]


@pytest.mark.unit
def test_a_renamed_prompt_gives_its_substitutions():
    renamed = [99 if t == 12 else t for t in PROMPT]  # one name, used twice
    renamed[5:6] = [97, 98]  # another, now two tokens long
    assert renaming(PROMPT, renamed) == {(12,): (99,), (15,): (97, 98)}


@pytest.mark.unit
def test_adjacent_names_of_one_token_each_are_renamed_apart():
    earlier = PROMPT[:5] + [60, 61, 62] + PROMPT[5:]
    assert renaming(earlier, PROMPT[:5] + [70, 61, 72] + PROMPT[5:]) == {(60,): (70,), (62,): (72,)}
    assert renaming(earlier, PROMPT[:5] + [70, 71] + PROMPT[5:]) == {(60, 61, 62): (70, 71)}


@pytest.mark.unit
def test_prompts_that_are_not_renamed_give_none():
    assert renaming(PROMPT, list(PROMPT)) is None  # the same prompt: the index's own matches cover it
    assert renaming(PROMPT, PROMPT[:10] + [40, 41] + PROMPT[10:]) is None  # an insertion: another prompt
    assert renaming(PROMPT, PROMPT[:8]) is None  # a deletion
    long_change = PROMPT[:4] + list(range(50, 51 + MAX_NAME_TOKENS)) + PROMPT[5:]
    assert renaming(PROMPT, long_change) is None  # a rewording, longer than a name
    twice = list(PROMPT)
    twice[2], twice[8] = 90, 91  # token 12 renamed two ways
    assert renaming(PROMPT, twice) is None
    assert renaming(PROMPT, list(range(100, 120))) is None  # nothing in common


@pytest.mark.unit
def test_rename_replaces_longest_first_and_never_inside_a_replacement():
    substitutions = {(1,): (7,), (1, 2): (8, 8), (7,): (1,)}
    assert rename([1, 2, 3, 1, 4, 7], substitutions) == [8, 8, 3, 7, 4, 1]


@pytest.mark.unit
def test_a_renamed_re_ask_is_proposed_the_earlier_output_renamed_while_it_runs():
    index = SuffixIndex()
    output = [30, 12, 31, 32, 12, 33, 15, 34, 35, 36]
    index.open(PROMPT).extend(output)
    unrelated = index.open(list(range(200, 220)))
    assert index.renamed_twin(unrelated) is None
    renamed = [99 if t == 12 else t for t in PROMPT]
    document = index.open(renamed)
    bytes_before = index.bytes_used
    twin = index.renamed_twin(document)
    assert twin is not None
    proposal = index.propose(renamed, 20)
    assert proposal.tokens == [30, 99, 31, 32, 99, 33, 15, 34, 35, 36]
    assert proposal.match_length >= len(PROMPT)
    assert index.bytes_used > bytes_before  # the twin is charged like any document ...
    index.discard(twin)
    assert index.bytes_used == bytes_before  # ... until it goes
    assert index.propose(renamed, 20).tokens != proposal.tokens  # ... and the twin's entries are gone
    index.discard(twin)  # twice: nothing more happens
    assert len(index) == 3


@pytest.mark.unit
def test_an_exact_re_ask_gets_no_twin_and_is_proposed_its_own_earlier_answer():
    index = SuffixIndex()
    output = [30, 12, 31, 32, 12, 33, 15, 34, 35, 36]
    index.open(PROMPT).extend(output)
    renamed = [99 if t == 12 else t for t in PROMPT]
    index.open(renamed).extend([40, 99, 41, 42, 43, 44, 45, 46, 47, 48])  # renamed, and answered otherwise
    exact = index.open(PROMPT)
    assert index.renamed_twin(exact) is None  # a twin of the renamed answer would tie with the exact one
    assert index.propose(PROMPT, 20).tokens == output


@pytest.mark.unit
def test_twins_stay_inside_the_memory_bound():
    index = SuffixIndex(max_bytes=60 * TOKEN_BYTES)
    output = list(range(40, 70))
    for round_number in range(20):
        index.open(PROMPT).extend(output)
        renamed = [1000 + round_number if t == 12 else t for t in PROMPT]
        index.renamed_twin(index.open(renamed))
        assert index.bytes_used <= index.max_bytes


async def test_a_re_asked_request_is_drafted_by_its_twin_and_stays_the_targets_own(tiny_llama_dir, device):
    model, tokenizer = load(str(tiny_llama_dir), device)
    prompt_ids = tokenizer.encode(TINY_PROMPTS[0])
    expected = target_greedy(str(tiny_llama_dir), device, TINY_PROMPTS[0], 32)
    # An earlier request asked the same with one name (a prompt token) spelled as a token used nowhere else,
    # and answered the target's output with that spelling: renamed back, it is exactly this request's output.
    name = prompt_ids[len(prompt_ids) // 2]
    unused = next(t for t in range(model.config.vocab_size - 1, 0, -1)
                  if t not in prompt_ids and t not in expected)
    index = SuffixIndex()
    spell = {name: unused}
    index.open([spell.get(t, t) for t in prompt_ids]).extend([spell.get(t, t) for t in expected])
    server, port = await start_model_server("target", make_engine(tiny_llama_dir, device, "target"))
    try:
        generation = SpeculativeGeneration(
            GenerationRequest(request_id="re-asked", prompt_token_ids=prompt_ids, max_tokens=32,
                              sampling=SamplingParams(0.0), stop=[], num_speculative_tokens=4),
            TargetClient(open_channel(f"127.0.0.1:{port}")), None, {tokenizer.eos_token_id},
            LoopConfig(num_speculative_tokens=4, prompt_lookup=False), policy=VerifyAll(SUFFIX), history=index)
        tokens = [t async for batch in generation.tokens() for t in batch]
    finally:
        await server.stop(None)
    assert tuple(tokens) == expected
    stats = generation.stats
    # all but the first token (the prefill's) and a bonus token came from the twin, in one round
    assert stats.suffix_accepted_tokens >= len(expected) - 2 and stats.rounds <= 2, stats
    assert len(index) == 2  # the twin went with the request; the earlier request and this one stay
