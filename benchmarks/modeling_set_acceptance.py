"""A Qwen2 model whose greedy token is set by rule: the benchmark pair of `set_acceptance_pair.py`.

Copied into each model directory the builder writes, and loaded from there as a user loads a custom
architecture (`--trust-remote-code`): it imports nothing but torch, transformers and the standard library.

Each forward runs the real Qwen2 network (so a step costs what a model of its shape costs), then puts
every kept row's top logit on a token chosen from the row's input token and position:

- the target (`set_acceptance_role` "target") on next(token, position), a hash over the ordinary
  (non-special) token ids, so its greedy output is a walk no prompt or batch layout can change;
- a draft (`set_acceptance_role` "draft") on the same token with probability alpha (a second hash of
  the pair below alpha), otherwise on another ordinary token.

So a draft's greedy proposal agrees with the target's greedy token at rate alpha at every position,
in specmesh and in transformers' assisted generation alike. The other logits stay the network's own,
so the forward's work is never dead code to a compiler.

Emulated GPU step times (benchmark-only; `set_acceptance_pair.py --profile NAME`): with a `step_profile`
in the config (a table of benchmarks/gpu_profiles.py), each forward runs the lean part of the model (the
cache grows, the kept rows' embeddings are projected and steered; `lean_forward`, and `lean_ragged_forward`
for a ragged step of several sessions), then sleeps up to the time the table gives a GPU step of its rows
and sessions (less the oversleep measured so far, so that steps take the table's time on average). The step
time is then emulated, not measured: the sleep releases the GIL and leaves the CPU free, as the host of a
GPU is while its kernels run. A forward whose real compute exceeds the table's time does not sleep; it counts
in `emulation_overruns` (and warns once): such a run is not a faithful emulation, and says so.
"""

from __future__ import annotations

import logging
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.modeling_outputs import CausalLMOutputWithPast

MASK_31 = 0x7FFFFFFF  # hashes stay in 31 bits: an int64 product of two never overflows
# Rows a forward steers with Python ints instead of tensor ops: the same hash, exactly (no int64 product
# overflows), without the hundred tensor dispatches a draft step's one row would cost the host's CPU.
SCALAR_STEER_ROWS = 64
MIX_ROUNDS = ((1103515245, 12345), (214013, 2531011), (1664525, 1013904223))
AGREE_SALT = 0x2545F491  # the draft's agree-or-not draw
OTHER_SALT = 0x5BD1E995  # which other token a disagreeing draft proposes
OVERSLEEP_WEIGHT = 0.1  # of one padded step in the estimate of how much longer time.sleep sleeps than asked

log = logging.getLogger(__name__)


class SetAcceptanceConfig(Qwen2Config):
    model_type = "set_acceptance_qwen2"

    def __init__(self, set_acceptance_role: str = "target", alpha: float = 1.0, steer_low: int = 0,
                 steer_high: int = 2, steer_seed: int = 0, steer_margin: float = 30.0,
                 step_profile: dict | None = None, **kwargs):
        self.set_acceptance_role = set_acceptance_role
        self.alpha = alpha
        self.steer_low = steer_low  # ordinary token ids: [steer_low, steer_high)
        self.steer_high = steer_high
        self.steer_seed = steer_seed
        self.steer_margin = steer_margin  # nats above the row's top logit: one token under sampling too
        self.step_profile = step_profile  # {"points": [[rows, ms], ...], "per_session_ms": ms}; None: no padding
        super().__init__(**kwargs)


def mix(x: torch.Tensor) -> torch.Tensor:
    """A 31-bit integer hash of a non-negative int64 tensor below 2**31, identical on every device (and on a
    Python int)."""
    for multiplier, increment in MIX_ROUNDS:
        x = (x * multiplier + increment) & MASK_31
        x = x ^ (x >> 13)
    return x


def target_next(tokens: torch.Tensor, positions: torch.Tensor, config: SetAcceptanceConfig) -> torch.Tensor:
    """The target's greedy token after `tokens` at `positions` (int64 tensors of one shape, or Python ints)."""
    return walk_token(pair_key(tokens, positions, config), config)


def walk_token(key: torch.Tensor, config: SetAcceptanceConfig) -> torch.Tensor:
    return config.steer_low + key % (config.steer_high - config.steer_low)


def pair_key(tokens: torch.Tensor, positions: torch.Tensor, config: SetAcceptanceConfig) -> torch.Tensor:
    return mix(mix((positions + config.steer_seed) & MASK_31) ^ (tokens & MASK_31))


