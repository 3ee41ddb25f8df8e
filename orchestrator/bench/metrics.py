"""Per-request measurements and their aggregates (mean, p50, p95, p99), overall and per prompt kind.

Latencies are measured by the client. TTFT runs from sending the request to the
first chunk with tokens; ITL is the gap between consecutive streamed chunks (with
speculation a chunk carries a whole round's tokens, so ITL rises while TPOT falls);
TPOT is (e2e - TTFT) / (output tokens - 1). Acceptance comes from the server's
stats: acceptance rate = accepted / drafted tokens, mean acceptance length =
tokens committed per verification round = 1 + accepted / rounds, where accepted counts every
proposer's (the draft model's, prompt lookup's, the suffix index's) and the token after each committed
alternative (the draft's second choice, tried beside its tokens under greedy).
A request of n > 1 completions counts all of them: output tokens and the server's stats are
summed over the completions (throughput counts every completion's tokens); TTFT is to the first
token of any completion, ITL the gap between chunks of the same completion, TPOT (e2e - TTFT)
over the longest completion's tokens - 1.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass, field

PERCENTILES = (50, 95, 99)
LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")


@dataclass
class RequestRecord:
    kind: str
    mode: str  # "on", "off", "k=N", "peer-off" or "peer k=N" (orchestrator.bench.modes)
    index: int  # position in the prompt list, the same across modes
    repeat: int = 0  # the pass over the list (--repeats) it ran in
    ok: bool = True
    error: str = ""
    start_s: float = 0.0  # seconds since the run began
    ttft_ms: float = 0.0
    e2e_ms: float = 0.0
    itl_ms: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    rounds: int = 0
    lookup_tokens: int = 0  # prompt-lookup tokens verified, and accepted (not in the draft's)
    lookup_accepted_tokens: int = 0
    suffix_tokens: int = 0  # suffix-index tokens verified, and accepted (in neither of the above)
    suffix_accepted_tokens: int = 0
    alternative_tokens: int = 0  # the draft's second choices verified beside its tokens, and committed
    alternative_accepted_tokens: int = 0
    n: int = 1  # completions asked for
    completion_tokens: list[int] = field(default_factory=list)  # each completion's output tokens, by index
    output_digest: str = ""  # of the generated token ids (token_digest); "" where the client sees only text

    @property
    def tpot_ms(self) -> float | None:
        longest = max(self.completion_tokens, default=self.output_tokens)
        if longest < 2:
            return None
        return (self.e2e_ms - self.ttft_ms) / (longest - 1)

    def to_json(self) -> dict:
        return {**asdict(self), "tpot_ms": self.tpot_ms}


def token_digest(completions: list[list[int]]) -> str:
    """A short fingerprint of a request's generated token ids, its completions in index order."""
    text = ";".join(",".join(map(str, ids)) for ids in completions)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def output_agreement(records: dict[str, list[RequestRecord]], greedy: set[int]) -> dict | None:
    """Whether every mode generated what the first mode did, prompt by prompt (and pass by pass), over
    the `greedy` prompt indices (temperature 0: one right output). None: nothing to compare."""
    outputs = {mode: {(r.index, r.repeat): r.output_digest for r in done if r.ok and r.output_digest
                      and r.index in greedy} for mode, done in records.items()}
    outputs = {mode: by_prompt for mode, by_prompt in outputs.items() if by_prompt}
    if len(outputs) < 2:
        return None
    reference, *others = outputs
    differing = sorted({key[0] for mode in others for key, digest in outputs[mode].items()
                        if key in outputs[reference] and digest != outputs[reference][key]})
    compared = len({key[0] for by_prompt in outputs.values() for key in by_prompt})
    return {"reference": reference, "modes": list(outputs), "prompts": compared, "identical": not differing,
            "differing_prompts": differing}


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summary(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, **{f"p{q}": None for q in PERCENTILES}}
    return {"mean": sum(values) / len(values), **{f"p{q}": percentile(values, q) for q in PERCENTILES}}


# the server's stats a record sums over its completions (GenerationStats fields)
COUNTED = ("draft_tokens", "accepted_tokens", "rounds", "lookup_tokens", "lookup_accepted_tokens", "suffix_tokens",
           "suffix_accepted_tokens", "alternative_tokens", "alternative_accepted_tokens")
# what a round commits beyond its one token from the target: every proposer's accepted tokens, and the
# token after each committed alternative
COMMITTED_BEYOND_ONE = ("accepted_tokens", "lookup_accepted_tokens", "suffix_accepted_tokens",
                        "alternative_accepted_tokens")


def aggregate(records: list[RequestRecord], duration_s: float) -> dict:
    """Figures for one group of requests that ran over `duration_s` seconds of wall time."""
    done = [r for r in records if r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    counted = {f: sum(getattr(r, f) for r in done) for f in COUNTED}
    drafted, accepted = counted["draft_tokens"], counted["accepted_tokens"]
    return {
        "num_requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "duration_s": duration_s,
        "total_prompt_tokens": sum(r.prompt_tokens for r in done),
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration_s if duration_s > 0 else None,
        "output_throughput": output_tokens / duration_s if duration_s > 0 else None,
        "ttft_ms": summary([r.ttft_ms for r in done]),
        "tpot_ms": summary([r.tpot_ms for r in done if r.tpot_ms is not None]),
        "itl_ms": summary([gap for r in done for gap in r.itl_ms]),
        "e2e_ms": summary([r.e2e_ms for r in done]),
        **counted,
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_acceptance_length": 1 + sum(counted[f] for f in COMMITTED_BEYOND_ONE) / counted["rounds"]
        if counted["rounds"] else None,
    }


def pass_figures(records: list[RequestRecord], seconds: list[float]) -> list[dict]:
    """Per pass over the prompt list (--repeats): its duration and output tokens/s."""
    figures = []
    for repeat, duration in enumerate(seconds):
        tokens = sum(r.output_tokens for r in records if r.repeat == repeat and r.ok)
        figures.append({"duration_s": duration, "output_throughput": tokens / duration if duration > 0 else None})
    return figures


def aggregate_by_kind(records: list[RequestRecord]) -> dict[str, dict]:
    """Per kind, throughput is over the kind's own request time (sum of its e2e latencies):
    the rate one stream of that kind would see, whatever else ran beside it."""
    kinds: dict[str, list[RequestRecord]] = {}
    for record in records:
        kinds.setdefault(record.kind, []).append(record)
    return {kind: aggregate(group, sum(r.e2e_ms for r in group if r.ok) / 1e3) for kind, group in kinds.items()}


# metric -> True when larger is better; the A/B speedup is on/off for those, off/on for the rest
SPEEDUP_METRICS = {"request_throughput": True, "output_throughput": True,
                   **{f"{name}.{stat}": False for name in LATENCIES for stat in ("mean", "p50", "p95", "p99")}}


def lookup(figures: dict, metric: str):
    value = figures
    for part in metric.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def speedups(on: dict, off: dict) -> dict[str, float | None]:
    """Per metric, how many times better speculation on is than off (> 1: faster)."""
    result = {}
    for metric, larger_is_better in SPEEDUP_METRICS.items():
        a, b = lookup(on, metric), lookup(off, metric)
        if not a or not b:
            result[metric] = None
        else:
            result[metric] = a / b if larger_is_better else b / a
    return result
