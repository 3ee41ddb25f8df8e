"""The peer: transformers' `generate` in-process on the same pair and prompts.

Its modes (orchestrator.bench.modes): "peer-off" generates with the target alone,
"peer k=N" is assisted generation with the draft as assistant at a constant k of N
(num_assistant_tokens_schedule "constant"), with transformers' default confidence
stop left as users get it: the assistant also ends a round early when its token's
probability is below generation_config.assistant_confidence_threshold (0.4 to start;
transformers retunes it during a request when scikit-learn is installed).

transformers has no batching, so the peer runs one request at a time (its
figures belong beside concurrency 1), as one more client of the run: its modes
take turns with the served modes prompt by prompt, so the host's drift during a
run favours neither (the served stack idles meanwhile; both pairs are in memory).
A streamer records when each round's tokens appear: the first round's time is
TTFT, the gaps between rounds are ITL, and tokens per round give the mean
acceptance length. Forward hooks on both models time where each later round's
time goes (orchestrator.bench.round_parts): draft forwards, target forwards and
the rest (transformers' own loop). transformers does not report
how many tokens the assistant drafted; the draft's forward calls count them (one
call a drafted token), so the acceptance rate is accepted / drafted as served.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import torch
from transformers.generation.streamers import BaseStreamer

from orchestrator.bench.metrics import RequestRecord, token_digest
from orchestrator.bench.clients import RequestParams
from orchestrator.prompts.sets import BenchPrompt
from orchestrator.bench.round_parts import RoundParts
from specmesh.loading import models
from specmesh.loading.precision import load_model_in


class ForwardClock:
    """Seconds a model spent in forward calls, and how many calls (one per drafted token for a draft)."""

    def __init__(self, model):
        self.busy_s, self.calls, self._started = 0.0, 0, 0.0
        self._sync = model.device.type == "cuda"  # kernels run after the call returns: wait for them
        model.register_forward_pre_hook(self._enter)
        model.register_forward_hook(self._leave)

    def _now(self) -> float:
        if self._sync:
            torch.cuda.synchronize()
        return time.perf_counter()

    def _enter(self, module, args) -> None:
        self._started = self._now()

    def _leave(self, module, args, output) -> None:
        self.busy_s += self._now() - self._started
        self.calls += 1


@dataclass
class PeerClocks:
    target: ForwardClock
    draft: ForwardClock | None

    def reading(self) -> tuple[float, float, int]:
        """(target busy s, draft busy s, draft calls) so far."""
        draft = self.draft
        return self.target.busy_s, draft.busy_s if draft else 0.0, draft.calls if draft else 0


class RoundTimer(BaseStreamer):
    """Times each put after the prompt's (one put per round in assisted generation), and reads the
    models' forward clocks at each."""

    def __init__(self, clocks: PeerClocks):
        self.prompt_seen, self.times, self.counts = False, [], []
        self.clocks, self.readings = clocks, []

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.times.append(time.perf_counter())
        self.counts.append(value.numel())
        self.readings.append(self.clocks.reading())

    def end(self) -> None:
        pass

    def decode_rounds(self) -> RoundParts:
        """The rounds after the first: the target's and the draft's forwards, and the rest as idle."""
        if len(self.readings) < 2:
            return RoundParts()
        (target_0, draft_0, calls_0), (target_1, draft_1, calls_1) = self.readings[0], self.readings[-1]
        wall = self.times[-1] - self.times[0]
        parts = RoundParts(len(self.times) - 1, calls_1 - calls_0)
        parts.seconds.update(target_busy=target_1 - target_0, draft_busy=draft_1 - draft_0)
        parts.seconds["idle"] = max(0.0, wall - parts.seconds["target_busy"] - parts.seconds["draft_busy"])
        return parts


@dataclass
class PeerPair:
    target: object
    draft: object | None
    tokenizer: object
    clocks: PeerClocks = field(init=False)

    def __post_init__(self):
        self.clocks = PeerClocks(ForwardClock(self.target), ForwardClock(self.draft) if self.draft else None)

    @classmethod
    def load(cls, target: str, draft: str | None, device: str, draft_device: str | None,
             target_dtype: str, draft_dtype: str, target_cpu_linear: str = "auto", draft_cpu_linear: str = "auto",
             trust_remote_code: bool = False) -> "PeerPair":
        """The pair in the precisions the --dtype names give (specmesh.loading.precision) and on the CPU
        kernels --cpu-linear names (specmesh.loading.cpu_linear). Given what the services report running
        (ModelInfo's precision and cpu_linear), it runs the same: `auto` timed again here could
        choose otherwise."""
        target_model, tokenizer = load_model_in(target, device, target_dtype, target_cpu_linear, trust_remote_code)
        draft_model = None
        if draft:
            draft_model = load_model_in(draft, draft_device or device, draft_dtype, draft_cpu_linear,
                                        trust_remote_code)[0]
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
                     temperature: float, seed: int | None, k: int | None, run_start: float) -> RoundTimer:
    """One timed generation (`k` as in hf_generate), filling `record` like a served request; returns its
    timer (rounds and forward clocks)."""
    prompt_ids = pair.encode(item)
    timer = RoundTimer(pair.clocks)
    draft_calls = pair.clocks.reading()[2]
    start = time.perf_counter()
    record.start_s = start - run_start
    try:
        generated = hf_generate(pair, prompt_ids, max_tokens, k, temperature, seed, timer)
    except Exception as error:  # noqa: BLE001 - one failed request is reported, the run goes on
        record.ok, record.error = False, f"{type(error).__name__}: {error}"
        return timer
    record.e2e_ms = (time.perf_counter() - start) * 1e3
    record.ttft_ms = (timer.times[0] - start) * 1e3 if timer.times else record.e2e_ms
    record.itl_ms = [(b - a) * 1e3 for a, b in zip(timer.times, timer.times[1:])]
    record.prompt_tokens, record.output_tokens = len(prompt_ids), len(generated)
    record.output_digest = token_digest([generated])
    if k is not None:  # the target alone verifies nothing: no rounds, as the server reports speculation off
        record.rounds = len(timer.times)
        record.accepted_tokens = max(0, len(generated) - record.rounds)
        record.draft_tokens = pair.clocks.reading()[2] - draft_calls  # one draft forward per drafted token
    return timer


class PeerClient:
    """The peer as a client of the run (orchestrator.bench.runner): a request of a peer mode
    (orchestrator.bench.modes) generates in a worker thread, so the event loop stays free."""

    def __init__(self, pair: PeerPair):
        self.pair = pair
        self.parts: dict[str, RoundParts] = {}  # decode rounds by mode, cumulative

    async def send(self, item: BenchPrompt, params: RequestParams, record: RequestRecord, run_start: float) -> None:
        k = params.num_speculative_tokens if params.speculation else None
        timer = await asyncio.to_thread(run_peer_request, self.pair, item, record, params.max_tokens,
                                        params.temperature, params.seed, k, run_start)
        self.parts[record.mode] = self.parts.get(record.mode, RoundParts()) + timer.decode_rounds()

    async def round_parts(self, mode: str) -> RoundParts:
        return self.parts.get(mode, RoundParts())

    async def close(self) -> None:
        pass
