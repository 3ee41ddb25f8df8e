"""`specmesh bench`: run the sweep, the A/B and the peer, then report.

Order: start the stack (unless --endpoint), then with --peer/--peer-k load the peer's pair
in this process (after the services measured their step costs), in the precisions and on the
CPU kernels the services report running (their `auto` choices are timed, and a second timing
here could choose otherwise), warm up, then for every
configuration (max concurrency x temperature) speculation on (the server's default policy)
and, with --ab or --sweep-k, off right after it, then with --sweep-k every fixed k, all on
the same prompts in the same order; beside every configuration of max concurrency 1 the
peer's modes too (it has no batching): transformers' generate with the target alone and
assisted at each constant k, taking turns with the served modes prompt by prompt, so the
host's drift favours neither. The served models idle while the peer generates. Then stop
the stack and report, with where each mode's decode rounds spent their time.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import shlex
import sys
from datetime import datetime, timezone
from pathlib import Path

from orchestrator.bench.args import peer_ks, sweep_ks
from orchestrator.bench.clients import clear_suffix_index, make_client, served_weights
from orchestrator.bench.metrics import (RequestRecord, aggregate, aggregate_by_kind, output_agreement, pass_figures,
                                        speedups)
from orchestrator.bench.modes import DEFAULT, OFF, PEER_OFF, peer_modes, served_modes
from orchestrator.bench.round_parts import RoundParts
from orchestrator.bench.plots import write_plots
from orchestrator.prompts.sets import BenchPrompt, PromptFileError, prompt_pool, select_prompts
from orchestrator.bench.report import machine_info, print_report, write_json
from orchestrator.bench.runner import Configuration, LoadSettings, request_temperature, run_modes, warm_up
from orchestrator.bench.sweep import draft_length_sweep, peer_standing
from orchestrator.control.launch import ProcessGroup, StackOptions, model_service_options, start_stack
from orchestrator.decoding.options import loop_config
from orchestrator.serving.options import FrontendOptions
from specmesh.roles import DRAFT, TARGET
from specmesh.server.security import new_internal_token

# (configuration, mode) -> (records, seconds of each pass over the prompts)
Runs = dict[tuple[str, str], tuple[list[RequestRecord], list[float]]]
Rounds = dict[tuple[str, str], RoundParts]  # (configuration, mode) -> its decode rounds' time by part
Weights = dict[str, tuple[str, str]]  # role -> (precision, cpu_linear) its service reports running


def run(args: argparse.Namespace) -> int:
    try:
        prompts = select_prompts(prompt_pool(args.kinds, args.prompt_file), args.num_prompts, args.seed)
    except (PromptFileError, OSError) as error:
        print(f"specmesh bench: {error}", file=sys.stderr)
        return 2
    if args.endpoint is None and args.draft.lower() == "none":
        print("specmesh bench: needs a draft model (--draft) to measure speculation", file=sys.stderr)
        return 2
    configurations = [Configuration(c, t) for t in (args.temperature or [None]) for c in args.max_concurrency]
    if max(args.max_concurrency) > args.num_prompts:
        print(f"specmesh bench: warning: {args.num_prompts} prompts never put {max(args.max_concurrency)} requests "
              "in flight; raise --num-prompts", file=sys.stderr)
    if args.sweep_k is not None and args.seeded_requests:
        print("specmesh bench: warning: the server keeps seeded requests at its fixed k, so with --seeded-requests "
              "the sweep's default row is not the adaptive policy", file=sys.stderr)
    load = LoadSettings(args.max_tokens, args.request_rate, args.seed, None, args.timeout, not args.no_progress,
                        args.seeded_requests, args.repeats, args.min_seconds)
    started_at = datetime.now(timezone.utc)
    try:
        endpoint, weights, (runs, rounds) = serve_phase(args, prompts, configurations, load)
    except RuntimeError as error:
        print(f"specmesh bench: {error}", file=sys.stderr)
        return 1
    result = build_result(args, prompts, configurations, runs, endpoint, started_at, rounds, weights)
    result_dir = Path(args.result_dir or Path("bench-results") / started_at.strftime("%Y%m%d-%H%M%S"))
    result_dir.mkdir(parents=True, exist_ok=True)
    write_json(result, result_dir / "result.json")
    plots = write_plots(result, result_dir)
    print_report(result)
    print(f"\nresult: {result_dir / 'result.json'}\nplots: {', '.join(str(p) for p in plots)}")
    return report_failures(result)


def serve_phase(args, prompts: list[BenchPrompt], configurations: list[Configuration],
                load: LoadSettings) -> tuple[str, Weights, tuple[Runs, Rounds]]:
    """Run every configuration; returns the endpoint, what the stack this run started reports running
    (empty for a server of the user's) and the runs."""
    group, metrics_url, weights = None, args.metrics_url, {}
    try:
        endpoint = args.endpoint
        # Where to empty the suffix index before each pass (runner.run_modes): a stack of our own always, so
        # that a pass finds repeats only among its own requests; a user's server only when asked.
        admin = endpoint if args.clear_suffix_index and args.protocol == "grpc" else None
        if endpoint is None:
            group = ProcessGroup()
            endpoint, admin, metrics_url = start_own_stack(group, args)
            weights = asyncio.run(served_weights(admin))
        peer = load_peer(args, prompts, configurations, weights)
        return endpoint, weights, asyncio.run(run_served(args, endpoint, prompts, configurations, load, admin, peer,
                                                         metrics_url))
    finally:
        if group is not None:
            group.stop()


def start_own_stack(group: ProcessGroup, args) -> tuple[str, str, str]:
    """The pair as `specmesh serve` runs it, on free local ports, tracing off; returns the endpoint for
    --protocol, the gRPC one (Admin) and the orchestrator's /metrics (its round clocks)."""
    http = args.protocol == "http"
    token = new_internal_token()  # as under `specmesh serve`: only this orchestrator may call the pair
    options = StackOptions(
        target=model_service_options(args, TARGET.name, trace_exporter="none", internal_token=token),
        draft=model_service_options(args, DRAFT.name, trace_exporter="none", internal_token=token),
        loop=loop_config(args),
        address="127.0.0.1:0",
        orchestrator=FrontendOptions(http_port=0 if http else -1, metrics_port=0, trace_exporter="none"))
    print(f"specmesh bench: starting target {args.target} and draft {args.draft} ...", file=sys.stderr, flush=True)
    ready = start_stack(group, options)["orchestrator"]
    return (f"127.0.0.1:{ready.http_port if http else ready.port}", f"127.0.0.1:{ready.port}",
            f"http://127.0.0.1:{ready.metrics_port}/metrics")


async def run_served(args, endpoint: str, prompts: list[BenchPrompt], configurations: list[Configuration],
                     load: LoadSettings, admin: str | None = None, peer=None,
                     metrics_url: str | None = None) -> tuple[Runs, Rounds]:
    tokenizer = None
    if args.protocol == "grpc" and any(p.messages is not None for p in prompts):
        from specmesh.loading.models import load_tokenizer
        tokenizer = load_tokenizer(args.tokenizer or args.target)
    client = make_client(args.protocol, endpoint, tokenizer, peer, metrics_url)
    runs: Runs = {}
    rounds: Rounds = {}
    try:
        await warm_up(client, prompts, args.num_warmups, load)
        if peer is not None:
            await warm_up(client, prompts, args.num_warmups, load, modes=tuple(peer_modes(peer_ks(args))))
        for configuration in configurations:
            if args.num_warmups and configuration.max_concurrency > 1:
                await warm_up(client, prompts, args.num_warmups, load, configuration.max_concurrency)
            client.rounds.take()  # the warm-ups' rounds are not counted
            fresh_pass = functools.partial(clear_suffix_index, admin) if admin is not None else None
            by_mode = await run_modes(client, prompts, configuration, load,
                                      configuration_modes(args, configuration, peer), fresh_pass)
            runs.update({(configuration.name, mode): run for mode, run in by_mode.items()})
            rounds.update({(configuration.name, mode): parts for mode, parts in client.rounds.take().items()})
    finally:
        await client.close()
    return runs, rounds


def configuration_modes(args, configuration: Configuration, peer) -> list[str]:
    """The served modes, and the peer's beside a configuration of max concurrency 1 (it has no batching)."""
    modes = served_modes(args.ab, sweep_ks(args))
    if peer is not None and configuration.max_concurrency == 1:
        modes += peer_modes(peer_ks(args))
    return modes


def load_peer(args, prompts: list[BenchPrompt], configurations: list[Configuration], weights: Weights):
    """With --peer/--peer-k: transformers on the same pair in this process (a PeerClient), else None; in the
    precisions and on the kernels the services report (`weights`), else as the flags say."""
    if not peer_ks(args):
        return None
    from orchestrator.bench.peer import PeerClient, PeerPair
    if not any(c.max_concurrency == 1 for c in configurations):
        print("specmesh bench: --peer runs beside configurations of --max-concurrency 1; there are none",
              file=sys.stderr)
        return None
    if any(p.n > 1 for p in prompts):
        print("specmesh bench: warning: the peer generates one completion of each prompt (assisted generation "
              "takes one row), whatever its n", file=sys.stderr)
    target_dtype, target_kernel = weights.get(TARGET.name, (args.target_dtype, args.cpu_linear))
    draft_dtype, draft_kernel = weights.get(DRAFT.name, (args.draft_dtype, args.cpu_linear))
    print(f"specmesh bench: loading {args.target} ({target_dtype}, {target_kernel} linear) and {args.draft} "
          f"({draft_dtype}, {draft_kernel} linear) in-process for transformers' assisted generation"
          f"{', as the services run them' if weights else ''} ...", file=sys.stderr, flush=True)
    return PeerClient(PeerPair.load(args.target, args.draft, args.device, args.draft_device or args.device,
                                    target_dtype, draft_dtype, target_kernel, draft_kernel, args.trust_remote_code))


def build_result(args, prompts: list[BenchPrompt], configurations: list[Configuration], runs: Runs,
                 endpoint: str, started_at: datetime, rounds: Rounds | None = None,
                 weights: Weights | None = None) -> dict:
    entries, requests = [], []
    for configuration in configurations:
        modes = {}
        for mode in (*served_modes(args.ab, sweep_ks(args)), *peer_modes(peer_ks(args))):
            if (configuration.name, mode) not in runs:
                continue
            records, seconds = runs[configuration.name, mode]
            modes[mode] = {"overall": aggregate(records, sum(seconds)), "per_kind": aggregate_by_kind(records)}
            if len(seconds) > 1:
                modes[mode]["passes"] = pass_figures(records, seconds)
            decode_s = sum(r.e2e_ms - r.ttft_ms for r in records if r.ok) / 1e3
            per_round = (rounds or {}).get((configuration.name, mode), RoundParts()).per_round(decode_s)
            if per_round is not None:
                modes[mode]["round_parts"] = per_round
            requests += [{"configuration": configuration.name, **r.to_json()} for r in records]
        entry = {"name": configuration.name, "max_concurrency": configuration.max_concurrency,
                 "temperature": configuration.temperature, "modes": modes}
        entry.update(speedup_fields(modes))
        outputs = output_agreement({mode: runs[configuration.name, mode][0] for mode in modes},
                                   greedy_prompts(prompts, configuration))
        if outputs is not None:
            entry["outputs"] = outputs
        if "passes" in modes[DEFAULT] and "passes" in modes.get(OFF, {}):
            entry["speedup_on_vs_off_by_pass"] = [speedups(on, off)["output_throughput"] for on, off in
                                                  zip(modes[DEFAULT]["passes"], modes[OFF]["passes"])]
        sweep = draft_length_sweep(modes)
        if sweep is not None:
            entry["draft_length_sweep"] = sweep
        entries.append(entry)
    return {
        "command": "specmesh " + shlex.join(sys.argv[1:]),
        "started_at": started_at.isoformat(),
        "finished_at": datetime.now(timezone.utc).isoformat(),
        "config": {key: _json_safe(value) for key, value in vars(args).items() if key != "handler"},
        "server": {"endpoint": endpoint, "protocol": args.protocol, "self_started": args.endpoint is None,
                   "target": args.target, "draft": args.draft,
                   "num_speculative_tokens": args.num_speculative_tokens if args.endpoint is None else None,
                   # what its services report running, and the peer runs too: {role: {precision, cpu_linear}}
                   "weights": {role: {"precision": precision, "cpu_linear": kernel}
                               for role, (precision, kernel) in (weights or {}).items()}},
        "machine": machine_info(),
        "prompts": [{"index": i, "kind": p.kind, "prompt": p.prompt, "n": p.n,
                     "messages": list(p.messages) if p.messages else None} for i, p in enumerate(prompts)],
        "configurations": entries,
        "requests": requests,
    }


def greedy_prompts(prompts: list[BenchPrompt], configuration: Configuration) -> set[int]:
    """Indices of the prompts a configuration sends at temperature 0."""
    return {i for i, prompt in enumerate(prompts) if request_temperature(prompt, configuration) == 0}


def speedup_fields(modes: dict[str, dict]) -> dict:
    """On against off and against the peer at its best constant k, and the peer's own speedup (its best k
    against its target alone), each as speedups() per metric; "peer" names the ks and the best one."""
    overall = {mode: figures["overall"] for mode, figures in modes.items()}
    fields = {}
    if OFF in overall:
        fields["speedup_on_vs_off"] = speedups(overall[DEFAULT], overall[OFF])
    peer = peer_standing(modes)
    if peer is None:
        return fields
    fields["peer"] = peer
    best = overall.get(peer["best_mode"])
    if best is not None:
        fields["speedup_on_vs_peer"] = speedups(overall[DEFAULT], best)
    if best is not None and PEER_OFF in overall:
        fields["speedup_peer_vs_peer_off"] = speedups(best, overall[PEER_OFF])
    return fields


def report_failures(result: dict) -> int:
    failed = [r for r in result["requests"] if not r["ok"]]
    for record in failed[:5]:
        print(f"specmesh bench: request {record['index']} ({record['configuration']}, {record['mode']}) failed: "
              f"{record['error']}", file=sys.stderr)
    if failed:
        print(f"specmesh bench: {len(failed)} of {len(result['requests'])} requests failed", file=sys.stderr)
    return 1 if failed else 0


def _json_safe(value):
    """JSON has no infinity: an unlimited request rate is written as "inf"."""
    return "inf" if value == float("inf") else value
