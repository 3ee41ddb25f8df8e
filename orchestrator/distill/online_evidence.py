"""What online distillation learns from: a sample of served prompts, bounded on disk.

Each kept prompt is one JSON line `{"prompt_token_ids": [...], "completion_tokens": n}` (the form
`specmesh distill --prompts` reads; n, the length of what was served for it, tells a cycle how long
the continuations it trains on must be), appended to numbered segment files in `<dir>/evidence`. When the segments
pass `max_bytes`, the oldest segment goes: the evidence is always the most recent traffic.
Rejected contexts from the target's disagreement log (when it logs contexts) join the same
store, read from where the last cycle stopped.
"""

from __future__ import annotations

import json
import logging
import math
import random
from pathlib import Path
from typing import Sequence

log = logging.getLogger(__name__)
SEGMENTS = 8  # dropping one segment frees an eighth of the budget at a time


class EvidenceStore:
    """Served prompts' token ids as JSONL segments in `directory`, at most `max_bytes` in all."""

    def __init__(self, directory: Path, max_bytes: int, sample: float, rng: random.Random | None = None):
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)  # users' prompts: for this user only
        self.max_bytes = max_bytes
        self.segment_bytes = max(1, max_bytes // SEGMENTS)
        self.sample = sample
        self.rng = rng or random.Random()
        self.sizes = {path: path.stat().st_size for path in self._segments()}  # segment -> bytes
        self.lines = {path: _count_lines(path) for path in self.sizes}
        self.log_offset = 0  # bytes of the disagreement log already read

    def _segments(self) -> list[Path]:
        return sorted(self.directory.glob("segment-*.jsonl"), key=lambda p: int(p.stem.split("-")[1]))

    @property
    def prompts(self) -> int:
        return sum(self.lines.values())

    @property
    def bytes(self) -> int:
        return sum(self.sizes.values())

    def add(self, token_ids: Sequence[int], sampled: bool = True, completion_tokens: int = 0) -> bool:
        """Keep one prompt (a `sample` share of them when `sampled`) and the length of its served
        completion, if known; returns whether it was kept."""
        if not token_ids or (sampled and self.rng.random() >= self.sample):
            return False
        record = {"prompt_token_ids": list(token_ids)}
        if completion_tokens > 0:
            record["completion_tokens"] = int(completion_tokens)
        line = json.dumps(record, separators=(",", ":")) + "\n"
        if len(line) > self.segment_bytes:
            return False  # one prompt past a segment would evict everything else
        segment = self._current(len(line))
        with segment.open("a", encoding="utf-8") as file:
            file.write(line)
        self.sizes[segment] = self.sizes.get(segment, 0) + len(line)
        self.lines[segment] = self.lines.get(segment, 0) + 1
        self._drop_oldest()
        return True

    def _current(self, adding: int) -> Path:
        """The segment to append to: the newest, or a new one when it would pass its share."""
        if self.sizes:
            newest = max(self.sizes, key=lambda p: int(p.stem.split("-")[1]))
            if self.sizes[newest] + adding <= self.segment_bytes:
                return newest
            number = int(newest.stem.split("-")[1]) + 1
        else:
            number = 0
        return self.directory / f"segment-{number}.jsonl"

    def _drop_oldest(self) -> None:
        while self.bytes > self.max_bytes and len(self.sizes) > 1:
            oldest = min(self.sizes, key=lambda p: int(p.stem.split("-")[1]))
            oldest.unlink(missing_ok=True)
            del self.sizes[oldest], self.lines[oldest]

    def add_disagreements(self, log_path: Path) -> int:
        """Rejected contexts the target logged since the last call; returns how many were kept."""
        try:
            with log_path.open("rb") as file:
                file.seek(self.log_offset)
                data = file.read()
        except OSError:
            return 0  # no log yet: nothing rejected, or the target has not written one
        complete = data[:data.rfind(b"\n") + 1]  # a line being written is read next time
        self.log_offset += len(complete)
        kept, seen = 0, set()
        for line in complete.decode("utf-8", errors="replace").splitlines():
            context = _context_of(line)
            if context and context not in seen:
                seen.add(context)
                kept += self.add(context, sampled=False)
        return kept

    def snapshot(self, path: Path) -> int:
        """Every kept prompt, once, into `path` (a cycle's prompts file); returns how many."""
        seen: set[str] = set()
        with path.open("w", encoding="utf-8") as out:
            for segment in self._segments():
                for line in segment.read_text(encoding="utf-8").splitlines(keepends=True):
                    if line.endswith("\n") and line not in seen:
                        seen.add(line)
                        out.write(line)
        return len(seen)


def served_length(path: Path, quantile: float = 0.9) -> int | None:
    """The `quantile` of the served completion lengths recorded in the prompts file `path` (nearest
    rank), None when it records none (only logged rejection contexts, or an older store)."""
    lengths = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            value = json.loads(line).get("completion_tokens")
        except (ValueError, AttributeError):
            continue
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            lengths.append(value)
    if not lengths:
        return None
    lengths.sort()
    return lengths[min(len(lengths) - 1, max(0, math.ceil(quantile * len(lengths)) - 1))]


def _context_of(line: str) -> tuple[int, ...] | None:
    try:
        context = json.loads(line).get("context_token_ids")
    except (ValueError, AttributeError):
        return None
    return tuple(context) if isinstance(context, list) and context else None


def _count_lines(path: Path) -> int:
    with path.open("rb") as file:
        return sum(1 for _ in file)
