"""What the draft-length rule costs the orchestrator's Python a round, by the number of requests in flight.

No models and no services: step costs are injected as the services' reports would carry them (a large
GPU's: measured up to 4096 rows, a row costing little beside the step), acceptance is drawn at 0.8 a
token. Each round of the batch every request plans its round (orchestrator.decoding.plan), prices the
draft's second choices as a greedy round does, and learns from an outcome; `per request` plans each
request as a batch of one, as the loop does, `batched` plans all of them with one plan_batch call.
With --offered N, every request is also offered N free tokens each round (the suffix index's), which the
rule weighs at every length. Printed: microseconds of Python per request and round, the best of --repeats.

    python -m benchmarks.plan_cost --requests 1 16 64 256 --rounds 20
    python -m benchmarks.plan_cost --requests 1 8 64 --offered 32
"""

from __future__ import annotations

import argparse
import random
import time
from types import SimpleNamespace

from orchestrator.decoding.costs import RoundCosts
from orchestrator.decoding.plan import RoundAsk, RoundOutcome
from orchestrator.decoding.policy import DraftLength, Speculation
from orchestrator.decoding.proposals import SUFFIX, FreeProposal
from orchestrator.decoding.request import RoundTiming
from specmesh.engine.step_costs import StepCosts
from specmesh.engine.step_model import StepShape

K_MAX, ACCEPTANCE = 8, 0.8
SIZES = [2 ** power for power in range(13)]  # rows measured at start-up, up to 4096
PROBABILITIES, ALTERNATIVES = [0.9] * K_MAX, [0.05] * K_MAX  # the draft's confidences, its second choices'


def gpu_speculation() -> Speculation:
    reports = SimpleNamespace(target=StepCosts({rows: 0.02 + 0.000002 * rows for rows in SIZES}),
                              draft=StepCosts({rows: 0.001 + 0.000001 * rows for rows in SIZES}))
    return Speculation(costs=RoundCosts(reports))


def outcome(part: DraftLength, k: int, rng: random.Random) -> RoundOutcome:
    reports = part.shared.costs.reports
    rows = len(part.shared.sums)
    timing = RoundTiming(draft_s=k * reports.draft.step_s(StepShape(rows, rows)),
                         verify_s=reports.target.step_s(StepShape(rows, rows * (k + 1))))
    accepted = next((j for j in range(k) if rng.random() >= ACCEPTANCE), k)
    return RoundOutcome(timing, k, accepted, PROBABILITIES[:k])


def rounds_s(requests: int, rounds: int, batched: bool, offered: int = 0) -> float:
    """Seconds of Python per request and round, each request offered `offered` free tokens a round."""
    shared, rng = gpu_speculation(), random.Random(requests)
    parts = [shared.for_request("code") for _ in range(requests)]
    for part in parts:
        part.arrive()
    contexts = [200] * requests
    offers = [FreeProposal(SUFFIX, list(range(offered)), match_length=16)] if offered else []
    started = time.perf_counter()
    for _ in range(rounds):
        asks = [RoundAsk(K_MAX, context, offers=lambda: offers) for context in contexts]
        plans = shared.plan_batch(parts, asks) if batched else [p.plan(a) for p, a in zip(parts, asks)]
        for index, (part, plan) in enumerate(zip(parts, plans)):
            plan.alternatives(shared.costs, PROBABILITIES[:plan.ask], ALTERNATIVES[:plan.ask])
            done = outcome(part, plan.k, rng)
            part.learn(plan, done)
            contexts[index] += done.accepted + 1
    return (time.perf_counter() - started) / (rounds * requests)


def main(argv: list[str] | None = None) -> dict[int, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--offered", type=int, default=0, help="free tokens offered to every request a round")
    args = parser.parse_args(argv)
    table = {}
    print(f"{'requests':>8} {'per request':>12} {'batched':>9}  (us of Python per request and round)")
    for requests in args.requests:
        table[requests] = {mode: 1e6 * min(rounds_s(requests, args.rounds, mode == "batched", args.offered)
                                           for _ in range(args.repeats)) for mode in ("per request", "batched")}
        print(f"{requests:>8} {table[requests]['per request']:>12.1f} {table[requests]['batched']:>9.1f}")
    return table


if __name__ == "__main__":
    main()
