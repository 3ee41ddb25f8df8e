"""The figures of one cell of the regime benchmark (benchmarks/regime.py), its bound, its table and its plot.

A cell is one (profile, alpha, placement, round trip, bandwidth, concurrency, temperature) served run. Its
figures come from three places, all read over the same stretch of the run: the bench's result (tokens/s,
a round's parts), the orchestrator's /metrics (rounds, committed tokens, pre-draft hits) and the services'
/metrics (their busy time), and the links' counters (bytes on the wire). Every time is emulated: the
models' steps are padded to the profile's (benchmarks/gpu_profiles.py), the links delay what they carry.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from benchmarks.gpu_profiles import StepTable
from benchmarks.regime_bound import pipelined_bound, sequential_bound
from orchestrator.cli.stats_view import fetch_metrics

ORCHESTRATOR_COUNTERS = {  # what a cell reads of the orchestrator's /metrics
    "rounds": ("specmesh_round_time_seconds_count", {"part": "draft_busy"}),
    "tokens": ("specmesh_generation_tokens_total", {}),
    "drafting_rounds": ("specmesh_spec_decode_num_drafts_total", {}),
    "hits": ("specmesh_predraft_hits_total", {}),
    "misses": ("specmesh_predraft_misses_total", {}),
}
SERVICE_BUSY = "specmesh_step_busy_seconds_total"
SERVICE_STEPS, SERVICE_SESSIONS = "specmesh_step_sessions_count", "specmesh_step_sessions_sum"  # steps; sessions in them


def scrape(url: str, timeout_s: float = 10.0) -> list[tuple[str, dict, float]]:
    """Every sample of a /metrics page: (name, labels, value)."""
    text = fetch_metrics(url, timeout_s)
    return [(s.name, s.labels, s.value) for family in text_string_to_metric_families(text) for s in family.samples]


def total(samples: list[tuple[str, dict, float]], name: str, labels: dict | None = None) -> float:
    """The sum of a metric's samples whose labels include `labels`."""
    wanted = (labels or {}).items()
    return sum(value for sample, sample_labels, value in samples if sample == name and wanted <= sample_labels.items())


@dataclass(frozen=True)
class Counts:
    """Cumulative counters of a running stack at one moment."""

    rounds: float
    tokens: float
    drafting_rounds: float  # rounds that verified draft-model tokens
    hits: float
    misses: float
    target_busy_s: float
    draft_busy_s: float
    target_steps: float
    target_step_sessions: float  # summed over the target's steps: how many sessions each carried
    wire_bytes: float  # both directions of every link
    cpu_s: dict[str, float]  # CPU time by process of the stack

    @property
    def sessions_per_target_step(self) -> float:
        """The sessions a target step carried, on average: the bound has every session in flight on a target
        board each of its steps."""
        return self.target_step_sessions / max(1.0, self.target_steps)

    def __sub__(self, other: "Counts") -> "Counts":
        scalars = {f: getattr(self, f) - getattr(other, f) for f in self.__dataclass_fields__ if f != "cpu_s"}
        return Counts(**scalars, cpu_s={name: self.cpu_s[name] - other.cpu_s.get(name, 0.0) for name in self.cpu_s})


def read_counts(orchestrator_url: str, target_urls: list[str], draft_urls: list[str], links: dict[str, dict],
                cpu_s: dict[str, float]) -> Counts:
    """The stack's counters now; the services' busy time (and the targets' steps) summed over every service of
    a role."""
    orchestrator = scrape(orchestrator_url)
    values = {key: total(orchestrator, name, labels) for key, (name, labels) in ORCHESTRATOR_COUNTERS.items()}
    targets = [scrape(url) for url in target_urls]
    return Counts(**values, target_busy_s=sum(total(samples, SERVICE_BUSY) for samples in targets),
                  draft_busy_s=sum(total(scrape(url), SERVICE_BUSY) for url in draft_urls),
                  target_steps=sum(total(samples, SERVICE_STEPS) for samples in targets),
                  target_step_sessions=sum(total(samples, SERVICE_SESSIONS) for samples in targets),
                  wire_bytes=sum(link["bytes_up"] + link["bytes_down"] for link in links.values()), cpu_s=cpu_s)


