"""The peer: transformers' assisted generation in-process on the same pair and prompts.

transformers has no batching, so the peer runs one request at a time (its
figures belong beside concurrency 1). A streamer records when each round's
tokens appear: the first round's time is TTFT, the gaps between rounds are
ITL, and tokens per round give the mean acceptance length. transformers does
not report how many tokens the assistant drafted; with the constant schedule
it drafts k a round, so the acceptance rate is estimated as accepted / (k x rounds).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from tqdm import tqdm
from transformers.generation.streamers import BaseStreamer

from orchestrator.bench.metrics import RequestRecord
from orchestrator.bench.modes import DEFAULT, PEER
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
def hf_generate(pair: PeerPair, prompt_ids: list[int], max_tokens: int, k: int, temperature: float = 0.0,
                seed: int | None = None, streamer: BaseStreamer | None = None) -> list[int]:
    """transformers' `generate`: target-only without a draft, else assisted with a constant k.

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
    if pair.draft is not None:
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
                     temperature: float, seed: int | None, k: int, run_start: float) -> None:
    """One timed assisted generation, filling `record` like a served request."""
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
    record.rounds = len(timer.times)
    record.accepted_tokens = max(0, len(generated) - record.rounds)
    record.draft_tokens = k * record.rounds if pair.draft is not None else 0


def run_peer(pair: PeerPair, prompts: list[BenchPrompt], config: Configuration, load: LoadSettings,
             k: int) -> tuple[list[RequestRecord], float]:
    """Every prompt once, one at a time, with `config`'s temperature; (records, wall seconds)."""
    records = [RequestRecord(kind=item.kind, mode=PEER, index=i) for i, item in enumerate(prompts)]
    start = time.perf_counter()
    for i, item in enumerate(tqdm(prompts, desc=f"{config.name} peer", unit="req",
                                  disable=not load.progress, leave=False)):
        params = request_params(item, i, config, load, DEFAULT)  # its lengths, temperature and seed
        run_peer_request(pair, item, records[i], params.max_tokens, params.temperature, params.seed, k, start)
    return records, time.perf_counter() - start
