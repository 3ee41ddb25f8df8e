"""One online distillation run: `specmesh distill` from the current draft, off the serving path.

Local backend: a child process at the lowest CPU priority (nice 19) with a bounded thread
count, killed at its deadline. Ray backend: the same command inside a Ray task that holds its
own CPUs and GPUs, so the scheduler places it beside the replicas instead of on top of them
(its files must be on storage the draft replicas see: one node, or a shared directory).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

KILL_GRACE_S = 10.0  # after SIGTERM at the deadline, before SIGKILL


@dataclass(frozen=True)
class DistillJob:
    target: str
    draft: str  # the draft serving now: the run starts from it and is judged against it
    prompts: Path
    output: Path  # the candidate's versioned directory (written only when it beats the draft)
    report: Path
    log: Path  # the run's stdout and stderr
    device: str = "cpu"
    threads: int = 1
    extra_args: tuple[str, ...] = ()


@dataclass(frozen=True)
class CycleResult:
    outcome: str  # "improved", "no_gain", "failed" or "timed_out"
    report: dict | None  # distill_report.json's content, when the run got as far as its verdict
    detail: str = ""  # why a run failed


def distill_command(job: DistillJob) -> list[str]:
    # `specmesh distill`, from the entry point that reads its flags before it loads torch.
    command = [sys.executable, "-m", "orchestrator.distill", "--target", job.target,
               "--draft", job.draft, "--prompts", str(job.prompts), "--output", str(job.output),
               "--report-json", str(job.report), "--device", job.device, "--no-progress", *job.extra_args]
    nice = shutil.which("nice")
    return [nice, "-n", "19", *command] if nice else command  # serving keeps the CPUs when both want them


def distill_environment(job: DistillJob) -> dict[str, str]:
    threads = str(max(1, job.threads))
    return {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "TOKENIZERS_PARALLELISM": "false"}


def result_of(job: DistillJob, code: int | None, timeout_s: float) -> CycleResult:
    """What a finished (None: killed at its deadline) run came to."""
    if code is None:
        return CycleResult("timed_out", None, f"no verdict within {timeout_s:.0f} s (log: {job.log})")
    from orchestrator.distill.args import NO_GAIN_EXIT  # start time: every replica imports this module
    report = _read_report(job.report)
    if code == 0 and report is not None and report.get("improved"):
        return CycleResult("improved", report)
    if code in (0, NO_GAIN_EXIT) and report is not None:
        return CycleResult("no_gain", report)
    return CycleResult("failed", report, f"exit status {code} (log: {job.log})")


def _read_report(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


async def run_local(job: DistillJob, timeout_s: float) -> CycleResult:
    """The run as a child process of this one; cancelling it kills the child."""
    with job.log.open("wb") as log_file:
        process = await asyncio.create_subprocess_exec(
            *distill_command(job), stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=distill_environment(job), start_new_session=True)
        try:
            code = await asyncio.wait_for(process.wait(), timeout_s)
        except (asyncio.TimeoutError, asyncio.CancelledError) as stopped:
            await _stop(process)
            if isinstance(stopped, asyncio.CancelledError):
                raise
            code = None
    return result_of(job, code, timeout_s)


async def _stop(process: asyncio.subprocess.Process) -> None:
    """SIGTERM the run's process group, SIGKILL it when it lingers."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            await asyncio.wait_for(process.wait(), KILL_GRACE_S)
            return
        except asyncio.TimeoutError:
            continue


def run_blocking(job: DistillJob, timeout_s: float) -> int | None:
    """The run, blocking (a Ray task's body: the command and environment are the worker's own): its exit
    status, None when killed at the deadline."""
    with job.log.open("wb") as log_file:
        try:
            return subprocess.run(distill_command(job), stdout=log_file, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, env=distill_environment(job), timeout=timeout_s,
                                  check=False).returncode
        except subprocess.TimeoutExpired:
            return None


async def run_on_ray(job: DistillJob, timeout_s: float, num_cpus: float, num_gpus: float) -> CycleResult:
    """The run as a Ray task with its own resources; cancelled with it at the deadline."""
    import ray  # only with the Ray backend

    task = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, max_retries=0)(run_blocking)
    reference = task.remote(job, timeout_s)
    try:
        code = await asyncio.wait_for(reference, timeout_s + KILL_GRACE_S)  # the task ends its own run first
    except asyncio.TimeoutError:
        code = None
    except BaseException:
        ray.cancel(reference, force=True)
        raise
    return result_of(job, code, timeout_s)
