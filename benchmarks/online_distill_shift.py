"""Traffic shift: a draft poorly matched to the traffic, online distillation on, and what it does over time.

Starts `specmesh serve` (--target, --draft; its output in RESULT_DIR/serve.log) with a config file
(RESULT_DIR/serve.yaml: --config's settings, online distillation on with this script's thresholds,
and prompt lookup and the suffix index off unless --config turns them on, so that the draft alone
proposes: a closed loop repeats its prompts, which the suffix index would otherwise answer). Then it
drives a closed loop over gRPC: --concurrency clients, each sending the next prompt of --prompts
(shuffled, repeated) as soon as its last one finished, until --duration seconds, --requests requests,
or --tail-s seconds after --until-cycles cycles finished. Every --sample-s seconds it scrapes the
orchestrator's /metrics: tokens drafted and accepted by the draft model (the live acceptance of each
interval), the client's output tokens (tokens/s of each interval), the serving draft's version (a
change is a rollout), whether a cycle runs (specmesh_online_distill_cycle_running), cycles by outcome.

Writes RESULT_DIR/timeline.json, timeline.csv and timeline.png (acceptance and tokens/s over time,
cycles shaded, rollouts marked) and prints: acceptance before the first rollout against after the
last; tokens/s outside cycles against while one runs (the throughput a cycle costs); cycles by
outcome; failed requests (must be 0); with --check-greedy, whether every greedy output equals the
target-only output of its prompt (the same prompt sent with speculation off, after the loop); with
--paired N, the acceptance of N prompts served while the first rolled-out cycle ran, against the same
prompts sent again after its rollout (benchmarks/shift_pairs.py). The machine and the exact command
come first.

    python -m benchmarks.online_distill_shift --duration 1800 --concurrency 4
    python -m benchmarks.online_distill_shift --target DIR --draft DIR --prompts FILE --until-cycles 2 \\
        --distill-tokens 5000 --distill-args '--max-new-tokens 32' --check-greedy --result-dir shift
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import shlex
import shutil
import sys
import time
from collections import Counter, deque
from dataclasses import dataclass, field, replace
from pathlib import Path

import grpc
import yaml

from benchmarks.bench_pipeline import scrape
from benchmarks.serve_process import ServeProcess, serve_command, start_serve
from benchmarks.shift_pairs import Served, paired, paired_line, to_replay
from benchmarks.shift_timeline import add_intervals, rate, sample_row, summarise, summary_lines, write_files
from benchmarks.stack_checks import print_header
from orchestrator.bench.clients import GrpcClient, RequestParams
from orchestrator.prompts.sets import BenchPrompt, load_jsonl
from specmesh.loading.models import load_tokenizer

MODULE = "benchmarks.online_distill_shift"
ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DURATION_S = 1800.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b", help="as `specmesh serve --target` takes it")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b", help="the draft to start from")
    parser.add_argument("--prompts", default=str(ROOT / "benchmarks" / "data" / "function_requests.jsonl"),
                        help="JSONL prompts (`specmesh bench --prompts` form: prompt or messages)")
    parser.add_argument("--result-dir", default="online-distill-shift")
    parser.add_argument("--config", help="further `specmesh serve --config` settings (its online-distill keys "
                                         "give way to this script's flags)")
    parser.add_argument("--device", help="serve's --device (and the cycles' online-distill-device)")
    parser.add_argument("--k", type=int, default=4, help="serve's --num-speculative-tokens")
    parser.add_argument("--policy", choices=("fixed", "adaptive"), default="fixed",
                        help="serve's --speculation-policy (fixed: the draft drafts every round, whatever it earns)")
    load = parser.add_argument_group("the closed loop")
    load.add_argument("--concurrency", type=int, default=4)
    load.add_argument("--think-s", type=float, default=0.0, metavar="SECONDS",
                      help="a client's pause after each reply (0: a closed loop); leaves a small host idle "
                           "time for a cycle, which runs at the lowest CPU priority")
    load.add_argument("--duration", type=float, default=None, metavar="SECONDS",
                      help="at most this long (default: 1800 s, no limit with --until-cycles)")
    load.add_argument("--requests", type=int, default=None, help="at most this many requests")
    load.add_argument("--until-cycles", type=int, default=0, metavar="N", help="stop --tail-s after N cycles")
    load.add_argument("--tail-s", type=float, default=60.0, help="served after the --until-cycles-th cycle")
    load.add_argument("--sample-s", type=float, default=5.0, help="seconds between two scrapes of /metrics")
    load.add_argument("--max-tokens", type=int, default=128, help="per request (a prompt's own max_tokens wins)")
    load.add_argument("--temperature", type=float, default=None, help="default: each prompt's own (greedy)")
    load.add_argument("--request-timeout", type=float, default=600.0)
    load.add_argument("--seed", type=int, default=0, help="the prompts' order")
    load.add_argument("--paired", type=int, default=0, metavar="N",
                      help="after the first rollout, re-send the last N prompts served while its cycle ran (by the "
                           "old draft), before any new one, and compare the two servings' acceptance; the run "
                           "ends only once they are back")
    load.add_argument("--check-greedy", action="store_true",
                      help="after the loop: every greedy output must equal its prompt's target-only output")
    load.add_argument("--check-greedy-prompts", type=int, default=None, metavar="N",
                      help="check N of the greedy prompts, spread over the run (default: all)")
    online = parser.add_argument_group("online distillation (serve's online-distill-* settings)")
    online.add_argument("--distill-tokens", type=int, default=20_000, help="tokens served before a cycle")
    online.add_argument("--distill-interval", type=float, default=60.0, help="least seconds between cycles")
    online.add_argument("--distill-args", default="", help="further `specmesh distill` flags of a cycle")
    online.add_argument("--distill-cpus", type=float, default=1.0, help="threads of a cycle")
    online.add_argument("--distill-timeout", type=float, default=3600.0)
    parser.add_argument("--start-timeout", type=float, default=900.0, help="seconds serve may take to be ready")
    return parser.parse_args(argv)


def write_serve_config(args: argparse.Namespace, directory: Path) -> Path:
    """serve.yaml: --config's settings, the proposers off unless it says otherwise, online distillation on."""
    settings = {}
    if args.config:
        settings = {str(key).replace("_", "-"): value
                    for key, value in (yaml.safe_load(Path(args.config).read_text()) or {}).items()}
    for proposer in ("prompt-lookup", "suffix-index"):
        settings.setdefault(proposer, "off")
    online = directory / "online-distill"
    shutil.rmtree(online, ignore_errors=True)  # no evidence or draft versions of an earlier run
    settings.update({"online-distill": True, "online-distill-dir": str(online.resolve()),
                     "online-distill-tokens": args.distill_tokens, "online-distill-interval": args.distill_interval,
                     "online-distill-args": args.distill_args, "online-distill-cpus": args.distill_cpus,
                     "online-distill-timeout": args.distill_timeout})
    if args.device:
        settings["online-distill-device"] = args.device
    path = directory / "serve.yaml"
    path.write_text(yaml.safe_dump(settings, sort_keys=False))
    return path


