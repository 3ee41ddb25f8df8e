"""A benchmark's `--small` run as a user runs it: `python -m MODULE --small`, in a child process from the
repository's root, its JSON read back."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_small(module: str, tmp_path: Path, timeout_s: float = 600.0) -> tuple[dict, Path]:
    """The JSON `python -m MODULE --small --out ... --work ...` wrote, and its path (tables lie beside it)."""
    out = tmp_path / f"{module.rsplit('.', 1)[-1]}.json"
    run = subprocess.run([sys.executable, "-m", module, "--small", "--out", str(out), "--work", str(tmp_path / "work")],
                         cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads(out.read_text()), out
