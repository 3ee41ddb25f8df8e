"""What served output is checked against: the target's own greedy `generate`, its exact sampling
distributions and the noise of a finite sample of them, and transformers' penalty processors."""

from __future__ import annotations

import asyncio
import functools

import torch
from transformers import (LogitsProcessor, LogitsProcessorList, RepetitionPenaltyLogitsProcessor,
                          SequenceBiasLogitsProcessor)

from benchmarks.tiny_models import TINY_PROMPTS
from harness import load, make_engine, start_model_server
from orchestrator.decoding.loop import SpeculativeGeneration
from orchestrator.decoding.costs import BatchLoad, RoundCosts
from orchestrator.decoding.plan import FixedLength, RoundAsk, RoundPlan
from orchestrator.decoding.request import GenerationRequest, LoopConfig, LoopStats
from orchestrator.serving.clients import TargetClient, open_channel
from specmesh.engine.sampling_params import SamplingParams
from specmesh.engine.sampling import logits_to_probs

MAX_TOKENS = 32  # the greedy parity tests' generation length
PROMPT = "def add(a, b):"  # the sampled parity tests' prompt, whose second token they count
SAMPLES = 1000  # the generations a sampled parity test draws


@functools.lru_cache(maxsize=64)
def target_greedy(model_dir: str, device: str, prompt: str, max_tokens: int) -> tuple[int, ...]:
    """The target's own greedy generate, cut after the first EOS as specmesh does."""
    model, tokenizer = load(model_dir, device)
    prompt_ids = tokenizer.encode(prompt)
    with torch.inference_mode():
        output = model.generate(torch.tensor([prompt_ids], device=model.device), max_new_tokens=max_tokens,
                                do_sample=False, pad_token_id=tokenizer.pad_token_id)
    generated = output[0, len(prompt_ids):].tolist()
    eos = set(model.generation_config.eos_token_id if isinstance(model.generation_config.eos_token_id, list)
              else [model.generation_config.eos_token_id])
    for index, token_id in enumerate(generated):
        if token_id in eos:
            return tuple(generated[: index + 1])
    return tuple(generated)


async def greedy_outputs_then_stop(stack) -> list:
    """Every tiny prompt's greedy generation, all at once (sessions interleave on both services); then the
    stack stops, whatever happened."""
    try:
        return await asyncio.gather(*(stack.generate(prompt=p, max_tokens=MAX_TOKENS, temperature=0.0)
                                      for p in TINY_PROMPTS))
    finally:
        await stack.stop()


# ---- sampled: exact distributions, and how far SAMPLES draws fall from them


def exact_two_tokens(model, prompt_ids: list[int], params: SamplingParams, eos: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """p(first token) [V], never EOS (a generation that ends at its first token has no second), and
    p(second | first) [V, V]."""
    with torch.inference_mode():
        first = logits_to_probs(model(torch.tensor([prompt_ids], device=model.device)).logits[0, -1:].cpu(),
                                params)[0]  # [V]
        vocab = first.numel()
        batch = torch.cat([torch.tensor(prompt_ids).repeat(vocab, 1), torch.arange(vocab)[:, None]], dim=1)
        second = logits_to_probs(model(batch.to(model.device)).logits[:, -1].cpu(), params)  # [V, V]
        first[eos] = 0.0
    return first / first.sum(), second


def exact_second_token_marginal(model_dir: str, device: str, params: SamplingParams) -> torch.Tensor:
    model, tokenizer = load(model_dir, device)
    first, second = exact_two_tokens(model, tokenizer.encode(PROMPT), params, tokenizer.eos_token_id)
    return first @ second  # [V]


def total_variation(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - probs).abs().sum())


def expected_sampling_tv(probs: torch.Tensor, samples: int) -> float:
    """E[TV(empirical, probs)] over `samples` draws: 0.5 * sum_v sqrt(2 p (1 - p) / (pi n))."""
    return 0.5 * float(torch.sqrt(2 * probs * (1 - probs) / torch.pi).sum()) / samples ** 0.5


