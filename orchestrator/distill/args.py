"""Command-line flags of `specmesh distill` and their checks (before any model loads)."""

from __future__ import annotations

import argparse
from pathlib import Path

from orchestrator.distill import defaults

DIVERGENCES = ("kl", "tvd")  # see training.bucket_divergence
DTYPES = ("auto", "float32", "bfloat16")
NO_GAIN_EXIT = 3  # the draft did not improve (2 is a bad input)


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = commands.add_parser(
        "distill", help="train the draft on the target's outputs (on-policy distillation) and save it",
        description="Distil the target into the draft: the target's greedy continuations and the draft's own "
                    "samples scored by the target train the draft; the held-out prompts measure greedy "
                    "acceptance before and after at the k the server would draft. Writes a servable model "
                    "directory and a report only when the draft improved (exit status 3 when it did not, unless "
                    "--force).")
    parser.add_argument("--target", required=True, help="target model: embedded alias, directory, .gguf or hub id")
    parser.add_argument("--draft", required=True, help="draft model to start from (same vocabulary as the target)")
    parser.add_argument("--prompts", required=True, metavar="FILE",
                        help="text lines, JSONL with 'prompt', 'messages' or 'prompt_token_ids', or a target "
                             "disagreement log written with --disagreement-log-context")
    parser.add_argument("--output", required=True, metavar="DIR", help="directory for the distilled draft")
    parser.add_argument("--overwrite", action="store_true", help="allow a non-empty --output directory")
    parser.add_argument("--force", action="store_true",
                        help="write the model even when held-out tokens per round did not rise (exit status "
                             "stays 3)")
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--epochs", type=float, default=None,
                        help=f"passes over the training sequences (default: {defaults.PASSES}, within "
                             f"{defaults.MIN_STEPS}..{defaults.MAX_STEPS} steps; early stopping ends sooner)")
    length.add_argument("--steps", type=int, default=None, help="optimiser steps (instead of --epochs)")
    parser.add_argument("--learning-rate", type=float, default=None,
                        help=f"default {defaults.LEARNING_RATE['lora']:g} with LoRA, "
                             f"{defaults.LEARNING_RATE['full']:g} for a full fine-tune (cut when validation "
                             "acceptance stops rising)")
    parser.add_argument("--patience", type=int, default=defaults.PATIENCE,
                        help="validation evaluations without improvement before the learning rate is cut "
                             f"({defaults.LEARNING_RATE_CUTS} times at most) and then training stops on the best "
                             "weights; 0: no early stopping, the last weights are kept")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per training step")
    parser.add_argument("--generation-batch-size", type=int, default=16,
                        help="prompts per generate / teacher-forced forward (a decode step costs about the same "
                             "for 8 or 64 rows on a CPU, so larger is faster while memory lasts; 48 took 23 GB with the "
                             "embedded pair)")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="continuation length per example")
    parser.add_argument("--max-prompt-tokens", type=int, default=256, help="keep each prompt's last N tokens")
    parser.add_argument("--lora-rank", type=int, default=None,
                        help=f"LoRA rank; 0 = full fine-tune (default: full up to "
                             f"{defaults.FULL_FINE_TUNE_MAX_PARAMETERS / 1e6:g}M draft parameters, "
                             f"else rank {defaults.LORA_RANK})")
    parser.add_argument("--held-out-fraction", type=float, default=0.2,
                        help=f"prompts kept for the report (at most {defaults.HELD_OUT_MAX}; a further "
                             f"{defaults.VALIDATION_FRACTION:.0%}% validate, at most {defaults.VALIDATION_MAX})")
    parser.add_argument("--on-policy-samples", type=int, default=0,
                        help="draft continuations per training prompt scored by the target (0 = none)")
    parser.add_argument("--draft-temperature", type=float, default=1.0,
                        help="temperature of the draft's on-policy samples (0 = its greedy continuation)")
    parser.add_argument("--distribution-top-k", type=int, default=64,
                        help="target distributions are kept as their top K tokens plus the rest mass")
    parser.add_argument("--divergence", choices=DIVERGENCES, default="kl",
                        help="kl: forward KL(target||draft); tvd: total variation (1 - acceptance probability)")
    parser.add_argument("--teacher-dtype", choices=DTYPES, default="auto",
                        help="target precision for the training data (auto: bfloat16 where the device computes "
                             "it natively; the held-out evaluation is always float32)")
    parser.add_argument("--train-dtype", choices=DTYPES, default="auto",
                        help="bfloat16: the draft's sampling and training run under bf16 autocast (weights and "
                             "updates stay float32; several times faster on CPUs with AMX); auto: where native")
    parser.add_argument("--k", type=int, default=None,
                        help="draft tokens per round for the report (default: the k that commits the most tokens "
                             "per second at the measured acceptance and step costs, up to serve's default "
                             "--num-speculative-tokens)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--report-json", default=None, metavar="FILE",
                        help="also write the report's JSON to FILE, whatever the verdict (what serving's online "
                             "distillation reads)")
    return parser


def check_args(args: argparse.Namespace) -> str | None:
    """The first problem with the flags, as a message naming the flag; None when they are usable."""
    positive = {"--batch-size": args.batch_size, "--generation-batch-size": args.generation_batch_size,
                "--max-new-tokens": args.max_new_tokens,
                "--max-prompt-tokens": args.max_prompt_tokens, "--k": 1 if args.k is None else args.k,
                "--distribution-top-k": args.distribution_top_k}
    for flag, value in positive.items():
        if value < 1:
            return f"{flag} must be at least 1, got {value}"
    if args.max_new_tokens < 2:
        return "--max-new-tokens must be at least 2 (the first token is the target's own)"
    if args.steps is not None and args.steps < 1:
        return f"--steps must be at least 1, got {args.steps}"
    if args.epochs is not None and not args.epochs > 0:
        return f"--epochs must be positive, got {args.epochs}"
    if min(args.lora_rank or 0, args.on_policy_samples, args.draft_temperature, args.patience) < 0:
        return "--lora-rank, --on-policy-samples, --draft-temperature and --patience must not be negative"
    if args.learning_rate is not None and not args.learning_rate > 0:
        return f"--learning-rate must be positive, got {args.learning_rate}"
    if not 0 < args.held_out_fraction < 1:
        return f"--held-out-fraction must be between 0 and 1 (exclusive), got {args.held_out_fraction}"
    return _check_output(Path(args.output), args.overwrite)


def _check_output(output: Path, overwrite: bool) -> str | None:
    if not output.parent.is_dir():
        return f"--output: parent directory {output.parent} does not exist"
    if output.exists() and not output.is_dir():
        return f"--output: {output} exists and is not a directory"
    if output.is_dir() and any(output.iterdir()) and not overwrite:
        return f"--output: {output} is not empty (pass --overwrite to write into it)"
    return None

