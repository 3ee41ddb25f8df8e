"""Where a decode round's time goes, per mode: draft, target, wire and the rest.

Served modes read the orchestrator's own round clocks (orchestrator.decoding.timing, exported as
`specmesh_round_time_seconds{part}` and `specmesh_spec_decode_draft_length`) from its /metrics
before and after each mode's requests; the peer's are timed by forward hooks on its two models
(orchestrator.bench.peer). Rounds after the first token only: the first is prefill on both sides.
"""

from __future__ import annotations

import asyncio
import urllib.parse
import urllib.request
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from orchestrator.decoding.timing import PARTS

# The samples parse_round_parts reads: a scrape asks /metrics for these alone (prometheus_client's name[]
# filter), so the orchestrator does not render every series twice a request while it is being measured.
ROUND_SAMPLES = ("specmesh_round_time_seconds_sum", "specmesh_round_time_seconds_count",
                 "specmesh_spec_decode_draft_length_sum")


@dataclass
class RoundParts:
    """Sums over rounds: seconds by part (orchestrator.decoding.timing.PARTS) and draft tokens proposed."""

    rounds: int = 0
    drafted: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))

    def __add__(self, other: "RoundParts") -> "RoundParts":
        return RoundParts(self.rounds + other.rounds, self.drafted + other.drafted,
                          {part: self.seconds[part] + other.seconds[part] for part in PARTS})

    def __sub__(self, other: "RoundParts") -> "RoundParts":
        return RoundParts(self.rounds - other.rounds, self.drafted - other.drafted,
                          {part: self.seconds[part] - other.seconds[part] for part in PARTS})

    @property
    def wall_s(self) -> float:
        s = self.seconds
        return s["draft_busy"] + s["target_busy"] - s["overlap"] + s["wire"] + s["idle"]

    def per_round(self, decode_s: float | None = None) -> dict | None:
        """Milliseconds a round by part, and draft tokens a round; with `decode_s`, the requests' time
        after their first token, also what a round took as the client saw it ("decode_ms") and the part
        of that outside the round's own clock ("between_ms": streaming, the loop between rounds).
        None without rounds."""
        if self.rounds <= 0:
            return None
        figures = {f"{part}_ms": self.seconds[part] * 1e3 / self.rounds for part in PARTS}
        wall_ms = self.wall_s * 1e3 / self.rounds
        figures = {"rounds": self.rounds, "drafted_per_round": self.drafted / self.rounds, "wall_ms": wall_ms,
                   **figures}
        if decode_s is not None:
            decode_ms = decode_s * 1e3 / self.rounds
            figures.update(decode_ms=decode_ms, between_ms=max(0.0, decode_ms - wall_ms))
        return figures


def parse_round_parts(text: str) -> RoundParts:
    """The orchestrator's round clocks from its /metrics text (every label set summed)."""
    parts = RoundParts()
    for family in text_string_to_metric_families(text):
        if family.name == "specmesh_round_time_seconds":
            for sample in family.samples:
                if sample.name.endswith("_sum") and sample.labels.get("part") in parts.seconds:
                    parts.seconds[sample.labels["part"]] += sample.value
                elif sample.name.endswith("_count") and sample.labels.get("part") == PARTS[0]:
                    parts.rounds += int(sample.value)
        elif family.name == "specmesh_spec_decode_draft_length":
            parts.drafted += int(sum(s.value for s in family.samples if s.name.endswith("_sum")))
    return parts


async def scrape_round_parts(metrics_url: str, timeout_s: float = 10.0) -> RoundParts | None:
    """None where the orchestrator's /metrics cannot be read: the run goes on without the breakdown."""
    query = urllib.parse.urlencode([("name[]", name) for name in ROUND_SAMPLES])
    url = f"{metrics_url}{'&' if '?' in metrics_url else '?'}{query}"

    def fetch() -> str:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310 - our own stack
            return response.read().decode("utf-8")
    try:
        return parse_round_parts(await asyncio.to_thread(fetch))
    except (OSError, ValueError):
        return None


class ByMode:
    """Round parts by mode, over the stretches when a mode has requests in flight (modes never overlap:
    run_modes runs one mode's requests at a time), from a `snapshot(mode)` of cumulative parts (None where
    there is none to read: that stretch is left out)."""

    def __init__(self, snapshot):
        self.snapshot = snapshot  # async (mode) -> RoundParts | None, cumulative
        self.parts: dict[str, RoundParts] = {}
        self._in_flight: dict[str, int] = {}
        self._before: dict[str, RoundParts] = {}
        self._gate = asyncio.Lock()

    async def enter(self, mode: str) -> None:
        async with self._gate:  # the first request of a stretch takes the baseline before any other starts
            if not self._in_flight.get(mode):
                self._before[mode] = await self.snapshot(mode)
            self._in_flight[mode] = self._in_flight.get(mode, 0) + 1

    async def leave(self, mode: str) -> None:
        async with self._gate:
            self._in_flight[mode] -= 1
            if not self._in_flight[mode]:
                before, after = self._before.pop(mode), await self.snapshot(mode)
                if before is not None and after is not None:
                    self.parts[mode] = self.parts.get(mode, RoundParts()) + (after - before)

    def take(self) -> dict[str, RoundParts]:
        """The parts gathered since the last take (a configuration's), by mode."""
        parts, self.parts = self.parts, {}
        return parts
