"""The `specmesh bench` command line."""

from __future__ import annotations

import argparse
import math

from orchestrator.bench.modes import DEFAULT_SWEEP
from orchestrator.prompts.sets import ALL_KINDS, KIND_HELP, KINDS
from orchestrator.control.launch import add_model_arguments
from specmesh.roles import MAX_DRAFT_TOKENS

EPILOG = """examples:
  specmesh bench --ab                                  # start the embedded pair, speculation on vs off
  specmesh bench --ab --max-concurrency 1 2 4 8 16     # the batching sweep: tokens/s and ITL by concurrency
  specmesh bench --ab --max-concurrency 4 8 --repeats 2   # on, off, off, on: the A/B with drift cancelled
  specmesh bench --sweep-k --max-tokens 96 --temperature 0   # the default policy against fixed k = 1..8 and off
  specmesh bench --ab --peer --max-concurrency 1 4 --temperature 0 1 --num-prompts 8 --max-tokens 48
  specmesh bench --ab --peer-k 2 4 6 --temperature 0   # on vs off beside transformers' assisted generation
                                                        # at its best constant k and its target alone
  specmesh bench --endpoint 127.0.0.1:8000 --protocol http --prompt-file prompts.jsonl
  specmesh bench --ab --kinds code repeat rewrite samples --num-prompts 38   # suffix drafting's workloads, all
                                                        # of their prompts, beside the plain code workload

prompt kinds (--kinds; the first four are the default):
""" + "\n".join(f"  {kind:<9} {text}" for kind, text in KIND_HELP.items()) + """
  (n > 1: throughput counts every completion's tokens; TTFT is to the first token of any
  completion, ITL the gap between chunks of one completion)
"""


def _rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError("must be > 0 (inf: all at once)")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return value


def _temperature(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError("must be >= 0")
    return value


def _draft_length(text: str) -> int:
    value = int(text)
    if not 1 <= value <= MAX_DRAFT_TOKENS:
        raise argparse.ArgumentTypeError(f"must be in [1, {MAX_DRAFT_TOKENS}]")
    return value


def sweep_ks(args: argparse.Namespace) -> list[int]:
    """The fixed ks of --sweep-k, ascending: none without it, 1..8 when it names none."""
    if args.sweep_k is None:
        return []
    return sorted(set(args.sweep_k or DEFAULT_SWEEP))


def peer_ks(args: argparse.Namespace) -> list[int]:
    """The peer's constant ks, ascending: none without --peer or --peer-k, else --peer-k's or the server's
    --num-speculative-tokens."""
    if args.peer_k is None and not args.peer:
        return []
    return sorted(set(args.peer_k or [args.num_speculative_tokens]))


def add_parser(commands) -> argparse.ArgumentParser:
    bench = commands.add_parser(
        "bench", help="benchmark a server: throughput, TTFT/TPOT/ITL/E2E, acceptance; A/B and peer modes",
        description="Benchmark specmesh like `vllm bench serve`. Without --endpoint it starts its own stack "
                    "(the embedded pair, or --target/--draft) and stops it at the end.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    server = bench.add_argument_group("server")
    server.add_argument("--endpoint", default=None,
                        help="HOST:PORT of a running server (gRPC port, or the HTTP API's with --protocol http)")
    server.add_argument("--protocol", choices=["grpc", "http"], default="grpc")
    server.add_argument("--clear-suffix-index", action="store_true",
                        help="empty the --endpoint server's suffix index before each pass of a configuration "
                             "(gRPC only; a stack the bench starts is always emptied), so that repeats are "
                             "found only among the pass's own requests")
    server.add_argument("--metrics-url", default=None,
                        help="the --endpoint server's orchestrator /metrics (http://HOST:PORT/metrics), for the "
                             "table of where a decode round's time goes (a stack the bench starts: always)")
    server.add_argument("--tokenizer", default=None,
                        help="tokenizer for chat prompts over gRPC (default: --target)")
    add_model_arguments(server)
    load = bench.add_argument_group("load")
    load.add_argument("--kinds", nargs="+", default=list(KINDS), choices=ALL_KINDS,
                      help="built-in prompt kinds (listed below); default: " + " ".join(KINDS))
    load.add_argument("--prompt-file", default=None, metavar="JSONL",
                      help="prompts instead of the built-in sets: one JSON object a line with 'prompt' "
                           "(completion text) or 'messages' (chat), 'kind', optional 'max_tokens', 'temperature', "
                           "'n' (completions a request, 1-16)")
    load.add_argument("--num-prompts", type=_positive, default=16, help="requests per configuration and mode")
    load.add_argument("--max-concurrency", type=_positive, nargs="+", default=[1],
                      help="requests in flight at most; several values run one after another")
    load.add_argument("--request-rate", type=_rate, default=math.inf,
                      help="requests/s, Poisson arrivals (default inf: all at once, paced by the concurrency)")
    load.add_argument("--temperature", type=_temperature, nargs="+", default=None,
                      help="sampling temperature(s) for every prompt; default: each prompt's own "
                           "(0, creative writing 1.0)")
    load.add_argument("--max-tokens", type=_positive, default=None,
                      help="tokens to generate; default: each prompt's own, else 128")
    load.add_argument("--seed", type=int, default=0, help="arrivals and prompt order")
    load.add_argument("--seeded-requests", action="store_true",
                      help="also send request i the sampling seed --seed + i (reproducible sampling; the "
                           "server keeps such requests at a fixed k instead of the adaptive policy)")
    load.add_argument("--num-warmups", type=int, default=2,
                      help="uncounted warm-up requests per mode at concurrency 1 (and, if not 0, one per slot "
                           "before each higher concurrency)")
    load.add_argument("--repeats", type=_positive, default=1,
                      help="passes over the prompts per configuration and mode, the modes' order reversed every "
                           "other pass (on, off, off, on): drift favours no mode, and the passes show the noise")
    load.add_argument("--min-seconds", type=float, default=0.0,
                      help="after --repeats, two more passes at a time (at most 8 in all) while a mode of the "
                           "configuration has run less than this many seconds: the fast, high-concurrency "
                           "configurations get as much measuring time as the slow ones")
    load.add_argument("--timeout", type=float, default=600.0, help="deadline of one request, seconds")
    modes = bench.add_argument_group("modes")
    modes.add_argument("--ab", action="store_true", help="run every configuration with speculation on and off")
    modes.add_argument("--sweep-k", type=_draft_length, nargs="*", default=None, metavar="K",
                       help="the draft-length sweep: also run every configuration with each fixed k "
                            "(num_speculative_tokens=K on every request; default 1 2 3 4 5 6 7 8) and with "
                            "speculation off, and show where the server's default policy stands against the "
                            "best fixed k")
    modes.add_argument("--peer", action="store_true",
                       help="also run transformers in-process on the same pair and prompts, one request at a "
                            "time beside concurrency 1: assisted generation at the server's k as a constant k "
                            "(transformers' default confidence stop kept) and the target alone")
    modes.add_argument("--peer-k", type=_draft_length, nargs="+", default=None, metavar="K",
                       help="the peer's constant ks (implies --peer): it runs assisted at each, and the tables "
                            "compare spec on with the peer at its best k (the most output tokens/s)")
    output = bench.add_argument_group("output")
    output.add_argument("--result-dir", default=None, help="default: ./bench-results/<timestamp>")
    output.add_argument("--no-progress", action="store_true", help="no progress bars")
    return bench