def draft_next(tokens: torch.Tensor, positions: torch.Tensor, config: SetAcceptanceConfig) -> torch.Tensor:
    """The target's token where a draw of the pair falls below alpha, another ordinary token elsewhere."""
    span = config.steer_high - config.steer_low
    key = pair_key(tokens, positions, config)
    draw = mix(key ^ AGREE_SALT)
    agrees = (draw.double() if isinstance(draw, torch.Tensor) else float(draw)) / float(MASK_31 + 1) < config.alpha
    offset = 1 + mix(key ^ OTHER_SALT) % max(1, span - 1)  # 1..span-1: never the target's token
    other = config.steer_low + (key % span + offset) % span
    if isinstance(agrees, bool):
        return walk_token(key, config) if agrees else other
    return torch.where(agrees, walk_token(key, config), other)


def kept_rows(values: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """values [batch, seq] -> the rows whose logits the forward kept, shaped as the logits' leading dims."""
    if isinstance(logits_to_keep, torch.Tensor):
        if logits_to_keep.ndim == 2 and logits_to_keep.dtype == torch.bool:
            return values[logits_to_keep]  # [kept]
        if logits_to_keep.ndim == 2:
            return torch.take_along_dim(values, logits_to_keep.to(values.device), dim=1)
        return values[:, logits_to_keep.to(values.device)]
    return values[:, -logits_to_keep:] if logits_to_keep else values


def emulated_step_ms(profile: dict, rows: int, sessions: int) -> float:
    """A `step_profile`'s time for a step: its (rows, ms) points interpolated linearly, flat before the
    first, the last segment extended past the last; plus per_session_ms for each session after the
    first. The same rule as gpu_profiles.StepTable.ms (this file cannot import it: it is copied alone)."""
    points = profile["points"]
    upper = next((i for i, (x, _) in enumerate(points) if rows <= x), len(points) - 1)
    if upper == 0:  # at or before the first point (or the only one)
        ms = points[0][1]
    else:
        (x0, y0), (x1, y1) = points[upper - 1], points[upper]
        ms = y0 + (y1 - y0) * (rows - x0) / (x1 - x0)
    return ms + profile.get("per_session_ms", 0.0) * max(0, sessions - 1)


def step_shape(input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None, segments) -> tuple[int, int]:
    """(rows, sessions) of a forward: every input row, padding included; the session segments of a
    ragged step (specmesh.engine.ragged passes `segments`; padding segments have no cache), else the batch."""
    shape = input_ids.shape if input_ids is not None else inputs_embeds.shape[:-1]  # [batch, seq]
    if segments is not None:
        return shape.numel(), sum(segment.cache is not None for segment in segments)
    return shape.numel(), shape[0]


class SetAcceptanceForCausalLM(Qwen2ForCausalLM):
    config_class = SetAcceptanceConfig

    def __init__(self, config: SetAcceptanceConfig):
        super().__init__(config)
        self.emulated_steps = 0  # forwards padded to the step profile
        self.emulation_overruns = 0  # forwards whose real compute took longer than the profile's time
        # How much longer than asked time.sleep has slept here (timer slack, the wake-up): a padded step asks
        # for that much less, so that steps take the profile's time on average, not 0.1-0.2 ms more each.
        self.oversleep_s = 0.0

    def forward(self, input_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                cache=None, logits_to_keep: int | torch.Tensor = 0, **kwargs):
        if self.config.step_profile is None:
            return self.steered_forward(input_ids, position_ids, cache, logits_to_keep, **kwargs)
        started = time.perf_counter()
        if input_ids is None:
            output = self.steered_forward(input_ids, position_ids, cache, logits_to_keep, **kwargs)
        elif kwargs.get("segments") is not None:
            output = self.lean_ragged_forward(input_ids, position_ids, logits_to_keep, kwargs["segments"])
        else:
            output = self.lean_forward(input_ids, position_ids, cache, logits_to_keep, **kwargs)
        if output.logits.is_cuda:  # kernels run asynchronously: wait for them before reading the clock
            torch.cuda.synchronize(output.logits.device)
        rows, sessions = step_shape(input_ids, kwargs.get("inputs_embeds"), kwargs.get("segments"))
        self.pad_step(started, emulated_step_ms(self.config.step_profile, rows, sessions) / 1e3)
        return output

    def pad_step(self, started: float, step_s: float) -> None:
        """Sleep until `step_s` after `started`; count (and warn once of) a forward that took longer."""
        self.emulated_steps += 1
        remaining = step_s - (time.perf_counter() - started)
        if remaining > 0:
            asked = max(0.0, remaining - self.oversleep_s)
            before = time.perf_counter()
            time.sleep(asked)  # releases the GIL: the CPU stays free for the services around the model
            over = time.perf_counter() - before - asked
            self.oversleep_s += OVERSLEEP_WEIGHT * (over - self.oversleep_s)
            return
        self.emulation_overruns += 1
        if self.emulation_overruns == 1:
            log.warning("emulated step overrun: the real forward took %.2f ms, the profile's step %.2f ms; "
                        "step times are not faithfully emulated (see emulation_overruns)",
                        (step_s - remaining) * 1e3, step_s * 1e3)

    def lean_forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None, cache,
                     logits_to_keep: int | torch.Tensor, **kwargs):
        """A padded step without the network: the cache grows by the fed rows (zero keys and values) and the
        kept rows' logits are the output projection of their embeddings, steered as ever. A GPU step's time is
        the profile's sleep; the network's CPU time would stand in for work a GPU host's CPU does not do, and
        on a small host it crowds out the services. The chosen token leads by steer_margin either way, so the
        tokens are the network's own (greedy; sampled, to within e^-steer_margin)."""
        cache = cache if cache is not None else kwargs.get("past_key_values")
        past = cache.get_seq_length() if cache is not None else 0  # before this forward
        if cache is not None:
            self.grow_cache(cache, input_ids.shape[0], input_ids.shape[1], input_ids.device)
        if position_ids is None:
            position_ids = (past + torch.arange(input_ids.shape[1], device=input_ids.device)).expand_as(input_ids)
        tokens = kept_rows(input_ids, logits_to_keep)  # [batch, kept]
        positions = kept_rows(position_ids.to(input_ids.device).expand_as(input_ids), logits_to_keep)
        logits = self.lm_head(self.model.embed_tokens(tokens))  # [batch, kept, V]
        return CausalLMOutputWithPast(logits=self.steer(logits, tokens, positions), past_key_values=cache)

    def lean_ragged_forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                            logits_to_keep: torch.Tensor, segments) -> CausalLMOutputWithPast:
        """lean_forward for a ragged step (specmesh.engine.ragged): input_ids and position_ids [1, T], every
        session's new rows; each segment's session cache grows by its rows, the kept rows are projected and
        steered. Without it a step of 64 sessions would run the small network's per-session attention, CPU
        time that stands in for GPU work and would crowd the services out of a small host."""
        for segment in segments:
            if segment.cache is not None:
                self.grow_cache(segment.cache, 1, segment.rows, input_ids.device)
        tokens = kept_rows(input_ids, logits_to_keep)  # [1, kept]
        positions = kept_rows(position_ids.to(input_ids.device), logits_to_keep)
        logits = self.lm_head(self.model.embed_tokens(tokens))  # [1, kept, V]
        return CausalLMOutputWithPast(logits=self.steer(logits, tokens, positions))

    def grow_cache(self, cache, batch: int, rows: int, device: torch.device) -> None:
        """Every layer of `cache` grows by `rows` positions of zero keys and values."""
        config = self.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        empty = torch.zeros((batch, config.num_key_value_heads, rows, head_dim), dtype=self.dtype,
                            device=device)  # [batch, kv heads, rows, dim]
        for layer in range(config.num_hidden_layers):
            cache.update(empty, empty, layer)

    def steered_forward(self, input_ids: torch.Tensor | None, position_ids: torch.Tensor | None, cache,
                        logits_to_keep: int | torch.Tensor, **kwargs):
        cache = cache if cache is not None else kwargs.pop("past_key_values", None)
        past = cache.get_seq_length() if position_ids is None and cache is not None else 0  # before this forward
        output = super().forward(input_ids=input_ids, position_ids=position_ids, cache=cache,
                                 logits_to_keep=logits_to_keep, **kwargs)
        if input_ids is None:
            return output
        if position_ids is None:
            position_ids = (past + torch.arange(input_ids.shape[1], device=input_ids.device)).expand_as(input_ids)
        tokens = kept_rows(input_ids, logits_to_keep)
        positions = kept_rows(position_ids.to(input_ids.device).expand_as(input_ids), logits_to_keep)
        output.logits = self.steer(output.logits, tokens, positions)
        return output

    def steer(self, logits: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """logits [..., V]: each row's chosen token lifted steer_margin above the row's top logit."""
        rule = target_next if self.config.set_acceptance_role == "target" else draft_next
        if tokens.numel() <= SCALAR_STEER_ROWS:
            chosen = torch.tensor([rule(token, position, self.config) for token, position in
                                   zip(tokens.flatten().tolist(), positions.flatten().tolist())],
                                  dtype=torch.long).view(tokens.shape)
        else:
            chosen = rule(tokens.long(), positions.long(), self.config)
        chosen = chosen.to(logits.device).unsqueeze(-1)  # [..., 1]
        lifted = logits.amax(dim=-1, keepdim=True) + self.config.steer_margin
        return logits.scatter(-1, chosen, lifted.to(logits.dtype))
