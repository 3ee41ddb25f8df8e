"""Prompt sets for `specmesh bench`: the built-in kinds and a JSONL loader.

The default kinds differ in how much of the answer a draft can guess: `code` (completion of
raw source text), `chat` (questions through the chat template), `edit` (rewrite
or summarise a given snippet: copy-heavy, the easiest for a draft) and `creative`
(open-ended writing, sampled at temperature 1.0 unless --temperature is given).
The workload kinds (orchestrator.prompts.workloads), asked for by name, show suffix drafting:
`repeat` (code tasks re-asked with other names, in waves), `rewrite` (15-40 line bodies given
back with one small change) and `samples` (n = 4 completions a request at temperature 1.0).
A prompt is either raw text (sent as a completion) or chat messages (sent
through the target tokenizer's chat template).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from orchestrator.prompts import workloads
from orchestrator.serving.validation import MAX_CHOICES

KINDS = ("code", "chat", "edit", "creative")  # the default mix
WORKLOAD_KINDS = ("repeat", "rewrite", "samples")  # suffix drafting's workloads, run beside `code`
ALL_KINDS = KINDS + WORKLOAD_KINDS
KIND_HELP = {
    "code": "source text to complete (raw completion, greedy)",
    "chat": "questions through the chat template (greedy)",
    "edit": "rewrite or summarise a 5-line snippet (chat, greedy)",
    "creative": "open-ended writing (chat, temperature 1.0)",
    "repeat": "4 code tasks, each asked, then re-asked with other names or exactly; originals first (greedy)",
    "rewrite": "a 15-40 line body given back with one small change: copies its input (chat, greedy)",
    "samples": f"code to complete, n={workloads.SAMPLES_N} completions a request (temperature 1.0)",
}
KIND_TEMPERATURE = {"creative": 1.0, "samples": 1.0}  # every other kind defaults to greedy (0.0)


@dataclass(frozen=True)
class BenchPrompt:
    kind: str
    prompt: str | None = None  # raw completion text, or
    messages: tuple[dict, ...] | None = None  # chat messages ({"role", "content"})
    max_tokens: int | None = None  # None: --max-tokens
    temperature: float | None = None  # None: the kind's default
    n: int = 1  # completions of the prompt in one request
    task: str | None = None  # the task a `repeat` prompt asks (select_prompts keeps its askings in order)

    def default_temperature(self) -> float:
        if self.temperature is not None:
            return self.temperature
        return KIND_TEMPERATURE.get(self.kind, 0.0)


def _user(text: str) -> tuple[dict, ...]:
    return ({"role": "user", "content": text},)


CODE = [
    "def quicksort(arr):",
    "# Return the n-th Fibonacci number iteratively\ndef fibonacci(n):",
    "class Stack:\n    \"\"\"A LIFO stack backed by a list.\"\"\"\n\n    def __init__(self):",
    "import json\n\ndef load_config(path):\n    \"\"\"Read a JSON config file and return it as a dict.\"\"\"",
    "def binary_search(items, target):\n    lo, hi = 0, len(items) - 1",
    "// Reverse a singly linked list in place\nfunction reverseList(head) {",
    "SELECT customer_id, SUM(amount) AS total\nFROM orders",
    "def is_palindrome(s: str) -> bool:",
]
CHAT = [
    "What is the difference between a list and a tuple in Python?",
    "Explain what a hash map is and when to use one.",
    "How do I read a CSV file in Python?",
    "What does the `yield` keyword do?",
    "When should I use a process pool instead of a thread pool?",
    "What is a race condition? Give a short example.",
    "Explain big-O notation in two sentences.",
    "How do I undo the last git commit but keep my changes?",
]
_SNIPPET_A = "def total(xs):\n    t = 0\n    for x in xs:\n        t = t + x\n    return t\n"
_SNIPPET_B = "def avg(values):\n    s = 0\n    for v in values:\n        s += v\n    return s / len(values)\n"
_SNIPPET_C = ("def find(users, name):\n    for u in users:\n        if u['name'] == name:\n"
              "            return u\n    return None\n")
EDIT = [
    f"Rename the variable `t` to `running_sum` in this code:\n{_SNIPPET_A}",
    f"Add type hints to this function and return the whole function:\n{_SNIPPET_B}",
    f"Add a docstring to this function and return the whole function:\n{_SNIPPET_C}",
    f"Rewrite this function with clearer variable names and return it:\n{_SNIPPET_A}",
    f"Summarise in one sentence what this code does:\n{_SNIPPET_C}",
    f"Add a check that `values` is not empty, and return the whole function:\n{_SNIPPET_B}",
    "Fix the typos and return the corrected text: 'Teh quick brown fox jumsp over the lazy dgo.'",
    f"Convert this function to use the built-in sum() and return it:\n{_SNIPPET_A}",
]
CREATIVE = [
    "Write a short poem about a compiler that dreams.",
    "Tell a four-sentence story about a robot learning to paint.",
    "Invent a name and a slogan for a coffee shop run by programmers.",
    "Write a haiku about debugging at midnight.",
    "Describe a city on Mars in the year 2300 in a short paragraph.",
    "Write the opening line of a mystery novel set in a data centre.",
    "Write a limerick about a cat who learned Python.",
    "Imagine a conversation between a tree and the wind; write three lines.",
]

BUILTIN: dict[str, list[BenchPrompt]] = {
    "code": [BenchPrompt("code", prompt=p) for p in CODE],
    "chat": [BenchPrompt("chat", messages=_user(p)) for p in CHAT],
    "edit": [BenchPrompt("edit", messages=_user(p)) for p in EDIT],
    "creative": [BenchPrompt("creative", messages=_user(p)) for p in CREATIVE],
    "repeat": [BenchPrompt("repeat", prompt=p, task=task) for task, p in workloads.REPEAT],
    "rewrite": [BenchPrompt("rewrite", messages=_user(p)) for p in workloads.REWRITE_TEXTS],
    "samples": [BenchPrompt("samples", prompt=p, n=workloads.SAMPLES_N) for p in workloads.SAMPLES],
}


class PromptFileError(ValueError):
    """A bad line in a JSONL prompt file; the message names the line and the field."""


def load_jsonl(path: str | Path) -> list[BenchPrompt]:
    """One JSON object a line: `prompt` (text) or `messages`, `kind`, optional `max_tokens`, `temperature`, `n`."""
    prompts = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if line.strip():
                prompts.append(_parse_line(line, f"{path}:{number}"))
    if not prompts:
        raise PromptFileError(f"{path}: no prompts")
    return prompts


def json_object(line: str, where: str) -> dict:
    """One JSONL line as a JSON object; PromptFileError naming `where` otherwise."""
    try:
        item = json.loads(line)
    except json.JSONDecodeError as error:
        raise PromptFileError(f"{where}: not valid JSON ({error.msg})") from None
    if not isinstance(item, dict):
        raise PromptFileError(f"{where}: expected a JSON object")
    return item


def _parse_line(line: str, where: str) -> BenchPrompt:
    item = json_object(line, where)

    def bad(field: str, why: str) -> PromptFileError:
        return PromptFileError(f"{where}: field '{field}': {why}")

    kind = item.get("kind", "custom")
    if not isinstance(kind, str) or not kind:
        raise bad("kind", "must be a non-empty string")
    if ("prompt" in item) == ("messages" in item):
        raise bad("prompt", "exactly one of 'prompt' and 'messages' is required")
    prompt, messages = item.get("prompt"), item.get("messages")
    if prompt is not None and (not isinstance(prompt, str) or not prompt):
        raise bad("prompt", "must be a non-empty string")
    if messages is not None:
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise bad("messages", "must be a non-empty list of {\"role\": str, \"content\": str}")
        messages = tuple({"role": m["role"], "content": m["content"]} for m in messages)
    max_tokens = item.get("max_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
        raise bad("max_tokens", "must be an integer >= 1")
    temperature = item.get("temperature")
    if temperature is not None and (not isinstance(temperature, (int, float)) or isinstance(temperature, bool)
                                    or temperature < 0):
        raise bad("temperature", "must be a number >= 0")
    n = item.get("n", 1)
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_CHOICES:
        raise bad("n", f"must be an integer in [1, {MAX_CHOICES}] (completions a request)")
    return BenchPrompt(kind, prompt, messages, max_tokens, None if temperature is None else float(temperature), n)


def select_prompts(pool: list[BenchPrompt], count: int, seed: int) -> list[BenchPrompt]:
    """`count` prompts interleaving the kinds (code, chat, edit, ...), each kind shuffled with `seed`.

    A kind whose prompts name tasks (`repeat`) goes in waves instead: every task's first asking,
    then every task's second, ..., each wave shuffled: originals come before their re-askings,
    which other tasks' askings keep apart. Cycles through the pool when `count` exceeds it, so
    the kinds stay balanced.
    """
    by_kind: dict[str, list[BenchPrompt]] = {}
    for item in pool:
        by_kind.setdefault(item.kind, []).append(item)
    rng = random.Random(seed)
    for kind, items in by_kind.items():
        if any(item.task is not None for item in items):  # its own generator: the same order beside any kinds
            by_kind[kind] = in_waves(items, random.Random(f"{seed}:{kind}"))
        else:
            rng.shuffle(items)
    order = [item for row in _zip_longest(list(by_kind.values())) for item in row]
    return [order[i % len(order)] for i in range(count)]


def in_waves(items: list[BenchPrompt], rng: random.Random) -> list[BenchPrompt]:
    """Wave i holds every task's (i+1)-th asking, in pool order; each wave shuffled, and turned
    so that it does not start with the task that ended the wave before it."""
    waves: list[list[BenchPrompt]] = []
    seen: dict[str | None, int] = {}
    for item in items:
        wave = seen.get(item.task, 0) if item.task is not None else 0
        seen[item.task] = wave + 1
        if wave == len(waves):
            waves.append([])
        waves[wave].append(item)
    order: list[BenchPrompt] = []
    for wave in waves:
        rng.shuffle(wave)
        if order and len(wave) > 1 and wave[0].task == order[-1].task:
            wave = wave[1:] + wave[:1]
        order += wave
    return order


def _zip_longest(lists: list[list[BenchPrompt]]) -> list[list[BenchPrompt]]:
    return [[items[i] for items in lists if i < len(items)] for i in range(max(map(len, lists)))]


def prompt_pool(kinds: list[str], jsonl: str | None) -> list[BenchPrompt]:
    """The built-in prompts of `kinds`, or the JSONL file's prompts when one is given."""
    if jsonl:
        return load_jsonl(jsonl)
    unknown = sorted(set(kinds) - set(BUILTIN))
    if unknown:
        raise PromptFileError(f"unknown prompt kind(s) {unknown}; built-in kinds: {', '.join(ALL_KINDS)}")
    return [item for kind in kinds for item in BUILTIN[kind]]