def serve_flags(args: argparse.Namespace, config: Path) -> list[str]:
    flags = ["--target", args.target, "--draft", args.draft, "--port", "0", "--http-port", "-1", "--metrics-port", "0",
             "--num-speculative-tokens", str(args.k), "--speculation-policy", args.policy, "--config", str(config)]
    return flags + (["--device", args.device] if args.device else [])


def start(args: argparse.Namespace, config: Path, log_path: Path) -> ServeProcess:
    """`specmesh serve` with its output in log_path, once ready (its gRPC and orchestrator metrics ports)."""
    flags = serve_flags(args, config)
    print("serve: " + shlex.join(serve_command(*flags)[1:]), flush=True)
    return start_serve(flags, log_path, args.start_timeout, metrics=True)


@dataclass
class Load:
    """What the clients sent and got: the counts the sampler reads, and the greedy outputs by prompt."""
    started: int = 0
    completed: int = 0
    failed: int = 0
    tokens: int = 0
    errors: Counter = field(default_factory=Counter)
    greedy: dict[int, set[tuple[int, ...]]] = field(default_factory=dict)  # by index into the prompt order
    fresh: int = 0  # prompts of the order sent so far
    served: list[Served] = field(default_factory=list)
    replay: deque = field(default_factory=deque)  # positions in `served` to send again (--paired)
    replays_running: int = 0
    t0: float = field(default_factory=time.monotonic)


