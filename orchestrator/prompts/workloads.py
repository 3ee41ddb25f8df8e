"""The workloads that show suffix drafting (drafts from earlier requests' prompts and outputs).

`repeat`: four code tasks, each asked in an original form, then re-asked with other names
(renamed functions, classes and variables) and once exactly; BenchPrompt.task ties the askings
of a task together, and select_prompts sends them in waves (every original, then the first
re-askings, ...), so a task's first asking comes first and its re-askings are spread.
`rewrite`: a 15-40 line code or text body to give back with one small change, so the answer
copies most of its input (`edit`'s snippets are 5 lines and one prompt asks for a summary).
`samples`: code to complete with n = 4 completions a request, sampled at temperature 1.0.
"""

from __future__ import annotations

from string import Template

# The n of every `samples` request (the server allows up to 16).
SAMPLES_N = 4

# Each task: a template and, per asking, its names; a repeated set of names is an exact repeat.
_TASKS = {
    "stack": (
        'class $Stack:\n    """A LIFO $stack backed by a list."""\n\n    def __init__(self):\n'
        "        self.$items = []\n\n    def push(self, $item):",
        [dict(Stack="Stack", stack="stack", items="items", item="item"),
         dict(Stack="Pile", stack="pile", items="entries", item="entry"),
         dict(Stack="Stack", stack="stack", items="items", item="item"),
         dict(Stack="Tower", stack="tower", items="blocks", item="block")]),
    "total": (
        'def $total($xs):\n    """Return the sum of the numbers in $xs, skipping None; 0 for an empty $xs."""\n',
        [dict(total="total", xs="xs"),
         dict(total="summed", xs="values"),
         dict(total="add_up", xs="numbers"),
         dict(total="total", xs="xs")]),
    "config": (
        "import json\n\n\ndef $load_config($path):\n"
        '    """Read the JSON $config file at $path and return it as a dict ({} when it is missing)."""\n',
        [dict(load_config="load_config", path="path", config="config"),
         dict(load_config="read_settings", path="filename", config="settings"),
         dict(load_config="load_config", path="path", config="config"),
         dict(load_config="parse_options", path="location", config="options")]),
    "account": (
        'class $Account:\n    """A bank $account: $deposit adds to the balance, $withdraw takes from it '
        'and refuses to overdraw."""\n\n    def __init__(self, $owner, balance=0):',
        [dict(Account="Account", account="account", deposit="deposit", withdraw="withdraw", owner="owner"),
         dict(Account="Wallet", account="wallet", deposit="put", withdraw="take", owner="holder"),
         dict(Account="Ledger", account="ledger", deposit="credit", withdraw="debit", owner="name"),
         dict(Account="Account", account="account", deposit="deposit", withdraw="withdraw", owner="owner")]),
}
# (task, prompt) for every asking, in task order; select_prompts orders them in waves
REPEAT = [(task, Template(template).substitute(names)) for task, (template, askings) in _TASKS.items()
          for names in askings]

