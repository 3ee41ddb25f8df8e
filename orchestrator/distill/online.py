"""Online distillation while serving (`online-distill: true` in `specmesh serve`'s config file).

The deployment keeps a sample of served prompts (orchestrator.distill.online_evidence).
Once enough tokens have been served since the last cycle (and the minimum interval has passed),
a cycle runs `specmesh distill` from the draft serving now, off the serving path
(orchestrator.distill.online_cycle), into a new versioned directory. Its verdict decides:
held-out tokens per round on live prompts rose by distill's margin over the current draft ->
the candidate is rolled out through the ordinary rollout (one replica at a time, failing no
request); anything else -> nothing changes. After a rollout the new draft is on probation:
every `rollback-window` rounds its live acceptance is compared with the draft it replaced, and
a fall past `rollback-margin` rolls the previous draft back in the same way. The target decides
every token throughout, so a cycle can only change speed, never output; a cycle that fails or
overruns its deadline is logged and counted and serving goes on.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import shlex
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Awaitable, Callable, Sequence

from orchestrator.distill.online_cycle import CycleResult, DistillJob, run_local, run_on_ray
from orchestrator.distill.online_evidence import EvidenceStore, served_length
from specmesh.server.connections import positive_seconds
from specmesh.server.service import positive_int

log = logging.getLogger(__name__)
DEFAULT_DIR = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specmesh" / "online-distill"
# distill splits the prompts three ways: with fewer, its held-out verdict rests on a handful of rounds
MIN_PROMPTS = 24
VERSION = re.compile(r"v(\d+)$")
# Training costs grow with the continuation length; answers past this are trained on their start only.
MAX_CONTINUATION = 256
KEPT_CYCLES = 20  # cycle directories (prompts gone, log and report left) kept for a look back


@dataclass(frozen=True)
class OnlineDistillOptions:
    directory: Path = DEFAULT_DIR
    max_bytes: int = 64 << 20  # evidence on disk
    tokens: int = 200_000  # tokens served since the last cycle before the next one
    interval_s: float = 600.0  # and at least this long since the last cycle
    sample: float = 1.0  # share of served requests whose prompts are kept
    cpus: float = 1.0  # threads of a local run; Ray CPUs of the task
    gpus: float = 0.0  # Ray GPUs of the task
    device: str = "cpu"
    timeout_s: float = 3600.0
    distill_args: tuple[str, ...] = ()  # further `specmesh distill` flags
    rollback_margin: float = 0.1  # relative fall in live acceptance that undoes a rollout
    rollback_window: int = 200  # rounds per comparison
    min_prompts: int = MIN_PROMPTS
    poll_s: float = 1.0

    def trainer(self, *, pools, metrics) -> "OnlineDistiller":
        """The online loop over `pools` (orchestrator.control.draft_training.DraftTraining)."""
        return OnlineDistiller(pools, self, metrics)


def fraction(text: str) -> float:
    """A share, 0 to 1."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, not {text}")
    return value


def add_online_distill_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = OnlineDistillOptions()
    group = parser.add_argument_group("online distillation (docs/design/distillation.md)")
    group.add_argument("--online-distill", action="store_true",
                       help="distil the draft from served traffic in the background and roll it out when it is "
                            "better (rolled back when live acceptance falls)")
    group.add_argument("--online-distill-dir", default=str(DEFAULT_DIR), metavar="DIR",
                       help="evidence, cycle logs and the distilled drafts' versioned directories")
    group.add_argument("--online-distill-bytes", type=int, default=defaults.max_bytes,
                       help="evidence kept on disk (oldest dropped first)")
    group.add_argument("--online-distill-tokens", type=int, default=defaults.tokens,
                       help="tokens served since the last cycle before the next one starts")
    group.add_argument("--online-distill-interval", type=float, default=defaults.interval_s, metavar="SECONDS",
                       help="least time between two cycles")
    group.add_argument("--online-distill-sample", type=fraction, default=defaults.sample,
                       help="share of served requests whose prompt token ids are kept")
    group.add_argument("--online-distill-cpus", type=float, default=defaults.cpus,
                       help="CPU threads of a cycle (Ray: the task's num_cpus)")
    group.add_argument("--online-distill-gpus", type=float, default=defaults.gpus, help="Ray: the task's num_gpus")
    group.add_argument("--online-distill-device", default=defaults.device, help="torch device of a cycle")
    group.add_argument("--online-distill-timeout", type=positive_seconds, default=defaults.timeout_s, metavar="SECONDS",
                       help="a cycle still running after this long is stopped and counted as timed out")
    group.add_argument("--online-distill-args", default="", metavar="FLAGS",
                       help="further `specmesh distill` flags, e.g. '--max-new-tokens 32'")
    group.add_argument("--online-distill-rollback-margin", type=fraction, default=defaults.rollback_margin,
                       help="relative fall in live acceptance, against the draft replaced, that rolls it back")
    group.add_argument("--online-distill-rollback-window", type=positive_int, default=defaults.rollback_window,
                       help="rounds of the new draft per comparison")


