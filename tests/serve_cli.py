"""The `specmesh` command as a user runs it: `specmesh serve` as a child process, until it is ready."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def specmesh(*args: str) -> list[str]:
    return [sys.executable, "-m", "orchestrator.cli.main", *args]


def start_serve(*args: str, expect_metrics: bool = False,
                output: list[str] | None = None) -> tuple[subprocess.Popen, str, list[str]]:
    """Start `specmesh serve`; return the process, the client endpoint and the lines printed until ready.

    `output`: collects the lines printed after that (else they are read and dropped)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    process = subprocess.Popen(specmesh("serve", "--port", "0", "--http-port", "0", *args), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    lines, endpoint = [], None
    for line in process.stdout:  # the ready line comes once all three services are up
        lines.append(line.strip())
        found = re.search(r"specmesh ready: client endpoint ([^\s,]+)", line)
        endpoint = found.group(1) if found else endpoint
        if endpoint and (not expect_metrics or line.startswith("metrics: ")):
            keep = process.stdout.read if output is None else lambda: output.extend(process.stdout)
            threading.Thread(target=keep, daemon=True).start()  # keep the pipe drained
            return process, endpoint, lines
    raise AssertionError("serve exited before it was ready:\n" + "\n".join(lines[-30:]))
