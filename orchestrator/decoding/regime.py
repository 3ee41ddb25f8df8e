"""Whether drafting pays at the current load, learned from what rounds delivered with and without it.

Alone, a request's round is priced well by the services' start-up tables: they time one
session's step, which is what a lone request runs. Beside other requests it is not: a step
of several sessions runs another path (their caches joined, a 4-D mask), and a draft and a
target on the same cores slow each other's steps. Priced from the tables, speculation on
ran at 0.80-0.91x off at concurrency 2-16 (README, "Measured under load"). So once more
than one request decodes, the choice between the two regimes, drafting (each request at
the k its policy picks) and target-only, is made from measurement:

- requests in flight (from arrival, their prefill included) are bucketed by load (2, 3-4,
  5-8, 9-16, ...);
- per bucket and regime, the committed tokens per second of a request's rounds, summed
  over a window of rounds (a few rounds of every request);
- the better regime runs; the other is tried again for one window after `retry_every`
  windows, an interval that doubles while it keeps losing, and takes over only if it does
  better by `margin`. A regime's first round for a request is not counted: it was planned
  under the other one. Nor is drafting's first window after a switch: it is the drafts' way in
  (each request's draft prefills its sequence, then catches up, its rounds out of phase with the
  others), paid once, not what drafting delivers. On the embedded pair at 4 requests, rounds in
  phase took 0.41 s for about 7 tokens where target-only took 0.30 s for 4 (1.25x), but every
  trial's one window ended within two rounds of the drafts stepping in phase, measured their way
  in, and lost (0.72x; step log 2026-11-26 11:50);
- a bucket met for the first time starts from its neighbours: past a lighter load where
  target-only won, or below a heavier one where drafting won, it starts in that regime and
  measures the other only after `retry_every` windows (more load only makes drafting pay
  less). Without such a neighbour it starts target-only and tries drafting after one window:
  a load met for the first time is often a burst of arrivals whose prefills the draft's own
  prefills would slow (speculation on ran its first tokens 35 % later than off at
  concurrency 16 when a new load started drafting);
- a drafting trial is skipped where the services' tables, scaled by how far they missed at
  the nearest lighter load measured (unscaled where none was), forecast that drafting loses
  (`drafting_doubtful`; the forecast is the mean over the requests decoding), or where it was
  forecast to lose at a lighter load: on the embedded pair a trial at concurrency 4 cost more than drafting there
  ever won, and one at 8 ran at 0.62x.

The regime decides only whether a round may draft, before its draft is sampled, so the
output is unchanged (orchestrator.decoding.policy).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Callable

log = logging.getLogger(__name__)

# Forecast from the services' tables (the policy's costs and acceptance): tokens per second of a
# given number of requests drafting in phase, over the same requests target-only; None unknown.
Forecast = Callable[[int], "float | None"]

RATE_WEIGHT = 0.5  # of a window's rate in its regime's estimate: loads shift, follow them


@dataclass(frozen=True)
class RegimeConfig:
    window_rounds: int = 5  # a window: this many rounds of every request decoding
    margin: float = 0.03  # a regime takes over only for at least 3 % more tokens per second
    retry_every: int = 4  # windows in the winning regime before the other is measured again ...
    max_retry_every: int = 64  # ... the interval doubling, up to this, while it keeps losing


def load_bucket(active: int) -> int:
    """0 for a request alone, then 1 for 2 requests, 2 for 3-4, 3 for 5-8, ..."""
    return 0 if active <= 1 else math.ceil(math.log2(active))


@dataclass
class LoadRegime:
    """One load bucket: its current regime and what each regime delivered when last measured."""

    config: RegimeConfig
    drafting: bool = False
    epoch: int = 0  # regime switches so far: a round planned in an older epoch is not counted
    rates: dict[bool, float | None] = field(default_factory=lambda: {True: None, False: None})
    tokens: float = 0.0  # of the window in progress
    seconds: float = 0.0
    rounds: int = 0
    windows: int = 0  # completed in the current regime since it was entered
    trying: bool = False  # the current regime is a challenger on trial for one window
    retry_every: int = 0
    inherited: bool = False  # started in a neighbour's winning regime: the other waits its turn
    settling: bool = False  # the window in progress is drafting's way in after a switch: not counted

    def __post_init__(self):
        self.retry_every = self.config.retry_every

    def observe(self, tokens: int, seconds: float, active: int,
                drafting_doubtful: Callable[[], bool] = lambda: False) -> None:
        self.tokens += tokens
        self.seconds += seconds
        self.rounds += 1
        if self.rounds >= self.config.window_rounds * max(active, 1):
            self._close_window(drafting_doubtful)

    def _close_window(self, drafting_doubtful: Callable[[], bool]) -> None:
        if self.settling:  # drafts opened and caught up in this window: the next one measures drafting
            self.settling = False
            self._start_window()
            return
        rate = self.tokens / max(self.seconds, 1e-9)
        previous = self.rates[self.drafting]
        self.rates[self.drafting] = rate if previous is None else previous + RATE_WEIGHT * (rate - previous)
        self._start_window()
        self.windows += 1
        mine, other = self.rates[self.drafting], self.rates[not self.drafting]
        ahead = other is not None and mine > other * (1.0 + self.config.margin)
        behind = other is not None and other > mine * (1.0 + self.config.margin)
        if self.trying:  # a challenger's window: it takes over only if clearly ahead
            self.trying = False
            if ahead:
                self.retry_every = self.config.retry_every
            else:
                self._switch(trying=False)
        elif behind:
            self._switch(trying=True)  # it did better when last measured
        elif (other is None and not self.inherited) or self.windows >= self.retry_every:
            if other is not None:  # still ahead: look at the other again, less often
                self.retry_every = min(2 * self.retry_every, self.config.max_retry_every)
            if self.drafting or not drafting_doubtful():
                self._switch(trying=True)
            else:  # a drafting trial is forecast to lose here: ask again after the next interval
                self.windows = 0

    @property
    def winner(self) -> bool | None:
        """The regime that delivered more here, once both were measured."""
        if self.rates[True] is None or self.rates[False] is None:
            return None
        return self.rates[True] > self.rates[False]

    def _switch(self, trying: bool) -> None:
        self.trying = trying
        self.drafting = not self.drafting
        self.settling = self.drafting
        self.epoch += 1
        self.windows = 0
        self._start_window()

    def _start_window(self) -> None:
        self.tokens = self.seconds = 0.0
        self.rounds = 0


@dataclass
class RegimeChoice:
    """What a round was planned under: its bucket, regime and epoch."""

    bucket: int
    drafting: bool
    epoch: int


class LoadRegimes:
    """The orchestrator-wide regime of each load bucket (a request alone always drafts as its policy says)."""

    def __init__(self, config: RegimeConfig = RegimeConfig()):
        self.config = config
        self.buckets: dict[int, LoadRegime] = {}
        self._verdicts: dict[int, bool] = {}  # the latest drafting_doubtful of each bucket, for its log

    def choice(self, active: int) -> RegimeChoice:
        bucket = load_bucket(active)
        if bucket == 0:
            return RegimeChoice(0, True, 0)
        regime = self.buckets.get(bucket) or self._first_met(bucket)
        return RegimeChoice(bucket, regime.drafting, regime.epoch)

    def _first_met(self, bucket: int) -> LoadRegime:
        regime = self.buckets[bucket] = LoadRegime(self.config)
        lighter = [b for b in self.buckets if b < bucket and self.buckets[b].winner is not None]
        heavier = [b for b in self.buckets if b > bucket and self.buckets[b].winner is not None]
        if lighter and self.buckets[max(lighter)].winner is False:
            regime.inherited = True
        elif heavier and self.buckets[min(heavier)].winner is True:
            regime.drafting, regime.inherited = True, True
        return regime

    def observe(self, choice: RegimeChoice, previous: RegimeChoice | None, tokens: int, seconds: float,
                active: int, forecast: Forecast | None = None) -> None:
        """A round's committed tokens and seconds, planned under `choice`; `previous`: the request's
        round before it (a round right after a switch was planned under the other regime's batch)."""
        regime = self.buckets.get(choice.bucket)
        if regime is None or choice.epoch != regime.epoch:
            return
        if previous is None or previous.bucket != choice.bucket or previous.epoch != choice.epoch:
            return
        regime.observe(tokens, seconds, active, lambda: self.drafting_doubtful(choice.bucket, forecast))

    def drafting_doubtful(self, bucket: int, forecast: Forecast | None) -> bool:
        """Whether drafting is forecast to lose at `bucket`: the tables' forecast for its load, scaled by
        how far the forecast missed at the nearest lighter load where both regimes were measured.

        A trial is not free: every request opens its draft (a prefill of its whole sequence) and its
        rounds run slow until the drafts step in phase. The tables alone price drafting under load
        too well (module docstring), but by a factor that the lighter load measured: on the embedded
        pair drafting delivered 0.71-0.73x at 4 requests where the forecast said 0.96-1.50x, so at 8
        (0.93-1.35x) it would lose; with its trials speculation had run at 0.85-0.89x off at 8."""
        measured = [b for b, r in self.buckets.items() if b < bucket and r.winner is not None]
        judged = [b for b, doubtful in self._verdicts.items() if b < bucket and doubtful]
        if judged and (not measured or max(judged) > max(measured)):
            # More load only makes drafting pay less: where it was forecast to lose at a lighter load
            # (and not tried there), it loses here. Scaled from the lighter load measured instead, the
            # embedded pair's first trial at 8 requests ran at 0.62x while 4 had been judged not worth one.
            self._log_verdict(bucket, True, "drafting not tried (forecast to lose at %d requests)", 2 ** max(judged))
            return True
        if forecast is None:
            return False
        if not measured:
            return self._unscaled_verdict(bucket, forecast)
        nearest = max(measured)
        # Each bucket priced at the heaviest load it holds (2, 4, 8, ...), not at the load of its
        # latest round: a request's last round runs with fewer beside it than it was planned with.
        forecast_here, forecast_there = forecast(2 ** bucket), forecast(2 ** nearest)
        if not forecast_here or not forecast_there:
            return False
        delivered_there = self.buckets[nearest].rates[True] / self.buckets[nearest].rates[False]
        expected = forecast_here * delivered_there / forecast_there
        return self._forecast_verdict(bucket, expected,
                                      "forecast %.2fx; %.2fx at %d requests, where it delivered %.2fx",
                                      forecast_here, forecast_there, 2 ** nearest, delivered_there)

    def _unscaled_verdict(self, bucket: int, forecast: Forecast) -> bool:
        """With no lighter load measured both ways, the tables' own forecast for the load decides. They
        price drafting under load too well, never too badly, so where even they forecast a loss a trial
        can only pay its way in: a fresh server on the embedded pair that met 16 requests first tried
        drafting there after one window, and ran that pass at 0.82x off."""
        here = forecast(2 ** bucket)
        if not here:
            return False
        return self._forecast_verdict(bucket, here, "forecast %.2fx, no lighter load measured", here)

    def _forecast_verdict(self, bucket: int, expected: float, reason: str, *args) -> bool:
        """Whether drafting is doubtful at `bucket` where it is expected to deliver `expected` x
        target-only: short of the margin. Logged with `reason`."""
        doubtful = expected < 1.0 + self.config.margin
        self._log_verdict(bucket, doubtful, "drafting %s (" + reason + ")", "not tried" if doubtful else "tried", *args)
        return doubtful

    def _log_verdict(self, bucket: int, doubtful: bool, message: str, *args) -> None:
        """Record the bucket's verdict; log it at INFO when it is news (it is asked every window while
        drafting was never measured there)."""
        level = logging.DEBUG if self._verdicts.get(bucket) == doubtful else logging.INFO
        self._verdicts[bucket] = doubtful
        log.log(level, "%d requests: " + message, 2 ** bucket, *args)
