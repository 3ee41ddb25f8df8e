"""After a load on a served stack: is every process's open work back to 0, and does SIGTERM drain it?

Helpers of soak_rss.py for the stack `start_stack` runs (`specmesh serve`'s launcher: the
orchestrator process and its draft and target children):
  - `StackLog` passes the stack's stderr through to ours and keeps the lines about stopping;
  - `wait_closed` polls each process's Prometheus /metrics until what it holds open is 0: a
    service's `specmesh_sessions_open`, the orchestrator's running and waiting requests;
  - `stop_stack` sends SIGTERM to the orchestrator process, as `specmesh serve` gets it (it drains,
    then stops its replicas with SIGTERM), and reads each process's exit code and whether it drained.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
import threading
import time

from benchmarks.bench_pipeline import scrape, total
from orchestrator.bench.report import machine_info
from orchestrator.control.supervisor import STOP_GRACE_S
from specmesh.server.drain import DEFAULT_SHUTDOWN_GRACE_S

OPEN_GAUGES = {"orchestrator": ("specmesh_requests_running", "specmesh_requests_waiting"),
               "draft": ("specmesh_sessions_open",), "target": ("specmesh_sessions_open",)}
POLL_S = 0.05
# Lines kept from the stack's log (everything else only passes through).
KEPT = re.compile(r"SIGTERM|draining:|drained and stopped|still in flight|stopped: exit code|WARNING|ERROR")
LOGGED_BY = re.compile(r"^\S+ \S+ (orchestrator|draft|target)\b")  # "date time,ms name [pid] LEVEL message"
REPLICA_EXIT = re.compile(r"(draft|target) replica \S+ stopped: exit code (-?\d+)")


def print_header(module: str, argv: list[str] | None) -> None:
    """The machine and the exact command (`python -m module ...`), first in the output."""
    info = machine_info()
    gpu = f", GPU {info['cuda']}" if info["cuda"] else ""
    print(f"machine: {info['platform']}, {info['cpu']}, {info['cpu_count']} cores, python {info['python']}, "
          f"torch {info['torch']} ({info['torch_threads']} threads){gpu}")
    print(f"command: python -m {module} " + shlex.join(sys.argv[1:] if argv is None else argv), flush=True)


class StackLog:
    """Made before the stack starts: its processes inherit a pipe as stderr, which a thread copies to
    ours, keeping the KEPT lines. `detach()` once they are started gives this process its stderr back."""

    def __init__(self):
        self.lines: list[str] = []
        self._read, write = os.pipe()
        self._ours = os.dup(2)
        os.dup2(write, 2)
        os.close(write)
        self._thread = threading.Thread(target=self._pump, name="stack-log", daemon=True)
        self._thread.start()

    def detach(self) -> None:
        sys.stderr.flush()
        os.dup2(self._ours, 2)

    def _pump(self) -> None:
        pending = b""
        while chunk := os.read(self._read, 1 << 16):
            view = memoryview(chunk)
            while view:
                view = view[os.write(self._ours, view):]
            *complete, pending = (pending + chunk).split(b"\n")
            pending = pending[-4096:]  # a progress bar's carriage returns never end a line
            self.lines += [text for line in complete if KEPT.search(text := line.decode(errors="replace"))]

    def close(self, timeout_s: float = 2.0) -> None:
        """After the stack has exited: the rest of its output (a straggler holding the pipe is not waited for)."""
        self.detach()
        self._thread.join(timeout_s)


def wait_closed(metrics_ports: dict[str, int], since: float, deadline_s: float) -> dict[str, float | str]:
    """By process: seconds from `since` (time.monotonic()) until its open work read 0, or what it still
    held open `deadline_s` after `since`."""
    closed: dict[str, float] = {}
    still: dict[str, str] = {}
    while True:
        for name, port in metrics_ports.items():
            if name in closed:
                continue
            try:
                samples = scrape(port)
            except OSError as error:  # the process is gone, or its metrics server is
                still[name] = f"metrics unreachable ({error})"
                continue
            held = {gauge: total(samples, gauge) for gauge in OPEN_GAUGES[name]}
            if not any(held.values()):
                closed[name] = time.monotonic() - since
            else:
                still[name] = ", ".join(f"{gauge} {value:g}" for gauge, value in held.items() if value)
        if len(closed) == len(metrics_ports) or time.monotonic() - since > deadline_s:
            return {name: closed.get(name, still.get(name, "?")) for name in metrics_ports}
        time.sleep(POLL_S)  # paces the polling of another process's gauges


def stop_stack(process, log: StackLog, names: list[str],
               grace_s: float = DEFAULT_SHUTDOWN_GRACE_S + STOP_GRACE_S + 10) -> dict[str, tuple[int | None, bool]]:
    """SIGTERM to the orchestrator process (a multiprocessing.Process), killed if still running after
    `grace_s`; by process name, (exit code, whether it logged "drained and stopped"). A replica's exit
    code is what its supervisor logged; None where nothing told it."""
    process.terminate()
    process.join(grace_s)
    if process.is_alive():
        process.kill()
        process.join()
    log.close()
    codes: dict[str, int | None] = {"orchestrator": process.exitcode}
    drained = set()
    for line in log.lines:
        if found := REPLICA_EXIT.search(line):
            codes[found.group(1)] = int(found.group(2))
        if "drained and stopped" in line and (found := LOGGED_BY.match(line)):
            drained.add(found.group(1))
    return {name: (codes.get(name), name in drained) for name in names}
