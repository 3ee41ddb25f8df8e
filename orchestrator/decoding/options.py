"""The speculative loop's command-line flags, shared by `specmesh serve`, `specmesh bench` and `python -m orchestrator`."""

from __future__ import annotations

import argparse

from orchestrator.decoding.request import ROUND_CALLS, LoopConfig
from orchestrator.decoding.pipelined import PIPELINE_MODES
from specmesh.roles import MAX_DECODE_AHEAD
from specmesh.server.service import positive_int


def add_loop_arguments(parser: argparse.ArgumentParser) -> None:
    """The speculative loop's flags, shared by `specmesh serve` and `python -m orchestrator`."""
    parser.add_argument("--num-speculative-tokens", type=int, default=LoopConfig.num_speculative_tokens, metavar="K",
                        help="draft tokens per round; with the adaptive policy, the most per round")
    parser.add_argument("--speculation-policy", choices=("adaptive", "fixed"), default="adaptive",
                        help="adaptive: choose k per round from measured acceptance and costs, 0 when "
                             "speculation does not pay; fixed: always --num-speculative-tokens")
    parser.add_argument("--draft-timeout", type=float, default=LoopConfig.draft_timeout_s,
                        help="seconds a draft round may take before the request goes target-only")
    parser.add_argument("--pipeline", choices=PIPELINE_MODES, default=LoopConfig.pipeline,
                        help="draft the next round while the target verifies; auto: when draft and target "
                             "compute on separate hardware (hosts, devices or disjoint --*-cpus)")
    parser.add_argument("--prompt-lookup", choices=("on", "off"), default="on",
                        help="adaptive policy: verify tokens that followed the sequence's last n-gram where it "
                             "occurred before, in rounds where they pay more than the draft's")
    parser.add_argument("--suffix-index", choices=("on", "off"), default="on",
                        help="adaptive policy: verify continuations of the sequence found in earlier requests' "
                             "prompts and outputs, in rounds where they pay more than the draft's")
    parser.add_argument("--suffix-index-bytes", type=positive_int, default=LoopConfig.suffix_index_bytes,
                        metavar="BYTES", help="memory the suffix index of earlier requests may hold (oldest "
                                              "requests out first)")
    parser.add_argument("--round-calls", choices=ROUND_CALLS, default=LoopConfig.round_calls,
                        help="batch: every session's round to a replica as one message (the replica steps them "
                             "together); stream: a session's rounds as messages on one bidirectional stream to "
                             "each service; unary: a Propose and a Verify call a round (more overhead a round)")
    parser.add_argument("--decode-ahead", type=int, choices=range(MAX_DECODE_AHEAD + 1), default=LoopConfig.decode_ahead,
                        metavar="N", help="target-only rounds: the most tokens a Verify decodes after its next, as "
                                          "many as the measured call latency asks for; 0: one token a round")
    parser.add_argument("--extra-branches", type=int, default=None, metavar="N",
                        help="pipelined: also pre-draft N likely rejection outcomes (default: as many as "
                             "the measured draft and target costs leave time for)")


def loop_config(args: argparse.Namespace) -> LoopConfig:
    return LoopConfig(num_speculative_tokens=args.num_speculative_tokens, draft_timeout_s=args.draft_timeout,
                      adaptive_k=args.speculation_policy == "adaptive", pipeline=args.pipeline,
                      extra_branches=args.extra_branches, prompt_lookup=args.prompt_lookup == "on",
                      suffix_index=args.suffix_index == "on", suffix_index_bytes=args.suffix_index_bytes,
                      round_calls=args.round_calls, decode_ahead=args.decode_ahead)

