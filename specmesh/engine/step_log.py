"""A timeline of a service's steps, one JSON line per step, for finding where a stream's token waited.

Off unless SPECMESH_STEP_LOG names a file; `{role}` and `{pid}` in the name are filled in, so
one setting serves a draft and a target started together:

    SPECMESH_STEP_LOG=/tmp/steps-{role}.jsonl specmesh serve

Each line: `t` (time.monotonic() at the step's end, the clock of time.perf_counter() on Linux,
so lines line up with a client's timestamps on the same machine), `s` (the step's seconds) and
`parts`: per session fed, [the last 8 characters of its id, rows, 1 if a prefill chunk else 0].
Metrics (specmesh_step_rows, specmesh_step_sessions) give the distributions; this gives the order.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import IO

ENV = "SPECMESH_STEP_LOG"


class StepLog:
    def __init__(self, stream: IO[str]):
        self.stream = stream
        self._lock = threading.Lock()

    @classmethod
    def from_environment(cls, role: str) -> "StepLog | None":
        template = os.environ.get(ENV)
        if not template:
            return None
        path = Path(template.replace("{role}", role).replace("{pid}", str(os.getpid())))
        path.parent.mkdir(parents=True, exist_ok=True)  # a diagnostic switch: no service fails to start over it
        return cls(open(path, "a", buffering=1, encoding="utf-8"))  # line-buffered: readable while it runs

    def observe(self, parts, step_ns: int) -> None:
        record = {"t": round(time.monotonic(), 4), "s": round(step_ns / 1e9, 4),
                  "parts": [[part.session.request_id[-8:], len(part.token_ids), int(part.prefill)]
                            for part in parts]}
        with self._lock:
            self.stream.write(json.dumps(record, separators=(",", ":")) + "\n")
