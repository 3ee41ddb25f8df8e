"""Inputs beyond the tiny prompts: random word prompts, and the benchmark scripts, loaded as modules."""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

WORDS = ("the quick brown fox jumps over lazy dog a journey of thousand miles begins with single step "
         "rain in spain stays mainly plain cat sat on mat model target draft tokens").split()
BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def word_prompts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 8))).capitalize() for _ in range(count)]


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # a dataclass of the script looks its module up there
    spec.loader.exec_module(module)
    return module
