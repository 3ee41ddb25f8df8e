"""The peer: transformers' `generate` in-process on the same pair and prompts.

Its modes (orchestrator.bench.modes): "peer-off" generates with the target alone,
"peer k=N" is assisted generation with the draft as assistant at a constant k of N
(num_assistant_tokens_schedule "constant"), with transformers' default confidence
stop left as users get it: the assistant also ends a round early when its token's
probability is below generation_config.assistant_confidence_threshold (0.4 to start;
transformers retunes it during a request when scikit-learn is installed).

transformers has no batching, so the peer runs one request at a time (its
figures belong beside concurrency 1), its modes taking turns prompt by prompt
as the served modes do there. A streamer records when each round's tokens
appear: the first round's time is TTFT, the gaps between rounds are ITL, and
tokens per round give the mean acceptance length. transformers does not report
how many tokens the assistant drafted, so the acceptance rate is estimated as
accepted / (k x rounds): a lower bound, since a round the confidence stop cut
short drafted fewer than k.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from tqdm import tqdm
from transformers.generation.streamers import BaseStreamer

from orchestrator.bench.metrics import RequestRecord
from orchestrator.bench.modes import DEFAULT, peer_k_of
from orchestrator.bench.prompts import BenchPrompt
from orchestrator.bench.runner import Configuration, LoadSettings, request_params
from specmesh import models
from specmesh.precision import load_model_in


class RoundTimer(BaseStreamer):
    """Times each put after the prompt's (one put per round in assisted generation)."""

    def __init__(self):
        self.prompt_seen, self.times, self.counts = False, [], []

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.times.append(time.perf_counter())
        self.counts.append(value.numel())

    def end(self) -> None:
        pass


@dataclass
class PeerPair:
    target: object
    draft: object | None
    tokenizer: object

    @classmethod
    def load(cls, target: str, draft: str | None, device: str, draft_device: str | None,
             target_dtype: str, draft_dtype: str, cpu_linear: str = "auto") -> "PeerPair":
        """The pair in the precisions the --dtype names give (specmesh.precision) and on the CPU
        kernels --cpu-linear names (specmesh.cpu_linear), as the services load it."""
        target_model, tokenizer = load_model_in(target, device, target_dtype, cpu_linear)
        draft_model = None
        if draft:
            draft_model = load_model_in(draft, draft_device or device, draft_dtype, cpu_linear)[0]
        return cls(target_model, draft_model, tokenizer)

    def encode(self, item: BenchPrompt) -> list[int]:
        """The ids the orchestrator would build for this prompt."""
        if item.messages is not None:
            return models.chat_token_ids(self.tokenizer, list(item.messages))
        return self.tokenizer.encode(item.prompt)


@torch.inference_mode()
def hf_generate(pair: PeerPair, prompt_ids: list[int], max_tokens: int, k: int | None, temperature: float = 0.0,
                seed: int | None = None, streamer: BaseStreamer | None = None) -> list[int]:
    """transformers' `generate`: the target alone when `k` is None, else assisted by the pair's draft
    at a constant k (with transformers' default confidence stop, module docstring).

    Returns the generated ids up to and including the first EOS. Sampling is plain
    temperature sampling (no top-k/top-p or repetition penalty from the model's
    generation config), as the orchestrator does with those fields unset.
    """
    input_ids = torch.tensor([prompt_ids], device=pair.target.device)  # [1, prompt_len]
    kwargs = {"do_sample": temperature > 0, "repetition_penalty": 1.0}
    if temperature > 0:
        kwargs.update(temperature=temperature, top_k=0, top_p=1.0)
        if seed is not None:
            torch.manual_seed(seed)
    if k is not None:
        if pair.draft is None:
            raise ValueError("assisted generation needs the pair's draft")
        pair.draft.generation_config.num_assistant_tokens = k
        pair.draft.generation_config.num_assistant_tokens_schedule = "constant"
        kwargs["assistant_model"] = pair.draft
    pad = pair.tokenizer.pad_token_id if pair.tokenizer.pad_token_id is not None else pair.tokenizer.eos_token_id
    output = pair.target.generate(input_ids, max_new_tokens=max_tokens, pad_token_id=pad, streamer=streamer,
                                  **kwargs)
    generated = output[0, input_ids.shape[1]:].tolist()
    eos = set(models.eos_token_ids(pair.target, pair.tokenizer))
    cut = next((i + 1 for i, token in enumerate(generated) if token in eos), len(generated))
    return generated[:cut]


def run_peer_request(pair: PeerPair, item: BenchPrompt, record: RequestRecord, max_tokens: int,
                     temperature: float, seed: int | None, k: int | None, run_start: float) -> None:
    """One timed generation (`k` as in hf_generate), filling `record` like a served request."""
    prompt_ids = pair.encode(item)
    timer = RoundTimer()
    start = time.perf_counter()
    record.start_s = start - run_start
    try:
        generated = hf_generate(pair, prompt_ids, max_tokens, k, temperature, seed, timer)
    except Exception as error:  # noqa: BLE001 - one failed request is reported, the run goes on
        record.ok, record.error = False, f"{type(error).__name__}: {error}"
        return
    record.e2e_ms = (time.perf_counter() - start) * 1e3
    record.ttft_ms = (timer.times[0] - start) * 1e3 if timer.times else record.e2e_ms
    record.itl_ms = [(b - a) * 1e3 for a, b in zip(timer.times, timer.times[1:])]
    record.prompt_tokens, record.output_tokens = len(prompt_ids), len(generated)
    if k is not None:  # the target alone verifies nothing: no rounds, as the server reports speculation off
        record.rounds = len(timer.times)
        record.accepted_tokens = max(0, len(generated) - record.rounds)
        record.draft_tokens = k * record.rounds


def run_peer(pair: PeerPair, prompts: list[BenchPrompt], config: Configuration, load: LoadSettings,
             modes: list[str]) -> dict[str, tuple[list[RequestRecord], float]]:
    """Every prompt once in each of `modes` ("peer-off", "peer k=N"), one request at a time, with `config`'s
    temperature; the modes take turns prompt by prompt, so drift favours none. Per mode: (records, seconds
    of its requests)."""
    records = {mode: [RequestRecord(kind=item.kind, mode=mode, index=i) for i, item in enumerate(prompts)]
               for mode in modes}
    seconds = dict.fromkeys(modes, 0.0)
    for i, item in enumerate(tqdm(prompts, desc=f"{config.name} peer", unit="req",
                                  disable=not load.progress, leave=False)):
        params = request_params(item, i, config, load, DEFAULT)  # its lengths, temperature and seed
        for mode in modes:
            start = time.perf_counter()
            run_peer_request(pair, item, records[mode][i], params.max_tokens, params.temperature, params.seed,
                             peer_k_of(mode), start - seconds[mode])  # start_s: seconds into the mode's own run
            seconds[mode] += time.perf_counter() - start
    return {mode: (records[mode], seconds[mode]) for mode in modes}