@dataclass(frozen=True)
class Regime:
    """What the bound of a cell is computed from: the profile's tables (scaled) and the links' delays."""

    alpha: float
    target: StepTable
    draft: StepTable
    concurrency: int
    rtt_draft_s: float
    rtt_target_s: float
    draft_concurrency: int = 0  # sessions each draft steps at once where they differ from the target's (0: the same)

    def target_s(self, rows_per_session: int) -> float:
        """A step of every session in flight, each with these rows (sessions decode in lockstep)."""
        c = self.concurrency
        return self.target.ms(rows_per_session * c, c) / 1e3

    def draft_s(self) -> float:
        c = self.draft_concurrency or self.concurrency
        return self.draft.ms(c, c) / 1e3

    def bounds(self, hit: float) -> dict:
        """The best speedup any k allows over target-only with zero overhead: sequential, pipelined at the
        measured pre-draft hit rate, and pipelined at h = 1 (the ceiling)."""
        args = (self.alpha, self.target_s, self.draft_s(), self.rtt_draft_s, self.rtt_target_s)
        sequential, k_seq = sequential_bound(*args)
        pipelined, k_pipe = pipelined_bound(*args, hit=hit)
        ceiling, k_ceiling = pipelined_bound(*args, hit=1.0)
        return {"bound_sequential": sequential, "bound_sequential_k": k_seq, "bound_pipelined": pipelined,
                "bound_pipelined_k": k_pipe, "bound_pipelined_h1": ceiling, "bound_pipelined_h1_k": k_ceiling}

    def critical_path_ms(self, drafting: float, k: float, hit: float) -> float:
        """What a round takes with zero overhead, on average: the profile's steps and the links' round trips
        on its critical path, where a share `drafting` of the rounds drafted k tokens on average (the rest
        were target-only) and a pre-draft hit hid the draft behind the target."""
        target_only = self.target_s(1) + self.rtt_target_s
        if drafting <= 0 or k <= 0:
            return target_only * 1e3
        verify = self.target_s(max(1, round(k + 1))) + self.rtt_target_s
        draft = k * self.draft_s() + self.rtt_draft_s
        drafted = hit * max(verify, draft) + (1 - hit) * (verify + draft)
        return ((1 - drafting) * target_only + drafting * drafted) * 1e3


def cell_figures(mode: dict, counts: Counts, regime: Regime, baseline_tok_s: float | None) -> dict:
    """One served mode's figures: tokens/s, speedup, bounds, bytes, a round's breakdown and its overhead."""
    overall, parts = mode["overall"], mode.get("round_parts") or {}
    rounds = max(1.0, counts.rounds)
    hit = counts.hits / (counts.hits + counts.misses) if counts.hits + counts.misses else 0.0
    tok_s = overall["output_throughput"]
    drafted = parts.get("drafted_per_round", 0.0)
    figures = {
        "tokens_per_s": tok_s, "speedup": tok_s / baseline_tok_s if baseline_tok_s else None,
        "acceptance_rate": overall.get("acceptance_rate"), "tokens_per_round": counts.tokens / rounds,
        "predraft_hit_rate": hit, "bytes_per_round": counts.wire_bytes / rounds,
        "bytes_per_token": counts.wire_bytes / max(1.0, counts.tokens),
        "target_busy_ms_per_token": counts.target_busy_s * 1e3 / max(1.0, counts.tokens),
        "draft_busy_ms_per_token": counts.draft_busy_s * 1e3 / max(1.0, counts.tokens),
        "sessions_per_target_step": counts.sessions_per_target_step,
        "itl_p50_ms": overall["itl_ms"].get("p50"), "itl_p99_ms": overall["itl_ms"].get("p99"),
        "round_ms": {key: parts.get(key) for key in ("decode_ms", "wall_ms", "draft_busy_ms", "target_busy_ms",
                                                      "overlap_ms", "wire_ms", "idle_ms", "between_ms")},
        "drafted_per_round": drafted,
        # The host's CPU a round costs, by process: the services' own time, the orchestrator's, the links'.
        "cpu_ms_per_round": {name: seconds * 1e3 / rounds for name, seconds in counts.cpu_s.items()},
        **regime.bounds(hit),
    }
    if parts.get("decode_ms") is not None:
        # A round as the client saw it, less the profile's steps and the links' delays on its critical path.
        drafting = min(1.0, counts.drafting_rounds / rounds)
        k = drafted / drafting if drafting else 0.0  # the mean draft of the rounds that drafted
        figures["overhead_ms_per_round"] = parts["decode_ms"] - regime.critical_path_ms(drafting, k, hit)
        figures["drafting_round_share"] = drafting
    return figures
