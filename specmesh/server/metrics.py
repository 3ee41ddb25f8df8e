"""Prometheus metrics, one registry per process.

Names follow vLLM's spec-decode series (`vllm:spec_decode_num_drafts`, ...)
under our own `specmesh_` prefix, so existing dashboards translate directly.
Labels: `model` (the target model of the orchestrator, the served model of a
service) and, on request-level series, the client-supplied `prompt_class`. The
draft model is a label only of `specmesh_draft_model_*` (and the info gauge), so
that replacing the draft (a rollout) shows as a new series without multiplying
every request-level one; its values are the draft models served since start-up.
"""

from __future__ import annotations

import threading
from typing import Callable

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

from specmesh.roles import MAX_DRAFT_TOKENS

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0,
                   40.0, 80.0, 160.0)
POSITION_BUCKETS = tuple(range(MAX_DRAFT_TOKENS + 1))  # rejection positions within a round
RATE_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
REQUEST = ("model", "prompt_class")
# Distinct prompt_class label values an orchestrator exports; later ones are counted as "other", so a
# client that invents classes cannot grow the series (or the scrape) without bound.
MAX_PROMPT_CLASS_LABELS = 32
OTHER_PROMPT_CLASS = "other"


class OrchestratorMetrics:
    """What the speculative loop and the Generation service count."""

    def __init__(self, registry: CollectorRegistry | None = None):
        r = registry or CollectorRegistry()
        self.registry = r
        self.prompt_classes: set[str] = set()  # label values given out so far
        self.num_drafts = Counter("specmesh_spec_decode_num_drafts", "Rounds that verified at least one draft "
                                  "token", REQUEST, registry=r)
        self.num_draft_tokens = Counter("specmesh_spec_decode_num_draft_tokens", "Draft tokens proposed", REQUEST,
                                        registry=r)
        self.num_accepted_tokens = Counter("specmesh_spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                           REQUEST, registry=r)
        self.num_accepted_tokens_per_pos = Counter(
            "specmesh_spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by position in the round",
            (*REQUEST, "position"), registry=r)
        self.rejection_position = Histogram(
            "specmesh_spec_decode_rejection_position", "Position in the round of the first rejected draft token",
            REQUEST, buckets=POSITION_BUCKETS, registry=r)
        self.draft_length = Histogram(
            "specmesh_spec_decode_draft_length", "Draft tokens proposed per round (0: a target-only round, "
            "chosen by the adaptive policy or the kill switch)", REQUEST, buckets=POSITION_BUCKETS, registry=r)
        self.target_forward_passes = Counter("specmesh_target_forward_passes", "Target forward passes (prefill "
                                             "included)", REQUEST, registry=r)
        self.target_forward_passes_saved = Counter(
            "specmesh_target_forward_passes_saved", "Output tokens minus target forward passes: what speculation "
            "saved over target-only decoding", REQUEST, registry=r)
        self.draft_fallbacks = Counter("specmesh_draft_fallbacks", "Requests that lost their draft (ran "
                                       "target-only rounds, or finished target-only)", REQUEST, registry=r)
        self.request_acceptance_rate = Histogram("specmesh_request_acceptance_rate", "Acceptance rate per request",
                                                 REQUEST, buckets=RATE_BUCKETS, registry=r)
        self.prompt_tokens = Counter("specmesh_prompt_tokens", "Prompt tokens", REQUEST, registry=r)
        self.generation_tokens = Counter("specmesh_generation_tokens", "Generated tokens", REQUEST, registry=r)
        self.requests = Counter("specmesh_requests", "Finished requests", (*REQUEST, "finish_reason"), registry=r)
        self.ttft = Histogram("specmesh_time_to_first_token_seconds", "Time to first token", REQUEST,
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("specmesh_time_per_output_token_seconds", "Mean time per output token after the "
                              "first, per request", REQUEST, buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("specmesh_inter_token_latency_seconds", "Time between consecutive streamed "
                             "responses, divided among the tokens each carries", REQUEST, buckets=LATENCY_BUCKETS,
                             registry=r)
        self.e2e = Histogram("specmesh_e2e_request_latency_seconds", "End-to-end request latency", REQUEST,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.round_time = Histogram(
            "specmesh_round_time_seconds", "Where each verification round's time went, from the orchestrator: "
            "part = draft_busy, target_busy, wire (call time not in forward passes), idle, or overlap (draft "
            "and target busy at once; a round's wall time is the sum of the others minus it)",
            (*REQUEST, "part"), buckets=LATENCY_BUCKETS, registry=r)
        self.predraft_hits = Counter("specmesh_predraft_hits", "Pipelined rounds whose proposal was pre-drafted "
                                     "for the verified outcome", REQUEST, registry=r)
        self.predraft_misses = Counter("specmesh_predraft_misses", "Pipelined rounds that found no matching "
                                       "pre-draft and drafted afresh", REQUEST, registry=r)
        self.requests_running = Gauge("specmesh_requests_running", "Requests streaming tokens", ("model",),
                                      registry=r)
        self.requests_waiting = Gauge("specmesh_requests_waiting", "Requests admitted, waiting for their first "
                                      "token", ("model",), registry=r)
        self.replica_restarts = Counter("specmesh_replica_restarts", "Restarts of dead replicas (each one the "
                                        "local supervisor starts; on Ray, each replica seen back at a new address)",
                                        ("role",), registry=r)
        self.role_failed = Gauge("specmesh_role_failed", "1 while no replica of the role is up: each one used up "
                                 "its restarts (retried with backoff) or failed to start", ("role",), registry=r)
        self.draft_model_info = Gauge("specmesh_draft_model_info", "1 for the model the draft pool's new replicas "
                                      "serve (changes with a rollout)", ("model",), registry=r)
        self.lookup_tokens = Counter("specmesh_lookup_tokens", "Prompt-lookup tokens verified in rounds that "
                                     "drafted none (not in the draft token counts)", REQUEST, registry=r)
        self.lookup_accepted_tokens = Counter("specmesh_lookup_accepted_tokens", "Prompt-lookup tokens accepted",
                                              REQUEST, registry=r)
        self.proposer_rounds = Counter(
            "specmesh_proposer_rounds", "Verification rounds by who proposed their tokens: draft (the draft model), "
            "lookup (prompt lookup), suffix (the suffix index of earlier requests), none", REQUEST + ("proposer",),
            registry=r)
        self.proposer_tokens = Counter("specmesh_proposer_tokens", "Tokens proposed for verification, by proposer",
                                       REQUEST + ("proposer",), registry=r)
        self.proposer_accepted_tokens = Counter("specmesh_proposer_accepted_tokens", "Proposed tokens accepted, "
                                                "by proposer", REQUEST + ("proposer",), registry=r)
        self.draft_model_draft_tokens = Counter(
            "specmesh_draft_model_draft_tokens", "Draft tokens proposed, by the draft model that proposed them",
            ("draft_model",), registry=r)
        self.draft_model_accepted_tokens = Counter(
            "specmesh_draft_model_accepted_tokens", "Draft tokens accepted, by the draft model that proposed them "
            "(its acceptance rate: the ratio of the two rates)", ("draft_model",), registry=r)
        self.draft_model_rounds = Counter("specmesh_draft_model_rounds", "Rounds that verified draft tokens, by "
                                          "the draft model that proposed them", ("draft_model",), registry=r)
        self.online_distill_cycles = Counter(
            "specmesh_online_distill_cycles", "Online distillation cycles by outcome: rolled_out, no_gain, failed, "
            "timed_out, rollout_failed, stale (the draft changed while it ran)", ("outcome",), registry=r)
        self.online_distill_rollbacks = Counter("specmesh_online_distill_rollbacks", "Rollouts of a distilled "
                                                "draft undone because live acceptance fell", registry=r)
        self.online_distill_last_gain = Gauge("specmesh_online_distill_last_gain", "Relative change in held-out "
                                              "tokens per round of the last evaluated candidate", registry=r)
        self.online_distill_cycle_running = Gauge("specmesh_online_distill_cycle_running", "1 while an online "
                                                  "distillation cycle runs (trains and judges a candidate)",
                                                  registry=r)
        self.online_distill_draft_version = Gauge("specmesh_online_distill_draft_version", "Version of the "
                                                  "draft serving (0: the one serving started with)", registry=r)
        prometheus_client.ProcessCollector(registry=r)  # process_resident_memory_bytes and friends

    def prompt_class_label(self, prompt_class: str) -> str:
        """The label for a request's prompt_class: itself while fewer than MAX_PROMPT_CLASS_LABELS
        classes have been seen, else "other"."""
        if prompt_class in self.prompt_classes or len(self.prompt_classes) < MAX_PROMPT_CLASS_LABELS:
            self.prompt_classes.add(prompt_class)
            return prompt_class
        return OTHER_PROMPT_CLASS


class ServiceMetrics:
    """What a draft or target service counts."""

    def __init__(self, service: str, model: str, registry: CollectorRegistry | None = None):
        r = registry or CollectorRegistry()
        self.registry = r
        self.labels = {"service": service, "model": model}
        self.forward_seconds = Histogram("specmesh_forward_seconds", "Model forward time per call",
                                         ("service", "model", "op"), buckets=LATENCY_BUCKETS, registry=r)
        self.sessions_open = Gauge("specmesh_sessions_open", "Open sessions (KV caches)", ("service", "model"),
                                   registry=r)
        self.step_rows = Histogram("specmesh_step_rows", "Token rows fed by one batched forward step",
                                   ("service", "model"), buckets=ROW_BUCKETS, registry=r)
        self.step_sessions = Histogram("specmesh_step_sessions", "Sessions sharing one batched forward step",
                                       ("service", "model"), buckets=ROW_BUCKETS, registry=r)
        # Per step, not per call: a call's forward time counts a batched step once for each session in it.
        # Its rate is the model's utilisation, and over committed tokens the capacity a token costs.
        self.step_busy = Counter("specmesh_step_busy_seconds", "Time the model spent in batched forward steps",
                                 ("service", "model"), registry=r)
        self.queued_rows = Gauge("specmesh_queued_rows", "Token rows waiting for the next steps",
                                 ("service", "model"), registry=r)
        self.device_memory = Gauge("specmesh_device_memory_bytes", "Accelerator memory allocated by the model "
                                   "and its KV caches (GPU only)", ("service", "model", "device"), registry=r)
        self.kv_cache_usage = Gauge("specmesh_kv_cache_usage_perc", "KV cache budget reserved by admitted "
                                    "sessions, 0..1", ("service", "model"), registry=r)
        self.kv_cache_budget = Gauge("specmesh_kv_cache_budget_tokens", "KV cache budget, in tokens "
                                     "(--kv-cache-memory / bytes per token)", ("service", "model"), registry=r)
        self.requests_running = Gauge("specmesh_num_requests_running", "Sessions admitted (holding KV "
                                      "reservations)", ("service", "model"), registry=r)
        self.requests_waiting = Gauge("specmesh_num_requests_waiting", "Session opens waiting for KV room",
                                      ("service", "model"), registry=r)
        prometheus_client.ProcessCollector(registry=r)
        # The series every call or step adds to, labelled once: labels() costs a lock and a lookup each time.
        self._forward_by_op: dict[str, Histogram] = {}
        self._step_rows = self.step_rows.labels(**self.labels)
        self._step_sessions = self.step_sessions.labels(**self.labels)
        self._step_busy = self.step_busy.labels(**self.labels)

    @classmethod
    def for_engine(cls, service: str, engine, registry: CollectorRegistry | None = None) -> "ServiceMetrics":
        """Metrics of a service over `engine` (a specmesh.engine ModelEngine), its gauges read at scrape time."""
        metrics = cls(service, engine.config.model_name, registry)
        metrics.sessions_open.labels(**metrics.labels).set_function(lambda: len(engine.sessions))
        metrics.queued_rows.labels(**metrics.labels).set_function(lambda: engine.scheduler.queued_rows)
        engine.scheduler.observers.append(metrics.observe_step)
        metrics.kv_cache_usage.labels(**metrics.labels).set_function(lambda: engine.kv.usage)
        metrics.kv_cache_budget.labels(**metrics.labels).set_function(lambda: engine.kv.capacity)
        metrics.requests_running.labels(**metrics.labels).set_function(lambda: engine.kv.running)
        metrics.requests_waiting.labels(**metrics.labels).set_function(lambda: engine.kv.waiting)
        metrics.registry.register(StepCostCollector(metrics.labels, lambda: engine.costs))
        if engine.device.type == "cuda":
            import torch
            metrics.device_memory.labels(**metrics.labels, device=str(engine.device)).set_function(
                lambda: torch.cuda.memory_allocated(engine.device))
        return metrics

    def observe_forward(self, op: str, forward_ns: int) -> None:
        child = self._forward_by_op.get(op)
        if child is None:
            child = self._forward_by_op[op] = self.forward_seconds.labels(**self.labels, op=op)
        child.observe(forward_ns / 1e9)

    def observe_step(self, parts, step_ns: int) -> None:
        """A batched step's size and time (specmesh.engine.batching observer; runs on the model worker)."""
        self._step_rows.observe(sum(len(part.token_ids) for part in parts))
        self._step_sessions.observe(len({id(part.session) for part in parts}))
        self._step_busy.inc(step_ns / 1e9)


class StepCostCollector:
    """`specmesh_step_seconds{rows}`: the service's current step-cost table, read at scrape time.

    The label takes only the table's sizes (specmesh.engine.step_costs: MEASURED_ROWS, then doubling
    until a step is compute-bound), so it stays bounded; no series before the service measured its costs."""

    def __init__(self, labels: dict[str, str], costs: Callable[[], object]):
        self.labels, self.costs = labels, costs  # costs(): a specmesh.engine.step_costs.StepCosts or None

    def collect(self):
        family = GaugeMetricFamily("specmesh_step_seconds", "Current cost of one forward step of `rows` new "
                                   "token rows over all sessions in it: measured at start-up, kept current "
                                   "from decode steps", labels=(*self.labels, "rows"))
        costs = self.costs()
        for rows, seconds in (costs.seconds.items() if costs is not None else ()):
            family.add_metric((*self.labels.values(), str(rows)), seconds)
        yield family

    def describe(self):
        # Registration asks for the names without a scrape (prometheus_client: duplicate checks).
        return [GaugeMetricFamily("specmesh_step_seconds", "", labels=(*self.labels, "rows"))]


_servers_lock = threading.Lock()


def serve_metrics(registry: CollectorRegistry, host: str, port: int | None) -> int | None:
    """Expose `registry` at http://host:port/metrics (0 = any free port); return the bound port.

    A port of None or below 0 means metrics are off: nothing is served and None is returned.
    """
    if port is None or port < 0:
        return None
    with _servers_lock:
        server, _ = prometheus_client.start_http_server(port, addr=host, registry=registry)
    return server.server_port


class RequestRecorder:
    """One request's contribution to OrchestratorMetrics, labelled once.

    Lifecycle: admitted -> first_token -> streamed ... -> finished (always called,
    also on errors and cancellation, so the running/waiting gauges stay true).
    """

    def __init__(self, metrics: OrchestratorMetrics, model: str, prompt_class: str,
                 draft_model: Callable[[], str | None] = lambda: None):
        self.metrics = metrics
        self.model = model
        self.labels = {"model": model, "prompt_class": metrics.prompt_class_label(prompt_class)}
        self.draft_model = draft_model  # the model that drafted the round just verified; None: unknown
        self.state = "new"
        self.last_stream_at: float | None = None
        self._series_seen: dict[tuple, object] = {}  # see _series

    def _series(self, metric, **extra: str):
        """`metric`'s series for this request's labels and `extra`, looked up once per request: labels()
        takes a lock and checks every label each time, and a round adds to some twenty series."""
        key = (metric, *extra.values())
        series = self._series_seen.get(key)
        if series is None:
            series = self._series_seen[key] = metric.labels(**self.labels, **extra)
        return series

    def admitted(self) -> None:
        self.metrics.requests_waiting.labels(model=self.model).inc()
        self.state = "waiting"

    def first_token(self, ttft_s: float, now: float) -> None:
        self.metrics.requests_waiting.labels(model=self.model).dec()
        self.metrics.requests_running.labels(model=self.model).inc()
        self.metrics.ttft.labels(**self.labels).observe(ttft_s)
        self.state, self.last_stream_at = "running", now

    def streamed(self, tokens: int, now: float) -> None:
        """A response after the first carrying `tokens` tokens; each gets an equal share of the gap."""
        if self.last_stream_at is not None and tokens:
            gap, itl = (now - self.last_stream_at) / tokens, self._series(self.metrics.itl)
            for _ in range(tokens):
                itl.observe(gap)
        self.last_stream_at = now

    def round(self, drafted: int, accepted: int) -> None:
        m, series = self.metrics, self._series
        series(m.draft_length).observe(drafted)
        if not drafted:
            return
        series(m.num_drafts).inc()
        series(m.num_draft_tokens).inc(drafted)
        series(m.num_accepted_tokens).inc(accepted)
        for position in range(accepted):
            series(m.num_accepted_tokens_per_pos, position=str(position)).inc()
        if accepted < drafted:
            series(m.rejection_position).observe(accepted)
        draft_model = self.draft_model()
        if draft_model:
            m.draft_model_draft_tokens.labels(draft_model=draft_model).inc(drafted)
            m.draft_model_accepted_tokens.labels(draft_model=draft_model).inc(accepted)
            m.draft_model_rounds.labels(draft_model=draft_model).inc()

    def proposer(self, proposer: str, proposed: int, accepted: int) -> None:
        """One round's proposer (orchestrator.decoding.proposals) and what it delivered."""
        m, series = self.metrics, self._series
        series(m.proposer_rounds, proposer=proposer).inc()
        series(m.proposer_tokens, proposer=proposer).inc(proposed)
        series(m.proposer_accepted_tokens, proposer=proposer).inc(accepted)

    def round_time(self, breakdown) -> None:
        """One round's orchestrator.decoding.timing.RoundBreakdown."""
        m, series = self.metrics, self._series
        for part, seconds in breakdown.parts().items():
            series(m.round_time, part=part).observe(seconds)
        if breakdown.predraft == "hit":
            series(m.predraft_hits).inc()
        elif breakdown.predraft == "miss":
            series(m.predraft_misses).inc()

    def finished(self, finish_reason: str, prompt_tokens: int, completion_tokens: int, target_passes: int,
                 draft_fallback: bool, acceptance_rate: float | None, tpot_s: float | None, e2e_s: float) -> None:
        m, labels = self.metrics, self.labels
        self._leave_gauges()
        m.requests.labels(**labels, finish_reason=finish_reason).inc()
        m.prompt_tokens.labels(**labels).inc(prompt_tokens)
        m.generation_tokens.labels(**labels).inc(completion_tokens)
        m.target_forward_passes.labels(**labels).inc(target_passes)
        m.target_forward_passes_saved.labels(**labels).inc(max(0, completion_tokens - target_passes))
        if draft_fallback:
            m.draft_fallbacks.labels(**labels).inc()
        if acceptance_rate is not None:
            m.request_acceptance_rate.labels(**labels).observe(acceptance_rate)
        if tpot_s is not None:
            m.tpot.labels(**labels).observe(tpot_s)
        m.e2e.labels(**labels).observe(e2e_s)

    def looked_up(self, tokens: int, accepted: int) -> None:
        """A finished request's prompt-lookup tokens (orchestrator.decoding.lookup), and those accepted."""
        self.metrics.lookup_tokens.labels(**self.labels).inc(tokens)
        self.metrics.lookup_accepted_tokens.labels(**self.labels).inc(accepted)

    def abandoned(self) -> None:
        """The request ended without finishing (error or cancellation)."""
        self._leave_gauges()

    def _leave_gauges(self) -> None:
        if self.state == "waiting":
            self.metrics.requests_waiting.labels(model=self.model).dec()
        elif self.state == "running":
            self.metrics.requests_running.labels(model=self.model).dec()
        self.state = "done"
