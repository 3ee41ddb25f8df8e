"""`specmesh serve` (or any of this repository's services) as a child process of a benchmark: started with
its output in a log file, ready when its log names its ports, stopped with SIGTERM (it drains, then stops
its replicas)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
READY = re.compile(r"client endpoint [^:\s]+:(\d+)")
HTTP = re.compile(r"OpenAI API http://[^:\s]+:(\d+)")
METRICS = re.compile(r"orchestrator http://\S+?:(\d+)/metrics")
STOP_WAIT_S = 120.0  # serve drains and stops its replicas (and a running distillation cycle) on SIGTERM


@dataclass
class ServeProcess:
    process: subprocess.Popen
    grpc_port: int
    http_port: int | None  # None: its HTTP API is off
    metrics_port: int | None  # the orchestrator's /metrics; None: off

    def stop(self) -> None:
        stop_serve(self.process)


def serve_command(*flags: str) -> list[str]:
    return [sys.executable, "-m", "orchestrator.cli.main", "serve", *flags]


def start_serve(flags: list[str], log_path: Path, timeout_s: float = 600.0, http: bool = False,
                metrics: bool = False) -> ServeProcess:
    """`specmesh serve FLAGS` once its log names the gRPC port (and the HTTP and metrics ports, where
    `http` and `metrics` ask for them); exits with the log's tail where it stops or times out first."""
    patterns = {"grpc": READY, **({"http": HTTP} if http else {}), **({"metrics": METRICS} if metrics else {})}
    process, found = start_logged(serve_command(*flags), log_path, patterns, timeout_s)
    port = {name: int(match.group(1)) for name, match in found.items()}
    return ServeProcess(process, port["grpc"], port.get("http"), port.get("metrics"))


def start_logged(command: list[str], log_path: Path, patterns: dict[str, re.Pattern], timeout_s: float = 600.0,
                 env: dict[str, str] | None = None) -> tuple[subprocess.Popen, dict[str, re.Match]]:
    """A child process of this repository's code with its output in `log_path` (and `env` over this process's
    environment), once its log matches every pattern; exits with the log's tail where it stops or times out
    first."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               PYTHONUNBUFFERED="1", **(env or {}))
    with log_path.open("w") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.poll() is None:
        text = log_path.read_text(errors="replace")
        found = {name: pattern.search(text) for name, pattern in patterns.items()}
        if all(found.values()):
            return process, found
        time.sleep(0.2)  # paces reading another process's log
    stop_serve(process)
    raise SystemExit(f"{' '.join(command[:4])} did not become ready:\n" + log_path.read_text(errors="replace")[-3000:])


def stop_serve(process: subprocess.Popen) -> None:
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=STOP_WAIT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