async def sample_first_two(model_dir, device, prompt_ids: list[int], params: SamplingParams, eos: int, policy,
                           config: LoopConfig, history=None) -> list[tuple[list[int], LoopStats]]:
    """SAMPLES generations' first two tokens and stats, through the loop with `policy` over a real target."""
    server, port = await start_model_server("target", make_engine(model_dir, device, "target"))
    target = TargetClient(open_channel(f"127.0.0.1:{port}"))
    limit = asyncio.Semaphore(24)

    async def first_two(index: int) -> tuple[list[int], LoopStats]:
        generation = SpeculativeGeneration(
            GenerationRequest(request_id=f"r{index}", prompt_token_ids=prompt_ids, max_tokens=3, sampling=params,
                              stop=[], num_speculative_tokens=2),
            target, None, {eos}, config, policy=policy, history=history)
        async with limit:
            tokens = [t async for batch in generation.tokens() for t in batch]
        return tokens[:2], generation.stats
    try:
        return [(t, s) for t, s in await asyncio.gather(*(first_two(i) for i in range(SAMPLES))) if len(t) == 2]
    finally:
        await server.stop(None)


def assert_second_tokens_follow(outcomes, first: torch.Tensor, second: torch.Tensor, follows: dict[int, int],
                                proposer: str) -> None:
    """The second token follows the target's exact marginal, where `proposer` (lookup or suffix: its stats'
    field prefix) proposed `follows[first token]` for most first tokens."""
    proposed, accepted = (sum(getattr(s, f"{proposer}_{f}") for _, s in outcomes) for f in ("tokens", "accepted_tokens"))
    # The proposer decided most second tokens, both ways (accepted and rejected): the test exercised it.
    assert proposed > SAMPLES / 2 and SAMPLES / 10 < accepted < proposed - SAMPLES / 10, (proposed, accepted)
    n = len(outcomes)
    # The second token's marginal, within the noise of n exact draws ...
    marginal = first @ second  # [V]
    counts = torch.bincount(torch.tensor([t[1] for t, _ in outcomes]), minlength=marginal.numel()).float()
    assert total_variation(counts, marginal) < 2 * expected_sampling_tv(marginal, n)
    # ... and, sharper, how often it is the token proposed after the first: a rejection that
    # resampled from p with the rejected token left in would add (1 - p) p to it.
    exact_hit = float(sum(first[v] * second[v, w] for v, w in follows.items()))
    hit = sum(t[1] == follows.get(t[0]) for t, _ in outcomes) / n
    assert abs(hit - exact_hit) < 4 * (exact_hit * (1 - exact_hit) / n) ** 0.5, (hit, exact_hit)


class VerifyAll(FixedLength):
    """A stand-in for the default policy that never drafts and verifies every proposal of one source (prompt
    lookup's or the suffix index's): pricing is not the subject here, the target's verdict on a one-hot
    proposal is."""

    def __init__(self, source: str):
        super().__init__(RoundCosts())
        self.source = source

    def plan(self, ask: RoundAsk) -> RoundPlan:
        offer = next((offer for offer in ask.offers() if offer.source == self.source), None)
        return RoundPlan(free=offer, batch=BatchLoad(1, ask.context))


# ---- penalties: transformers' own logits processors


class OpenAIPenalties(LogitsProcessor):
    """Reference for OpenAI's presence/frequency penalties: counts over the generated tokens only."""

    def __init__(self, prompt_length: int, presence: float, frequency: float):
        self.prompt_length, self.presence, self.frequency = prompt_length, presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        counts = torch.zeros_like(scores)  # [1, V]
        for token_id in input_ids[0, self.prompt_length:].tolist():
            counts[0, token_id] += 1
        return scores - self.frequency * counts - self.presence * (counts > 0)


def reference_processors(fields: dict, prompt_length: int) -> LogitsProcessorList:
    processors = []
    if "repetition_penalty" in fields:
        processors.append(RepetitionPenaltyLogitsProcessor(fields["repetition_penalty"]))
    if "presence_penalty" in fields or "frequency_penalty" in fields:
        processors.append(OpenAIPenalties(prompt_length, fields.get("presence_penalty", 0.0),
                                          fields.get("frequency_penalty", 0.0)))
    if "logit_bias" in fields:
        processors.append(SequenceBiasLogitsProcessor([[[t], b] for t, b in fields["logit_bias"].items()]))
    return LogitsProcessorList(processors)
