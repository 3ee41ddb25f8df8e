"""Writes benchmarks/data/function_requests.jsonl: 240 chat requests of one kind for `specmesh distill`.

Each asks for one small Python function, "Write a Python function `NAME(PARAM)` that OPERATION
SUBJECT.", from every pairing of 12 operations with 20 subjects, so no two prompts are the same
and the held-out prompts are new pairings. Deterministic; rerun to regenerate:

    python -m benchmarks.distill_workload
"""

from __future__ import annotations

import json
from pathlib import Path

SYSTEM = "You are a helpful Python programming assistant."
OPERATIONS = [  # (what the function does, the function name's stem)
    ("returns the sum of", "sum"), ("returns the average of", "average"),
    ("returns the largest value in", "largest"), ("returns the smallest value in", "smallest"),
    ("removes duplicates from", "dedupe"), ("sorts in descending order", "sort"),
    ("counts the values above the mean of", "count_above_mean"), ("reverses", "reverse"),
    ("returns the median of", "median"), ("returns the second largest value in", "second_largest"),
    ("filters out negative numbers from", "drop_negatives"), ("returns the running total of", "running_total"),
]
SUBJECTS = [  # (what the argument holds, the parameter's name)
    ("a list of integers", "numbers"), ("a list of floats", "values"), ("a tuple of prices", "prices"),
    ("a list of exam scores", "scores"), ("a list of temperatures in Celsius", "temperatures"),
    ("the values of a dictionary", "mapping"), ("a list of string lengths", "lengths"), ("a list of ages", "ages"),
    ("a list of daily step counts", "steps"), ("a list of file sizes in bytes", "sizes"),
    ("a list of word counts", "word_counts"), ("a list of distances in kilometres", "distances"),
    ("a list of response times in milliseconds", "latencies"), ("a list of bank balances", "balances"),
    ("a list of heights in centimetres", "heights"), ("a list of page views", "page_views"),
    ("a list of game scores", "game_scores"), ("a list of weights in kilograms", "weights"),
    ("a list of vote counts", "votes"), ("a list of monthly sales", "sales"),
]


def requests() -> list[dict]:
    return [{"kind": "function", "messages": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Write a Python function `{stem}_{param}({param})` that {operation} {subject}."}]}
        for operation, stem in OPERATIONS for subject, param in SUBJECTS]


if __name__ == "__main__":
    path = Path(__file__).parent / "data" / "function_requests.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in requests()), encoding="utf-8")
    print(f"{path}: {len(requests())} requests")
