"""What a request asks of sampling, and its wire form: no torch, so clients import it cheaply.

The sampling math over these parameters is specmesh.engine.sampling.
"""

from __future__ import annotations

from dataclasses import dataclass

from specmesh.v1 import common_pb2


GREEDY_BELOW_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None
    # Applied to the logits first, by specmesh.engine.penalties.penalize_logits.
    presence_penalty: float = 0.0  # OpenAI's, over the generated output
    frequency_penalty: float = 0.0  # OpenAI's, over the generated output
    repetition_penalty: float = 1.0  # transformers', over prompt and output; 1 = off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    output_start: int = 0  # position where the generated output begins; 0 = the session's prompt length
    logprobs: int | None = None  # target only: return logprobs with this many alternatives; None = none

    @property
    def greedy(self) -> bool:
        # Below this, logits / temperature overflows float32; argmax is the limit anyway.
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    @property
    def penalizes(self) -> bool:
        """True when penalties or biases change the logits."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias
                    or self.repetition_penalty not in (0.0, 1.0))

    @property
    def tries_alternatives(self) -> bool:
        """Whether the draft's second choices may be verified beside its tokens (target_service.alternatives):
        greedy on the model's own logits, where what is committed is the target's argmax either way."""
        return self.greedy and not self.penalizes


def sampling_from_pb(sampling: common_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=sampling.temperature,
        top_k=sampling.top_k,
        top_p=sampling.top_p if sampling.top_p > 0 else 1.0,
        seed=sampling.seed if sampling.HasField("seed") else None,
        presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty,
        repetition_penalty=sampling.repetition_penalty or 1.0,
        logit_bias=tuple(sorted(sampling.logit_bias.items())),
        output_start=sampling.output_start,
        logprobs=sampling.logprobs if sampling.HasField("logprobs") and sampling.logprobs >= 0 else None,
    )


def sampling_to_pb(params: SamplingParams) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(
        temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=params.seed,
        presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty, logit_bias=dict(params.logit_bias),
        output_start=params.output_start, logprobs=params.logprobs)
