"""A session: one generation's sequence and KV cache in a model service (specmesh.engine.model_engine runs them).

Its `token_ids` are the sequence at absolute positions 0..len-1, and its KV cache covers a prefix
of them (never the newest token, which the next forward feeds).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import torch
from transformers import Cache

from specmesh.errors import StaleRound
from specmesh.engine.penalties import penalize_logits
from specmesh.engine.sampling_params import SamplingParams


@dataclass
class Session:
    request_id: str
    token_ids: list[int]  # the sequence; token_ids[i] sits at position i
    cache: Cache  # a DynamicCache, or a slot of preallocated KV (specmesh.engine.slot_cache)
    sampling: SamplingParams
    generator: torch.Generator
    round: int = 0  # highest round seen; older rounds are stale
    last_used: float = field(default_factory=time.monotonic)
    seed: int = 0  # seeds generators derived per position (specmesh.engine.sampling.generator_at)
    ahead: object | None = None  # a service's own state that lives and dies with the session
    caller: str = ""  # who opened it (specmesh.server.security.caller_of), for the per-caller limit
    output_start: int = 0  # position of the first generated token (penalties count from here)

    @property
    def cached_length(self) -> int:
        return self.cache.get_seq_length()

    @property
    def uncached_tail(self) -> list[int]:
        """The tokens the cache does not cover yet: the next forward feeds them."""
        return self.token_ids[self.cached_length:]

    def enter_round(self, round_number: int) -> None:
        """Refuse work from a round older than one already seen (pipelined leftovers)."""
        if round_number < self.round:
            raise StaleRound(f"round {round_number} is stale: session is at round {self.round}")
        self.round = round_number
        self.last_used = time.monotonic()

    def penalize(self, logits: torch.Tensor, position: int | None = None,
                 draft_ids: Sequence[int] = ()) -> torch.Tensor:
        """The request's penalties and biases on logits [n, V] -> [n, V].

        Row i predicts the token after token_ids[:position] + draft_ids[:i]
        (position None: after the whole sequence).
        """
        history = self.token_ids if position is None else self.token_ids[:position]
        return penalize_logits(logits, history, self.output_start, self.sampling, draft_ids)