class Workload:
    """The closed loop's prompts, their request parameters and one gRPC client."""

    def __init__(self, args: argparse.Namespace, endpoint: str):
        self.args = args
        self.order = load_jsonl(args.prompts)
        random.Random(args.seed).shuffle(self.order)
        chat = any(item.messages is not None for item in self.order)
        self.client = GrpcClient(endpoint, load_tokenizer(args.target) if chat else None)

    def params(self, item: BenchPrompt) -> RequestParams:
        temperature = self.args.temperature if self.args.temperature is not None else item.default_temperature()
        return RequestParams(max_tokens=item.max_tokens or self.args.max_tokens, temperature=temperature, seed=None,
                             speculation=True, timeout_s=self.args.request_timeout)

    async def generate(self, item: BenchPrompt, params: RequestParams,
                       load: Load | None = None) -> tuple[tuple[int, ...], tuple[int, int]]:
        """(output token ids, (draft tokens, accepted) from the server's stats)."""
        tokens: list[int] = []
        drafted = accepted = 0
        async for response in self.client.stub.Generate(self.client.request(item, params), timeout=params.timeout_s):
            tokens.extend(response.token_ids)
            if response.HasField("stats"):
                drafted, accepted = response.stats.draft_tokens, response.stats.accepted_tokens
            if load is not None:
                load.tokens += len(response.token_ids)  # as they stream: an interval counts what it served
        return tuple(tokens), (drafted, accepted)

    def next_prompt(self, load: Load) -> tuple[int, int | None]:
        """(index into the order, the first serving's position when this is a --paired replay)."""
        if load.replay:
            replay_of = load.replay.popleft()
            load.replays_running += 1
            return load.served[replay_of].index, replay_of
        load.fresh += 1
        return (load.fresh - 1) % len(self.order), None

    async def client_loop(self, load: Load, stop: asyncio.Event) -> None:
        """One closed-loop client: the next prompt as soon as the last one finished."""
        while not stop.is_set() and (self.args.requests is None or load.started < self.args.requests):
            index, replay_of = self.next_prompt(load)
            load.started += 1
            item, params = self.order[index], self.params(self.order[index])
            started = time.monotonic() - load.t0
            try:
                tokens, (drafted, accepted) = await self.generate(item, params, load)
            except grpc.aio.AioRpcError as error:
                load.failed += 1
                load.errors[error.code().name] += 1
                continue
            finally:
                load.replays_running -= replay_of is not None
            load.completed += 1
            load.served.append(Served(index, started, time.monotonic() - load.t0, drafted, accepted, replay_of))
            if params.temperature == 0 and item.n == 1:
                load.greedy.setdefault(index, set()).add(tokens)
            if self.args.think_s > 0:
                try:
                    await asyncio.wait_for(stop.wait(), timeout=self.args.think_s)
                except asyncio.TimeoutError:
                    pass

    async def check_greedy(self, load: Load) -> dict:
        """Each greedy prompt sent once more with speculation off: its outputs must all equal that one."""
        limit = asyncio.Semaphore(self.args.concurrency)
        checked = sorted(load.greedy)  # in the order they were first served
        if self.args.check_greedy_prompts is not None and len(checked) > self.args.check_greedy_prompts > 0:
            step = len(checked) / self.args.check_greedy_prompts  # evenly over the run: before and after rollouts
            checked = [checked[int(i * step)] for i in range(self.args.check_greedy_prompts)]

        async def agrees(index: int, outputs: set[tuple[int, ...]]) -> bool:
            item = self.order[index]
            async with limit:
                return outputs == {(await self.generate(item, replace(self.params(item), speculation=False)))[0]}
        verdicts = await asyncio.gather(*(agrees(index, load.greedy[index]) for index in checked))
        return {"prompts": len(verdicts), "outputs": sum(len(load.greedy[index]) for index in checked),
                "differ": verdicts.count(False)}