def online_distill_options(args: argparse.Namespace) -> OnlineDistillOptions | None:
    if not args.online_distill:
        return None
    return OnlineDistillOptions(
        # absolute: the draft replicas (and Ray's workers) load the versions from their own working directory
        directory=Path(args.online_distill_dir).expanduser().resolve(), max_bytes=args.online_distill_bytes,
        tokens=args.online_distill_tokens, interval_s=args.online_distill_interval,
        sample=args.online_distill_sample, cpus=args.online_distill_cpus, gpus=args.online_distill_gpus,
        device=args.online_distill_device, timeout_s=args.online_distill_timeout,
        distill_args=tuple(shlex.split(args.online_distill_args)),
        rollback_margin=args.online_distill_rollback_margin,
        rollback_window=args.online_distill_rollback_window)


@dataclass
class Watch:
    """A rolled-out draft on probation: its live acceptance, window by window, against the one it replaced."""
    model: str
    previous: str
    baseline: float  # the previous draft's live acceptance rate
    since: tuple[float, float, float]  # (rounds, drafted, accepted) of `model` when this window began


Runner = Callable[[DistillJob], Awaitable[CycleResult]]


class OnlineDistiller:
    """The online loop of one deployment's draft pool (`pools`: orchestrator.control.pools.Pools), as the
    pools see it: an orchestrator.control.draft_training.DraftTrainer."""

    def __init__(self, pools, options: OnlineDistillOptions, metrics, runner: Runner | None = None):
        self.pools, self.options, self.metrics = pools, options, metrics
        self.store = EvidenceStore(options.directory / "evidence", options.max_bytes, options.sample)
        self.drafts = options.directory / "drafts"
        self.runner = runner or self._run_distill
        self.tokens = 0  # served since the last cycle
        self.last_cycle_at = time.monotonic()
        self.forced = False
        self.watch: Watch | None = None
        self.outcomes: list[str] = []  # every cycle's, in order
        self.task: asyncio.Task | None = None
        self.cycle: asyncio.Task | None = None
        self.rollback: asyncio.Task | None = None

    @property
    def draft_model(self) -> str:
        return self.pools.controllers["draft"].spec.replica.service.model

    def version_of(self, model: str) -> int:
        """A distilled draft's version (its directory's vN), 0 for any other model."""
        match = VERSION.match(Path(model).name)
        return int(match.group(1)) if match and Path(model).parent == self.drafts else 0

    def start(self) -> None:
        self.metrics.online_distill_draft_version.set(self.version_of(self.draft_model))
        self.task = asyncio.ensure_future(self._run())
        log.info("online distillation on: evidence in %s, a cycle after %d tokens served and %.0f s",
                 self.options.directory, self.options.tokens, self.options.interval_s)

    async def stop(self) -> None:
        tasks = [t for t in (self.task, self.cycle, self.rollback) if t is not None]
        for task in tasks:
            task.cancel()  # a running distill child is killed with its cycle
        await asyncio.gather(*tasks, return_exceptions=True)

    def served(self, prompt_token_ids: Sequence[int], completion_tokens: int) -> None:
        """A finished request (on the serving path: only counts and a sampled line appended)."""
        self.tokens += completion_tokens
        try:
            self.store.add(prompt_token_ids, completion_tokens=completion_tokens)
        except OSError as error:  # a full disk costs evidence, never a request
            log.warning("online distillation: cannot keep a prompt: %s", error)

    def run_now(self) -> None:
        """Start a cycle at the next check, whatever has been served (operators, tests)."""
        self.forced = True

    async def _run(self) -> None:
        while True:
            try:
                self._check()
            except Exception:  # noqa: BLE001 - the loop outlives any one check
                log.exception("online distillation: check failed")
            await asyncio.sleep(self.options.poll_s)

    def _check(self) -> None:
        if self.watch is not None and _idle(self.rollback):
            self._check_watch(self.watch)
        if _idle(self.cycle) and self._due():
            self.cycle = asyncio.ensure_future(self._cycle())

    def _due(self) -> bool:
        if self.forced:
            return self.store.prompts >= 3  # distill's least: one prompt for each split
        o = self.options
        return (self.tokens >= o.tokens and time.monotonic() - self.last_cycle_at >= o.interval_s
                and self.store.prompts >= o.min_prompts)

    # ---- a cycle

    async def _cycle(self) -> None:
        started, version = time.monotonic(), self._next_version()
        self.tokens, self.last_cycle_at, self.forced = 0, started, False
        self.metrics.online_distill_cycle_running.set(1)
        try:
            job = self._prepare(version)
            result = await self._distill(job)
            outcome = await self._conclude(job, result)
        except Exception as error:  # noqa: BLE001 - counted and logged; serving goes on
            log.exception("online distillation cycle v%d failed", version)
            job, result, outcome = None, CycleResult("failed", None, f"{type(error).__name__}: {error}"), "failed"
        finally:
            self.metrics.online_distill_cycle_running.set(0)
        self._prune()
        self.outcomes.append(outcome)
        self.metrics.online_distill_cycles.labels(outcome=outcome).inc()
        log.log(logging.INFO if outcome in ("rolled_out", "no_gain") else logging.WARNING, "%s",
                cycle_line(version, outcome, result, job, time.monotonic() - started))

    def _next_version(self) -> int:
        """Never a number used before: a model's name labels its acceptance counters (the latest cycle's
        directory is always kept)."""
        used = [int(path.name[1:]) for path in self.options.directory.glob("*/v*") if VERSION.match(path.name)]
        return max([0, self.version_of(self.draft_model), *used]) + 1

    def _prepare(self, version: int) -> DistillJob:
        """The cycle's prompts (the evidence now, and the target's newly logged rejections) and paths."""
        logged = self.pools.controllers["target"].spec.replica.disagreement_log
        if logged is not None and logged[2]:  # only a log with contexts can be trained on
            self.store.add_disagreements(Path(logged[0]))
        directory = self.options.directory / "cycles" / f"v{version}"
        directory.mkdir(parents=True, exist_ok=True)
        self.drafts.mkdir(parents=True, exist_ok=True)
        output = self.drafts / f"v{version}"
        shutil.rmtree(output, ignore_errors=True)  # a run cut short left it: distill wants it empty
        self.store.snapshot(directory / "prompts.jsonl")
        o = self.options
        length = served_length(directory / "prompts.jsonl")
        return DistillJob(target=self.pools.controllers["target"].spec.replica.service.model,
                          draft=self.draft_model, prompts=directory / "prompts.jsonl", output=output,
                          report=directory / "report.json", log=directory / "distill.log", device=o.device,
                          threads=max(1, round(o.cpus)),
                          extra_args=continuation_args(o.distill_args, length))

    async def _distill(self, job: DistillJob) -> CycleResult:
        try:
            return await self.runner(job)
        finally:
            job.prompts.unlink(missing_ok=True)  # the evidence itself stays bounded in the store

    async def _run_distill(self, job: DistillJob) -> CycleResult:
        o = self.options
        if self.pools.options.backend == "ray":
            return await run_on_ray(job, o.timeout_s, o.cpus, o.gpus)
        return await run_local(job, o.timeout_s)

    async def _conclude(self, job: DistillJob, result: CycleResult) -> str:
        """Roll the candidate out when, and only when, it beat the draft it started from."""
        report = result.report or {}
        if report.get("tokens_per_round_relative_change") is not None:
            self.metrics.online_distill_last_gain.set(report["tokens_per_round_relative_change"])
        if result.outcome != "improved":
            shutil.rmtree(job.output, ignore_errors=True)
            return result.outcome
        if self.draft_model != job.draft:  # rolled back or replaced meanwhile: judged against another draft
            shutil.rmtree(job.output, ignore_errors=True)
            return "stale"
        try:
            await self.pools.replace_model("draft", str(job.output))
        except Exception as error:  # noqa: BLE001 - e.g. an operator's rollout running
            log.warning("online distillation: rollout of %s failed: %s", job.output, error)
            shutil.rmtree(job.output, ignore_errors=True)
            return "rollout_failed"
        self._on_probation(str(job.output), job.draft)
        return "rolled_out"

    def _on_probation(self, model: str, previous: str) -> None:
        _, drafted, accepted = self._counts(previous)
        self.watch = Watch(model, previous, accepted / drafted if drafted else 0.0, self._counts(model))
        self.metrics.online_distill_draft_version.set(self.version_of(model))

    def _prune(self) -> None:
        """Distilled drafts other than the serving one and the one a rollback would return to; old cycles."""
        keep = {self.draft_model, *([self.watch.previous] if self.watch is not None else [])}
        for path in self.drafts.glob("v*"):
            if str(path) not in keep and self.version_of(str(path)):
                shutil.rmtree(path, ignore_errors=True)
        cycles = sorted((p for p in self.options.directory.glob("cycles/v*") if VERSION.match(p.name)),
                        key=lambda p: int(p.name[1:]))
        for path in cycles[:-KEPT_CYCLES]:
            shutil.rmtree(path, ignore_errors=True)

    # ---- probation and rollback

    def _counts(self, model: str) -> tuple[float, float, float]:
        """(rounds, drafted, accepted) the orchestrator has counted for `model`'s rounds."""
        m = self.metrics
        return tuple(_counted(counter, model) for counter in (m.draft_model_rounds, m.draft_model_draft_tokens,
                                                             m.draft_model_accepted_tokens))

    def _check_watch(self, watch: Watch) -> None:
        if self.draft_model != watch.model:
            self.watch = None  # replaced by other means: nothing left to judge
            return
        rounds, drafted, accepted = counts = self._counts(watch.model)
        if rounds - watch.since[0] < self.options.rollback_window:
            return
        rate = (accepted - watch.since[2]) / max(1.0, drafted - watch.since[1])
        if rate < watch.baseline * (1 - self.options.rollback_margin):
            self.watch = None
            self.rollback = asyncio.ensure_future(self._roll_back(watch, rate))
        else:
            watch.since = counts  # the next window starts here

    async def _roll_back(self, watch: Watch, rate: float) -> None:
        log.warning("online distillation: live acceptance of %s fell to %.3f over %d rounds (the draft before: "
                    "%.3f); rolling back to %s", watch.model, rate, self.options.rollback_window, watch.baseline,
                    watch.previous)
        try:
            await self.pools.replace_model("draft", watch.previous)
        except Exception as error:  # noqa: BLE001 - logged; the next window tries again
            log.error("online distillation: rollback to %s failed: %s", watch.previous, error)
            self.watch = replace(watch, since=self._counts(watch.model))
            return
        self.metrics.online_distill_rollbacks.inc()
        self.metrics.online_distill_draft_version.set(self.version_of(watch.previous))
        log.warning("online distillation: rolled back to %s", watch.previous)