_INVENTORY = '''class Inventory:
    """Items in stock, by name, with their counts."""

    def __init__(self):
        self.counts = {}

    def add(self, name, count=1):
        if count <= 0:
            raise ValueError("count must be positive")
        self.counts[name] = self.counts.get(name, 0) + count

    def remove(self, name, count=1):
        have = self.counts.get(name, 0)
        if count > have:
            raise KeyError(f"only {have} of {name} in stock")
        if count == have:
            del self.counts[name]
        else:
            self.counts[name] = have - count

    def total(self):
        return sum(self.counts.values())

    def names(self):
        return sorted(self.counts)
'''
_MOVING_AVERAGE = '''def moving_average(values, window):
    """The mean of every `window` consecutive values, in order."""
    if window <= 0:
        raise ValueError("window must be positive")
    if window > len(values):
        return []
    averages = []
    running = sum(values[:window])
    averages.append(running / window)
    for i in range(window, len(values) - 1):
        running += values[i] - values[i - window]
        averages.append(running / window)
    return averages


def main():
    readings = [3, 5, 7, 2, 8, 10, 11, 65, 72, 81, 99, 100, 150]
    for width in (1, 3, 5):
        print(width, moving_average(readings, width))


if __name__ == "__main__":
    main()
'''
_README = '''## Installing

The tool needs Python 3.10 or newer and a C compiler for its one native extension.
Install it from the repository root:

    pip install -e .

This builds the extension in place and puts the `tally` command on your path.
Check the installation with:

    tally --version

## Configuring

Tally reads `~/.config/tally/config.toml` when it starts. Every setting has a default,
so the file may be empty or missing. The settings are:

- `currency`: the currency of new accounts (default: EUR);
- `rounding`: how amounts are rounded, `half-even` or `half-up` (default: half-even);
- `data_dir`: where the ledgers are kept (default: ~/.local/share/tally).

A setting given on the command line overrides the file's value for that run.
'''
_DEPLOYMENT = '''apiVersion: apps/v1
kind: Deployment
metadata:
  name: web
  labels:
    app: web
spec:
  replicas: 2
  selector:
    matchLabels:
      app: web
  template:
    metadata:
      labels:
        app: web
    spec:
      containers:
        - name: web
          image: registry.example.com/web:1.4.2
          ports:
            - containerPort: 8080
          resources:
            requests:
              cpu: 250m
              memory: 256Mi
            limits:
              memory: 512Mi
'''
_DEBOUNCE = '''function debounce(fn, waitMs) {
  let timer = null;
  let lastArgs = null;

  function flush() {
    timer = null;
    const args = lastArgs;
    lastArgs = null;
    fn(...args);
  }

  function debounced(...args) {
    lastArgs = args;
    if (timer !== null) {
      clearTimeout(timer);
    }
    timer = setTimeout(flush, waitMs);
  }

  debounced.cancel = function () {
    if (timer !== null) {
      clearTimeout(timer);
    }
    timer = null;
    lastArgs = null;
  };

  return debounced;
}
'''
_CLI = '''import argparse
import csv
import sys


def parse_args(argv):
    parser = argparse.ArgumentParser(description="Sum a column of a CSV file.")
    parser.add_argument("path", help="the CSV file")
    parser.add_argument("--column", default="amount", help="the column to sum")
    parser.add_argument("--delimiter", default=",", help="the field separator")
    return parser.parse_args(argv)


def column_sum(path, column, delimiter):
    total = 0.0
    with open(path, newline="") as handle:
        for row in csv.DictReader(handle, delimiter=delimiter):
            total += float(row[column])
    return total


def main(argv=None):
    args = parse_args(argv if argv is not None else sys.argv[1:])
    print(f"{column_sum(args.path, args.column, args.delimiter):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
'''
_RETURN_CODE = "Return the whole code, changed only there, and nothing else."
_RETURN_TEXT = "Return the whole text, changed only there, and nothing else."
# (instruction, body, what follows the body): each answer copies all but a line or a name of its body
REWRITE = [
    ("Rename the method `total` to `item_count` in this class.", _INVENTORY, _RETURN_CODE),
    ("This function skips the last average (an off-by-one in its loop). Fix that bug.", _MOVING_AVERAGE,
     _RETURN_CODE),
    ("Correct this documentation: the tool needs Python 3.11 or newer, not 3.10.", _README, _RETURN_TEXT),
    ("Raise the replicas of this Kubernetes deployment from 2 to 3.", _DEPLOYMENT, _RETURN_TEXT),
    ("Rename the variable `timer` to `pending` in this JavaScript function.", _DEBOUNCE, _RETURN_CODE),
    ("Add a `--skip-header` flag (store_true, help \"ignore the first row\") after `--delimiter`.", _CLI,
     _RETURN_CODE),
]
REWRITE_TEXTS = [f"{instruction}\n\n```\n{body}```\n\n{tail}" for instruction, body, tail in REWRITE]

SAMPLES = [
    "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n",
    "def word_counts(text):\n    \"\"\"Map each word of text, lower-cased, to how often it occurs.\"\"\"\n",
    "def flatten(nested):\n    \"\"\"Yield the items of arbitrarily nested lists, depth first.\"\"\"\n",
    "def chunks(items, size):\n    \"\"\"Split items into lists of at most size items.\"\"\"\n",
    "def is_prime(n: int) -> bool:\n",
    "def parse_duration(text):\n    \"\"\"Parse '1h30m', '45s' or '2m' into seconds.\"\"\"\n",
    "class LRUCache:\n    def __init__(self, capacity):\n",
    "def transpose(matrix):\n    \"\"\"Rows become columns.\"\"\"\n",
]
