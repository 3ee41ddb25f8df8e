"""Per-session KV caches over one causal LM, shared by the draft and target services.

A session is one generation. Its `token_ids` are the sequence at absolute
positions 0..len-1, and its KV cache covers a prefix of them. The cache always
covers *fewer* tokens than the sequence: the newest token is fed by the next
forward pass, which yields the logits that predict the token after it. Rolling
back is a crop of the cache: positions past the new length are simply dropped.

All model work runs on one worker thread per engine (specmesh.engine.batching), so the gRPC
event loop stays responsive: the services submit jobs (a batch's parts together, submit_all),
and each step of the worker runs the pending rows of every session in one forward
(specmesh.engine.ragged), with no wait for sessions that have sent nothing; on CUDA the
decode rows run as one static step over preallocated KV, replayed as a CUDA graph
(specmesh.engine.graph_steps).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import socket
import time
from dataclasses import dataclass
from typing import Any, Callable, Generator, Sequence, TypeVar

import torch
from transformers import Cache, DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from specmesh.loading import models
from specmesh.engine.batching import Feed, Job, Part, StepPlanner, StepScheduler
from specmesh.engine.closed_sessions import ClosedSessions
from specmesh.engine.commit import committed_sequence
from specmesh.errors import CapacityExhausted, InvalidArgument, SessionClosed, SessionExists, SessionNotFound
from specmesh.errors import PositionMismatch
from specmesh.engine.graph_steps import GraphSteps, slot_budget, uses_graph_steps
from specmesh.loading.hf_compat import cache_kwargs
from specmesh.engine.kv_budget import (DEFAULT_MAX_WAITING_SESSIONS, KVBudget, KVCacheMemory, check_prefill_in_time,
                                       reservation, wait_limit)
from specmesh.engine.penalties import check_penalties
from specmesh.loading.precision import loaded_as, output_device, output_rows
from specmesh.engine.ragged import avoid_cudnn_attention, install_segmented_attention, ragged_forward, supports_ragged
from specmesh.engine.sampling_params import SamplingParams
from specmesh.engine.sampling import make_generator
from specmesh.engine.session import Session
from specmesh.engine.step_costs import ChunkSteering, PrefillThroughput, StepCosts
from specmesh.engine.step_model import StepShape
from specmesh.v1 import common_pb2

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class EngineConfig:
    model_name: str
    max_sessions: int = 256
    # Sessions one caller may hold; None = three quarters of max_sessions, so that one caller
    # (a leaking orchestrator, or one of several) can never take every slot.
    max_sessions_per_caller: int | None = None
    generator_salt: int = 0  # keeps the draft's random stream apart from the target's
    # Rows one step may feed (decode rows first; prefill chunks fill the rest).
    max_step_tokens: int = 2048
    # Prefill rows a step adds while streams decode, when no measured StepCosts say more.
    prefill_chunk: int = 64
    # With measured costs: a step with a prefill chunk costs at most this many times the
    # decode rows alone (so a long prompt delays running streams by at most that factor).
    prefill_slowdown: float = 2.0
    kv_cache_memory: KVCacheMemory | None = None  # the KV budget (engine.kv_budget); None: the device's default
    max_waiting_sessions: int = DEFAULT_MAX_WAITING_SESSIONS  # opens queued for KV room; more are refused
    # Decode and verification steps over preallocated KV, as CUDA graphs (specmesh.engine.graph_steps):
    # "auto" on CUDA, "on" anywhere (eager off CUDA: how the suite checks it), "off".
    graph_steps: str = "auto"

    @property
    def caller_limit(self) -> int:
        if self.max_sessions_per_caller is not None:
            return self.max_sessions_per_caller
        return max(1, self.max_sessions - self.max_sessions // 4)


class ModelEngine:
    """Owns a model, its tokenizer facts and the sessions' KV caches."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, config: EngineConfig):
        self.model = model
        self.config = config
        self.device = next(model.parameters()).device  # where input ids go (the embedding's device)
        # Sharded over several GPUs (device "auto"), the output projection may sit on another one.
        self.logits_device = output_device(model)
        self.vocab_size = output_rows(model)
        self.context_window = models.context_window(model)
        self.eos_token_ids = models.eos_token_ids(model, tokenizer)
        self.vocab_fingerprint = models.vocab_fingerprint(tokenizer)
        self.precision, self.cpu_linear = loaded_as(model)  # reported: what it runs, resolved
        self.sessions: dict[str, Session] = {}
        self.closed = ClosedSessions()  # closed before they opened: their opens are refused
        self.kv = KVBudget.for_model(model, config.kv_cache_memory, config.max_waiting_sessions)
        self.costs: StepCosts | None = None  # measured by calibrate(); None: no row padding
        if avoid_cudnn_attention(self.device):
            log.info("cuDNN attention off in this process: it plans every new attention shape (specmesh.engine.ragged)")
        self.ragged = supports_ragged(model)
        if self.ragged:
            install_segmented_attention(model)
        self.graph: GraphSteps | None = None
        if self.ragged and uses_graph_steps(config.graph_steps, model):
            self.kv, self.graph = slot_budget(model, self.kv, config.max_sessions, self.context_window)
            self.context_window = self.graph.context_window
        planner = StepPlanner(config.max_step_tokens, self._prefill_allowance)
        self.scheduler = StepScheduler(self._run_step, planner, name=f"model-{config.model_name}"[:15])
        self.chunks = ChunkSteering()
        self.prefill_rate = PrefillThroughput()
        self.scheduler.observers.append(self._steer_chunks)
        self.scheduler.observers.append(self._track_step_costs)

    async def run(self, fn: Callable[..., T], *args, session: Session | None = None) -> T:
        """Run fn on the engine's worker between steps (after the session's earlier jobs, if given)."""
        return await self.scheduler.call(fn, *args, key=session.request_id if session is not None else None)

    async def submit(self, session: Session, job: Job) -> Any:
        """Run a job (a generator of Feeds, specmesh.engine.batching) for the session; its result."""
        return await self.scheduler.submit(session.request_id, job)

    def submit_all(self, jobs: Sequence[tuple[Session, Job]]) -> list[asyncio.Future]:
        """Queue the jobs of a batch (a job per session) to board the same step; a future per job, in order.
        On the event loop's thread (StepScheduler.submit_all)."""
        return self.scheduler.submit_all([(session.request_id, job) for session, job in jobs])

    def feed(self, session: Session, token_ids: Sequence[int], keep_rows: int | None = None,
             chunkable: bool = False, parents: tuple[int, ...] = ()) -> Generator[Feed, Any, tuple[torch.Tensor, int]]:
        """In a job: feed token_ids after the cache in the next step, as a chain or as the tree `parents`
        describes (Feed.parents); (logits [keep, V], step ns)."""
        keep = len(token_ids) if keep_rows is None else max(1, min(keep_rows, len(token_ids)))
        logits, step_ns = yield Feed(session, list(token_ids), keep, chunkable, parents)
        session.last_used = time.monotonic()
        return logits, step_ns

    def feed_tail(self, session: Session, extra: Sequence[int] = (), keep_rows: int | None = None,
                  chunkable: bool = False) -> Generator[Feed, Any, tuple[torch.Tensor, int]]:
        """In a job: feed the sequence's uncached tail plus `extra`; (logits [keep, V], step ns)."""
        return (yield from self.feed(session, session.uncached_tail + list(extra), keep_rows, chunkable))

    def describe(self) -> common_pb2.ModelInfo:
        return common_pb2.ModelInfo(
            model=self.config.model_name,
            vocab_size=self.vocab_size,
            vocab_fingerprint=self.vocab_fingerprint,
            eos_token_ids=self.eos_token_ids,
            context_window=self.context_window,
            device=str(self.device),
            open_sessions=len(self.sessions),
            queued_rows=self.scheduler.queued_rows,
            running_sessions=self.kv.running,
            waiting_sessions=self.kv.waiting,
            kv_cache_usage=self.kv.usage,
            host=socket.gethostname(),
            cpu_affinity=sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [],
            step_costs=self.costs.to_proto() if self.costs is not None else [],
            planned_step_costs=self.costs.planned_to_proto() if self.costs is not None else [],
            step_model=self.costs.model.to_proto() if self.costs is not None else None,
            precision=self.precision,
            cpu_linear=self.cpu_linear,
        )

    def check_token_ids(self, field_name: str, token_ids: Sequence[int]) -> None:
        for token_id in token_ids:
            if not 0 <= token_id < self.vocab_size:
                raise InvalidArgument(field_name, f"token id {token_id} outside [0, {self.vocab_size})")

    async def admit(self, request_id: str, prompt: Sequence[int], sampling: SamplingParams, caller: str = "",
                    max_new_tokens: int = 0, timeout_s: float | None = None) -> Session:
        """new_session once the session's KV reservation is granted (specmesh.engine.kv_budget); a bad request
        fails before it waits, and one whose prefill would end past its call's deadline is refused."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self.check_new_session(request_id, prompt, sampling, caller)
        await self.kv.reserve(request_id, self._reservation(len(prompt), max_new_tokens), wait_limit(timeout_s))
        try:
            if deadline is not None:
                ahead = self.queued_prefill_rows()
                check_prefill_in_time(ahead, self.prefill_seconds(ahead + len(prompt)),
                                      wait_limit(deadline - time.monotonic()))
            if request_id in self.closed:  # closed while it waited for room
                raise SessionClosed(request_id)
            return self.new_session(request_id, prompt, sampling, caller)
        except BaseException:
            self.kv.release(request_id)  # refused after all: its room goes to the next in line
            raise

    def _reservation(self, prompt_tokens: int, max_new_tokens: int) -> int:
        """KV tokens a session reserves: a whole slot over preallocated KV, else what it may ever hold."""
        if self.graph is not None:
            return self.graph.pool.slot_length
        return reservation(self.context_window, prompt_tokens, max_new_tokens)

    def new_cache(self) -> Cache:
        """An empty KV cache: a slot of the preallocated pool under graph steps, else a DynamicCache."""
        return self.graph.pool.new_cache() if self.graph is not None else DynamicCache()

    def new_session(self, request_id: str, prompt: Sequence[int], sampling: SamplingParams,
                    caller: str = "") -> Session:
        """Register an empty-cache session for `prompt` opened by `caller`, outside the KV budget (admit
        reserves its room first); the service prefills it."""
        self.check_new_session(request_id, prompt, sampling, caller)
        salt = self.config.generator_salt
        seed = random.getrandbits(62) if sampling.seed is None else (sampling.seed * 1_000_003 + salt) % 2**62
        session = Session(request_id, list(prompt), self.new_cache(), sampling,
                          make_generator(sampling.seed, salt), seed=seed, caller=caller,
                          output_start=sampling.output_start or len(prompt))
        self.sessions[request_id] = session
        return session

    def check_new_session(self, request_id: str, prompt: Sequence[int], sampling: SamplingParams,
                          caller: str = "") -> None:
        """What new_session refuses; admit checks it before a session waits for KV room."""
        if not request_id:
            raise InvalidArgument("request_id", "must not be empty")
        if not prompt:
            raise InvalidArgument("prompt_token_ids", "must not be empty")
        if len(prompt) >= self.context_window:
            raise InvalidArgument("prompt_token_ids", f"{len(prompt)} tokens leave no room in the "
                                  f"{self.context_window}-token context window")
        self.check_token_ids("prompt_token_ids", prompt)
        check_penalties(sampling)
        if request_id in self.sessions:
            raise SessionExists(request_id)
        if request_id in self.closed:
            raise SessionClosed(request_id)
        if len(self.sessions) >= self.config.max_sessions:
            raise CapacityExhausted(f"{self.config.max_sessions} sessions already open")
        self._check_caller_limit(caller)

    def _check_caller_limit(self, caller: str) -> None:
        limit = self.config.caller_limit
        held = sum(1 for session in self.sessions.values() if session.caller == caller)
        if held >= limit:
            raise CapacityExhausted(f"caller {caller or 'unknown'} already holds {held} sessions: the per-caller "
                                    f"limit is {limit} of {self.config.max_sessions}")

    def get(self, request_id: str) -> Session:
        session = self.sessions.get(request_id)
        if session is None:
            raise SessionNotFound(request_id)
        return session

    def warm_up(self, rows: int = 8) -> None:
        """A multi-row pass and a one-row pass on a throwaway cache, before serving.

        A model's first forwards pay one-time costs (kernel selection, allocator pools;
        seconds for bf16 on CPU) that must not land inside a request's deadline.
        """
        session = Session("warm-up", [0] * (rows + 1), self.new_cache(), SamplingParams(), torch.Generator())
        self.forward(session, [0] * rows, 1)
        self.forward(session, [0], 1)
        if self.ragged:  # and the path that batched steps take
            other = Session("warm-up-2", [0] * 3, self.new_cache(), SamplingParams(), torch.Generator())
            self._run_step([Part(session, [0], 1), Part(other, [0, 0], 1)])
        if self.graph is not None:
            self.graph.capture_common_shapes()

    def calibrate(self) -> StepCosts:
        """Measure what steps of 1..64 rows cost here, and larger ones up to the largest a step may take
        while they cost less than their rows' share (specmesh.engine.step_costs), and plan with it."""
        def forward_rows(rows: int) -> None:
            session = Session("calibration", [0] * (rows + 1), self.new_cache(), SamplingParams(), torch.Generator())
            part = Part(session, [0] * rows, 1)
            if self.graph is not None and self.graph.fits(part):
                self.graph.step([part])
            else:
                self._forward_rows(session, [0] * rows, 1)
        largest = min(self.config.max_step_tokens, self.context_window - 1)  # a calibration row and its next token
        self.costs = StepCosts.measure(forward_rows, largest=largest)
        return self.costs

    def _prefill_allowance(self, decode_rows: int, prefills: int) -> int:
        """Prefill rows the next step may add to its decode_rows.

        Streams between rounds have no rows in this step but will in the next ones, so
        the open sessions not prefilling count as decoding too: a long prompt is chunked
        whenever anything else is running, and only goes in whole on an idle engine.
        """
        decoding = max(decode_rows, len(self.sessions) - prefills)
        if decoding <= 0:
            return self.config.max_step_tokens
        if self.costs is None:
            return self.config.prefill_chunk
        return self.costs.prefill_allowance(decoding, self.config.prefill_slowdown, self.chunks.correction)

    def queued_prefill_rows(self) -> int:
        """Prompt rows the open sessions still have to feed (a decoding session's newest token aside)."""
        return sum(max(0, len(session.token_ids) - session.cached_length - 1)
                   for session in list(self.sessions.values()))

    def prefill_seconds(self, rows: int) -> float | None:
        """About how long `rows` more prompt rows take to feed here, at the rate seen (None: unknown)."""
        return self.prefill_rate.seconds_for(rows, self.costs)

    def _steer_chunks(self, parts: list[Part], step_ns: int) -> None:
        prefill = sum(len(part.token_ids) for part in parts if part.prefill)
        self.prefill_rate.observe(prefill, step_ns / 1e9)
        if self.costs is None:
            return
        rows = sum(len(part.token_ids) for part in parts)
        self.chunks.observe(rows - prefill, prefill, step_ns / 1e9, self.costs.planned_cost(rows + self._padding(rows)))

    def _track_step_costs(self, parts: list[Part], step_ns: int) -> None:
        """Fit the step-cost model (specmesh.engine.step_model) to decode-only steps (a prefill chunk over a
        long prompt is not what a decode step costs), at the size the step ran at, its padding included."""
        costs = self.costs
        if costs is None or any(part.prefill for part in parts):
            return
        if len(parts) > 1 and not self.ragged:  # solo forwards one after another: not one step of all rows
            return
        rows = sum(len(part.token_ids) for part in parts)
        attended = sum(len(part.token_ids) * part.session.cached_length for part in parts)
        costs.observe(StepShape(len(parts), rows + self._padding(rows), attended), step_ns / 1e9)

    def _run_step(self, parts: list[Part]) -> tuple[list[torch.Tensor | None], int]:
        """One step: the parts' rows in one forward; (logits per part, ns)."""
        start = time.perf_counter_ns()
        if self.graph is not None:
            return self._graph_step(parts), time.perf_counter_ns() - start
        if len(parts) == 1 or not self.ragged:  # solo forwards: exactly what one session alone gets
            logits = [self._solo(part) for part in parts]
        else:
            total = sum(len(part.token_ids) for part in parts)
            logits = ragged_forward(self.model, parts, self._padding(total), self.device, self.logits_device)
        return logits, time.perf_counter_ns() - start

    def _graph_step(self, parts: list[Part]) -> list[torch.Tensor | None]:
        """Decode rows as one static step (engine.graph_steps); prefill chunks and forks without a slot alone."""
        fitting = [part for part in parts if self.graph.fits(part)]
        graphed = dict(zip(map(id, fitting), self.graph.step(fitting) if fitting else []))
        return [graphed[id(part)] if id(part) in graphed else self._solo(part) for part in parts]

    def _solo(self, part: Part) -> torch.Tensor | None:
        """One part's logits from a forward of its own; a tree of rows (specmesh.engine.ragged.tree_ancestry) takes
        the segmented attention, the one path that masks and places rows other than as a chain."""
        if part.parents:
            return ragged_forward(self.model, [part], self._padding(len(part.token_ids)), self.device,
                                  self.logits_device)[0]
        return self.forward(part.session, part.token_ids, max(1, part.keep_rows))[0]

    @property
    def verifies_trees(self) -> bool:
        """Whether a Feed may carry a tree of rows (Feed.parents): the segmented attention runs, and the
        cache is a DynamicCache that a rollback crops (static graph steps' slots are not)."""
        return self.ragged and self.graph is None

    def close(self, request_id: str) -> bool:
        """Free the session; one not open (yet) is remembered, and its open refused (engine.closed_sessions)."""
        self.kv.release(request_id)  # its KV room, held from admission (admit)
        if self.sessions.pop(request_id, None) is not None:
            return True
        self.closed.add(request_id)
        return False

    def reap_idle(self, max_idle_s: float) -> list[str]:
        """Close sessions idle longer than max_idle_s (their orchestrator vanished)."""
        now = time.monotonic()
        stale = [rid for rid, s in self.sessions.items() if now - s.last_used > max_idle_s]
        for request_id in stale:
            self.close(request_id)
        return stale

    @torch.inference_mode()
    def forward(self, session: Session, token_ids: Sequence[int],
                keep_rows: int | None = None) -> tuple[torch.Tensor, int]:
        """Feed token_ids at the positions after the cache; return (logits, ns).

        logits [keep_rows, V] float32 on the CPU are those of the last keep_rows fed
        tokens (all of them when None): the output projection over a 150k-token
        vocabulary is costly, so rows nobody reads are not computed.
        """
        return self._forward_rows(session, token_ids, keep_rows, self._row_padding(session, len(token_ids)))

    @torch.inference_mode()
    def _forward_rows(self, session: Session, token_ids: Sequence[int], keep_rows: int | None = None,
                          padding: int = 0) -> tuple[torch.Tensor, int]:
        start = time.perf_counter_ns()
        n = len(token_ids)
        keep = n if keep_rows is None else max(1, min(keep_rows, n))
        input_ids = torch.tensor([list(token_ids) + [token_ids[-1]] * padding], dtype=torch.long,
                                 device=self.device)  # [1, n + padding]
        output = self.model(input_ids=input_ids, **cache_kwargs(self.model, session.cache), use_cache=True,
                            logits_to_keep=self._logit_rows(n, keep))
        if padding:
            session.cache.crop(-padding)
        logits = output.logits[0, :keep].float().cpu()  # [keep, V]; .cpu() also waits for the device
        session.last_used = time.monotonic()
        return logits, time.perf_counter_ns() - start

    def _row_padding(self, session: Session, n: int) -> int:
        padding = self._padding(n)
        fits = session.cached_length + n + padding <= self.context_window
        return padding if fits else 0

    def _padding(self, rows: int) -> int:
        """Rows to add to a forward of `rows` so that it runs at a cheaper measured size (calibrate).

        Trailing pad rows cannot change the real rows (attention is causal) and are dropped from the cache.
        """
        return self.costs.padding(rows) if self.costs is not None else 0

    def _logit_rows(self, n: int, keep: int) -> torch.Tensor:
        """Indices of the input's last `keep` real rows, the ones projected to logits (never a pad row).

        An index tensor, not transformers' int form: the int form slices a view that
        sends bf16 projections on CPU down a much slower path.
        """
        return torch.arange(n - keep, n, device=self.logits_device)

    def rollback(self, session: Session, position: int, append: Sequence[int] = (), cached: int = 0) -> None:
        """Truncate the sequence to `position` tokens, then append `append`.

        The cache keeps every entry below `position` (those tokens are unchanged), and the
        first `cached` appended tokens' entries where the caller knows the cache already holds
        exactly those tokens there (a verification's accepted drafts), but never covers the
        newest token, which the next forward must feed.
        """
        if not 0 < position <= len(session.token_ids):
            raise PositionMismatch(
                f"cannot roll back to position {position}: sequence has {len(session.token_ids)} tokens")
        self.check_token_ids("token_ids", append)
        session.token_ids[:] = committed_sequence(session.token_ids, position, append)
        keep = min(session.cached_length, position + max(0, cached), len(session.token_ids) - 1)
        surplus = session.cached_length - keep
        if surplus > 0:
            session.cache.crop(-surplus)  # negative = remove that many tokens from the end