def continuation_args(distill_args: tuple[str, ...], served: int | None) -> tuple[str, ...]:
    """`distill_args` with `--max-new-tokens` set to the served completions' length (at most
    MAX_CONTINUATION) unless the operator set it: a draft trained on shorter continuations than it
    drafts learns their start and can get worse past it, and the verdict would not see that."""
    if served is None or any(a == "--max-new-tokens" or a.startswith("--max-new-tokens=") for a in distill_args):
        return distill_args
    return (*distill_args, "--max-new-tokens", str(min(served, MAX_CONTINUATION)))


def _counted(counter, model: str) -> float:
    """One draft model's total of a `draft_model`-labelled counter (read alone: a registry read collects all)."""
    for family in counter.collect():
        for sample in family.samples:
            if sample.name.endswith("_total") and sample.labels.get("draft_model") == model:
                return sample.value
    return 0.0


def _idle(task: asyncio.Task | None) -> bool:
    return task is None or task.done()


def cycle_line(version: int, outcome: str, result: CycleResult, job: DistillJob | None, seconds: float) -> str:
    """The one log line of a cycle: what it came to and the held-out figures before and after."""
    line = f"online distillation cycle v{version}: {outcome}"
    report = result.report
    if report:
        before, after = report["before"], report["after"]
        change = report.get("tokens_per_round_relative_change")
        line += (f"; held-out at k = {report['settings']['k']}: tokens per round {before['tokens_per_round']:.3f}"
                 f" -> {after['tokens_per_round']:.3f}" + (f" ({change:+.1%})" if change is not None else "")
                 + f", acceptance {before['acceptance_rate']:.3f} -> {after['acceptance_rate']:.3f}; "
                 f"{report['train_prompts'] + report['validation_prompts'] + report['held_out_prompts']} prompts")
    if result.detail:
        line += f"; {result.detail}"
    if job is not None:
        line += f"; from {job.draft}"
    return line + f"; {seconds:.0f} s"
