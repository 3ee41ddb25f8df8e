"""The distillation report: distill_report.json, distill_report.md and loss.png beside the model."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after choosing the backend


def relative_change(before: float, after: float) -> float | None:
    return (after - before) / before if before else None


def format_report(report: dict) -> str:
    """Markdown: what was trained on, acceptance before/after at fixed k, losses, wall time."""
    before, after, k = report["before"], report["after"], report["settings"]["k"]
    change = report["tokens_per_round_relative_change"]
    times = report["wall_time_s"]
    lines = [
        "# specmesh distill report", "",
        f"- target: `{report['target']}`; draft: `{report['draft']}` -> `{report['output']}`",
        f"- prompts: `{report['prompts']}`: {report['train_prompts']} train, "
        f"{report['held_out_prompts']} held out; {report['training_sequences']} training sequences "
        f"of {report['settings']['max_new_tokens']} tokens",
        f"- {report['settings']['steps']} steps, batch {report['settings']['batch_size']}, "
        f"{_method(report['settings'])}", "",
        f"Held-out greedy speculation at k = {k} (exact replay of the rounds from teacher-forced forwards):", "",
        "| | acceptance rate | tokens per round | accepted / drafted | rounds |",
        "|---|---|---|---|---|",
        _row("before", before), _row("after", after), "",
        f"Tokens per round: {before['tokens_per_round']:.3f} -> {after['tokens_per_round']:.3f}"
        + (f" ({change:+.1%})" if change is not None else ""), "",
        f"Training loss ({report['settings']['divergence']}): first {report['loss']['first']:.4f}, "
        f"last {report['loss']['last']:.4f} (plot: loss.png)", "",
        "Wall time: " + ", ".join(f"{name} {seconds:.1f} s" for name, seconds in times.items()), "",
    ]
    return "\n".join(lines)


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