async def sample_until_done(args: argparse.Namespace, metrics_port: int, load: Load, stop: asyncio.Event,
                            clients: asyncio.Future) -> list[dict]:
    """A row every --sample-s seconds until the clients have stopped; tells them when to stop."""
    rows: list[dict] = []
    cycles_done_at, replayed = None, False
    duration = args.duration or (math.inf if args.until_cycles else DEFAULT_DURATION_S)
    while True:
        samples = await asyncio.to_thread(scrape, metrics_port)
        elapsed = time.monotonic() - load.t0
        rows.append(sample_row(samples, elapsed, load.completed, load.failed, load.tokens))
        print_progress(rows)
        if clients.done():
            return rows
        if args.paired and not replayed and len(rows) > 1 and rows[-1]["draft_version"] != rows[-2]["draft_version"]:
            replayed = True  # the first rollout: the prompts its cycle saw served by the old draft, again
            load.replay.extend(to_replay(load.served, cycle_started_s(rows[:-1]), rows[-2]["t_s"])[-args.paired:])
            print(f"  rollout: {len(load.replay)} prompts served during its cycle are sent again", flush=True)
        if cycles_done_at is None and args.until_cycles and rows[-1]["cycles_done"] >= args.until_cycles:
            cycles_done_at = elapsed
        replays_back = not load.replay and not load.replays_running
        if elapsed >= duration or (cycles_done_at is not None and elapsed - cycles_done_at >= args.tail_s
                                        and replays_back):
            stop.set()
        await asyncio.wait({clients}, timeout=args.sample_s)


def cycle_started_s(rows: list[dict]) -> float:
    """The first sample of the latest run of samples with a cycle running (its evidence was taken before)."""
    start = len(rows) - 1
    while start > 0 and not rows[start]["cycle_running"]:
        start -= 1
    while start > 0 and rows[start - 1]["cycle_running"]:
        start -= 1
    return rows[start]["t_s"]


def print_progress(rows: list[dict]) -> None:
    row = rows[-1]
    line = f"  {row['t_s']:6.0f} s: {row['requests']} requests, draft v{row['draft_version']:.0f}"
    if len(rows) > 1:
        acceptance, seconds = rate(rows[-2], row), row["t_s"] - rows[-2]["t_s"]
        line += (f", acceptance {'-' if acceptance is None else f'{acceptance:.3f}'}, "
                 f"{(row['tokens'] - rows[-2]['tokens']) / max(seconds, 1e-9):.1f} tok/s")
    print(line + (", cycle running" if row["cycle_running"] else ""), flush=True)


async def run(args: argparse.Namespace, grpc_port: int, metrics_port: int) -> tuple[list[dict], Load, dict | None]:
    workload, load, stop = Workload(args, f"127.0.0.1:{grpc_port}"), Load(), asyncio.Event()
    try:
        clients = asyncio.ensure_future(asyncio.gather(*(workload.client_loop(load, stop)
                                                         for _ in range(args.concurrency))))
        rows = await sample_until_done(args, metrics_port, load, stop, clients)
        await clients  # a client's own error (not a failed request) surfaces here
        greedy = await workload.check_greedy(load) if args.check_greedy else None
    finally:
        await workload.client.close()
    return rows, load, greedy


def greedy_line(greedy: dict) -> str:
    verdict = "ok" if greedy["differ"] == 0 else f"{greedy['differ']} prompts DIFFER"
    return (f"greedy check: {greedy['prompts']} prompts, {greedy['outputs']} distinct outputs against the "
            f"target-only output of each: {verdict}")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    print_header(MODULE, argv)
    directory = Path(args.result_dir).resolve()  # serve runs from the repository, not from here
    directory.mkdir(parents=True, exist_ok=True)
    serve = start(args, write_serve_config(args, directory), directory / "serve.log")
    try:
        rows, load, greedy = asyncio.run(run(args, serve.grpc_port, serve.metrics_port))
    finally:
        serve.stop()
    summary = {**summarise(add_intervals(rows)), "errors": dict(load.errors), "greedy_check": greedy,
               "paired": paired(load.served) if args.paired else None}
    command = f"python -m {MODULE} " + shlex.join(sys.argv[1:] if argv is None else argv)
    paths = write_files(rows, {"command": command, "settings": vars(args), "summary": summary}, directory)
    extra = ([paired_line(summary["paired"])] if args.paired else []) + ([greedy_line(greedy)] if greedy else [])
    for line in summary_lines(summary) + extra:
        print(line)
    print("wrote " + ", ".join(str(path) for path in paths), flush=True)
    return summary


if __name__ == "__main__":
    main()
