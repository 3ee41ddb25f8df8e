"""The distillation report: distill_report.json, distill_report.md and loss.png beside the model."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

from orchestrator.distill.acceptance import AcceptanceStats
from orchestrator.distill.early_stopping import EarlyStopping

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after choosing the backend


# Held-out tokens per round must rise by 2 % for the draft to count as better: a smaller change is
# within what one more or one fewer accepted run moves on a few hundred held-out rounds.
MIN_GAIN = 0.02
SETTINGS = ("max_new_tokens", "max_prompt_tokens", "batch_size", "generation_batch_size", "lora_rank",
            "learning_rate", "patience", "on_policy_samples", "draft_temperature", "distribution_top_k",
            "divergence", "teacher_dtype", "train_dtype", "held_out_fraction", "seed", "device")


def relative_change(before: float, after: float) -> float | None:
    return (after - before) / before if before else None


def improved(before: AcceptanceStats, after: AcceptanceStats) -> bool:
    return after.tokens_per_round >= (1 + MIN_GAIN) * before.tokens_per_round and after.rounds > 0


def build_report(args, counts: dict, stats: dict[str, AcceptanceStats], losses: list[float], k: int,
                 k_source: str, stopping: EarlyStopping, cost_ratio: float, times: dict[str, float],
                 written: bool) -> dict:
    """counts: prompts by split ("train", "validation", "held_out") and training "sequences"."""
    before, after = stats["before"], stats["after"]
    settings = {name: getattr(args, name) for name in SETTINGS}
    settings.update(k=k, k_source=k_source, steps=len(losses), epochs=args.epochs)
    return {
        "target": args.target, "draft": args.draft, "prompts": args.prompts, "output": args.output,
        "train_prompts": counts["train"], "validation_prompts": counts["validation"],
        "held_out_prompts": counts["held_out"], "training_sequences": counts["sequences"], "settings": settings,
        "draft_target_step_ratio": cost_ratio,
        "early_stopping": {"best_step": stopping.best_step, "evaluations": stopping.history},
        "before": before.as_dict(), "after": after.as_dict(),
        "tokens_per_round_relative_change": relative_change(before.tokens_per_round, after.tokens_per_round),
        "acceptance_rate_change": after.acceptance_rate - before.acceptance_rate,
        "improved": improved(before, after), "written": written,
        "loss": {"first": losses[0], "last": losses[-1]},
        "wall_time_s": {name: round(seconds, 2) for name, seconds in times.items()},
    }


def format_report(report: dict) -> str:
    """Markdown: what was trained on, acceptance before/after at the report's k, the verdict, wall time."""
    before, after, settings = report["before"], report["after"], report["settings"]
    change = report["tokens_per_round_relative_change"]
    stopping = report["early_stopping"]
    lines = [
        "# specmesh distill report", "",
        f"- target: `{report['target']}`; draft: `{report['draft']}` -> `{report['output']}`",
        f"- prompts: `{report['prompts']}`: {report['train_prompts']} train, {report['validation_prompts']} "
        f"validation, {report['held_out_prompts']} held out; {report['training_sequences']} training sequences "
        f"of {settings['max_new_tokens']} tokens",
        f"- {settings['steps']} steps (best weights after step {stopping['best_step']}), batch "
        f"{settings['batch_size']}, {_method(settings)}", "",
        f"Held-out greedy speculation at k = {settings['k']} ({settings['k_source']}; draft step "
        f"{report['draft_target_step_ratio']:.2f} x the target's), exact replay of the rounds:", "",
        "| | acceptance rate | tokens per round | accepted / drafted | rounds |",
        "|---|---|---|---|---|",
        _row("before", before), _row("after", after), "",
        f"Tokens per round: {before['tokens_per_round']:.3f} -> {after['tokens_per_round']:.3f}"
        + (f" ({change:+.1%})" if change is not None else ""), "",
        _verdict(report), "",
        f"Training loss ({settings['divergence']}): first {report['loss']['first']:.4f}, "
        f"last {report['loss']['last']:.4f}" + (" (plot: loss.png)" if report["written"] else ""), "",
        "Wall time: " + ", ".join(f"{name} {seconds:.1f} s" for name, seconds in report["wall_time_s"].items()), "",
    ]
    return "\n".join(lines)


def _verdict(report: dict) -> str:
    if report["improved"]:
        return f"Verdict: the distilled draft is better (tokens per round rose by at least {MIN_GAIN:.0%})."
    written = "written anyway (--force)" if report["written"] else "not written"
    return (f"Verdict: NO GAIN: tokens per round did not rise by {MIN_GAIN:.0%}; the model was {written}. "
            "Try more or closer-to-serving prompts, or a larger --max-new-tokens.")


def _method(settings: dict) -> str:
    tuning = f"LoRA rank {settings['lora_rank']} (merged)" if settings["lora_rank"] else "full fine-tune"
    return (f"{tuning}, learning rate {settings['learning_rate']:g}, {settings['on_policy_samples']} on-policy "
            f"sample(s) per prompt at temperature {settings['draft_temperature']:g}, target top-"
            f"{settings['distribution_top_k']} + rest mass in {settings['teacher_dtype']}")


def _row(name: str, stats: dict) -> str:
    return (f"| {name} | {stats['acceptance_rate']:.3f} | {stats['tokens_per_round']:.3f} | "
            f"{stats['accepted_tokens']} / {stats['draft_tokens']} | {stats['rounds']} |")


def plot_losses(losses: list[float], path: Path, divergence: str) -> Path:
    figure, axis = plt.subplots(figsize=(6, 3.5))
    axis.plot(range(1, len(losses) + 1), losses, linewidth=1, label="batch loss")
    window = max(1, len(losses) // 20)
    if window > 1:
        smooth = [sum(losses[max(0, i - window + 1):i + 1]) / len(losses[max(0, i - window + 1):i + 1])
                  for i in range(len(losses))]
        axis.plot(range(1, len(losses) + 1), smooth, linewidth=2, label=f"mean of last {window}")
        axis.legend()
    axis.set_xlabel("step")
    axis.set_ylabel(f"{divergence} (target || draft)" if divergence == "kl" else "total variation")
    axis.set_title("specmesh distill: training loss")
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def write_report(report: dict, losses: list[float], directory: Path) -> list[Path]:
    """The three report files in `directory`; returns their paths."""
    json_path, text_path = directory / "distill_report.json", directory / "distill_report.md"
    json_path.write_text(json.dumps({**report, "loss_per_step": losses}, indent=2) + "\n", encoding="utf-8")
    text_path.write_text(format_report(report), encoding="utf-8")
    return [json_path, text_path, plot_losses(losses, directory / "loss.png", report["settings"]["divergence"])]
