"""Optional JSONL log of rejected draft tokens, to feed draft tuning.

One line per rejection: where it happened (request, round, absolute position
and a hash of the context before it), which token the draft proposed and which
the target committed instead, and how likely each model found each token.
Fine-tuning the draft on exactly these contexts raises acceptance: with
`include_context` each record also carries the context's token ids, which
`specmesh distill --prompts LOG` trains on (off by default: they are the users'
prompts, and they make the log much larger). Writes are rate-limited (a token
bucket), so a bad draft cannot flood the disk.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence


@dataclass(frozen=True)
class Disagreement:
    request_id: str
    round: int
    position: int  # absolute position of the rejected draft token
    context_hash: str  # sha256 of the token ids at positions [0, position), first 16 hex digits
    draft_token_id: int
    target_token_id: int  # the recovered token committed instead
    target_prob_of_draft_token: float  # p(draft token) under the target's (sampling) distribution
    target_prob_of_target_token: float
    draft_prob_of_draft_token: float | None  # q; None when the draft sent ids only
    draft_prob_of_target_token: float | None
    context_token_ids: tuple[int, ...] | None = None  # positions [0, position); only with include_context


def context_hash(token_ids: Sequence[int]) -> str:
    return hashlib.sha256(",".join(map(str, token_ids)).encode()).hexdigest()[:16]


class DisagreementLog:
    """Appends Disagreement records as JSON lines, at most `max_per_second` on average."""

    def __init__(self, path: Path | str, max_per_second: float = 100.0, include_context: bool = False,
                 clock: Callable[[], float] = time.monotonic):
        self.path = Path(path)
        self.include_context = include_context
        self.rate = max_per_second
        self.capacity = max(1.0, max_per_second)  # burst size
        self.tokens = self.capacity
        self.clock = clock
        self.refilled_at = clock()
        self.dropped = 0
        self._lock = threading.Lock()
        self._file = self.path.open("a", encoding="utf-8")

    def record(self, disagreement: Disagreement) -> bool:
        """Write one line unless over the rate; return whether it was written."""
        with self._lock:
            if not self._take_token():
                self.dropped += 1
                return False
            line = {"time": time.time(), **asdict(disagreement)}
            if line["context_token_ids"] is None:
                del line["context_token_ids"]
            else:
                line["context_token_ids"] = list(line["context_token_ids"])
            self._file.write(json.dumps(line) + "\n")
            self._file.flush()
            return True

    def _take_token(self) -> bool:
        now = self.clock()
        self.tokens = min(self.capacity, self.tokens + (now - self.refilled_at) * self.rate)
        self.refilled_at = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True

    def close(self) -> None:
        with self._lock:
            self._file.close()


def add_disagreement_log_arguments(parser: argparse.ArgumentParser) -> None:
    """The log's flags, shared by `specmesh serve` and `python -m target_service`."""
    parser.add_argument("--disagreement-log", default=None, metavar="PATH",
                        help="append the target's rejected draft tokens to this JSONL file")
    parser.add_argument("--disagreement-log-rate", type=float, default=100.0,
                        help="at most this many disagreement records per second")
    parser.add_argument("--disagreement-log-context", action="store_true",
                        help="also log each rejection's context token ids (what `specmesh distill` trains on)")


def disagreement_log_settings(args: argparse.Namespace) -> tuple[str, float, bool] | None:
    """DisagreementLog's arguments (path, records per second, include_context), or None: no log."""
    if not args.disagreement_log:
        return None
    return args.disagreement_log, args.disagreement_log_rate, args.disagreement_log_context
