"""Every numeric constant of the decoding rules and the runtime is named in docs/design/tuning.md.

The table says what each value is and where it comes from; a constant added without a row fails
here, so the table cannot fall behind the code.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
TABLE = ROOT / "docs" / "design" / "tuning.md"
SCANNED = ("orchestrator/decoding", "specmesh")
GENERATED = "specmesh/v1"
UPPER_CASE = re.compile(r"_?[A-Z][A-Z0-9_]*$")
ALLOWED_CALLS = {"range", "tuple"}  # MEASURED_ROWS-style tables built from ranges


def numeric(value: ast.expr) -> bool:
    """Whether `value` is a number or a structure of numbers (dict keys may be names or strings)."""
    keys = {id(key) for node in ast.walk(value) if isinstance(node, ast.Dict) for key in node.keys if key}
    has_number = False
    for node in ast.walk(value):
        if id(node) in keys:
            continue
        if isinstance(node, ast.Constant):
            if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
                return False
            has_number = True
        elif isinstance(node, ast.Call) and not (isinstance(node.func, ast.Name) and node.func.id in ALLOWED_CALLS):
            return False
    return has_number


def constants(path: Path) -> list[str]:
    """Module- and class-level UPPER_CASE names assigned numbers in `path` (a class's as Class.NAME)."""
    found = []

    def scan(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                scan(node.body, f"{prefix}{node.name}.")
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, ast.AnnAssign) and node.value is not None else []
            for target in targets:
                names = target.elts if isinstance(target, ast.Tuple) else [target]
                for name in names:
                    if isinstance(name, ast.Name) and UPPER_CASE.match(name.id) and numeric(node.value):
                        found.append(prefix + name.id)

    scan(ast.parse(path.read_text()).body, "")
    return found


def scanned_constants() -> list[tuple[str, str]]:
    pairs = []
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            if not relative.startswith(GENERATED):
                pairs += [(relative, name) for name in constants(path)]
    return pairs


def table_rows() -> set[tuple[str, str]]:
    """(file, name) of every row: | `NAME` | `path/to/file.py` | ..."""
    rows = set()
    for line in TABLE.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0].startswith("`") and cells[1].startswith("`"):
            rows.add((cells[1].strip("`"), cells[0].strip("`")))
    return rows


def test_the_scan_finds_the_constants_it_should():
    source = ("A = 1\nB = (0.1, 2)\nC = 'text'\nD = torch.ones(1)\nE = {'cpu': 0.3}\nF = True\n"
              "G = tuple(range(1, 3)) + (16,)\nclass K:\n    H = 2.0\n    lower = 3\n")
    path = ROOT / "tests" / "__scan_probe__.py"
    try:
        path.write_text(source)
        assert constants(path) == ["A", "B", "E", "G", "K.H"]
    finally:
        path.unlink()


def test_every_numeric_constant_has_a_row_in_the_tuning_table():
    rows = table_rows()
    missing = [f"{name} ({path})" for path, name in scanned_constants() if (path, name) not in rows]
    assert not missing, f"add these to {TABLE.relative_to(ROOT)}: {missing}"


def test_every_row_names_a_constant_that_exists():
    """Rows for UPPER_CASE names point at a file that still assigns them (option defaults aside)."""
    def assigned(path: str, name: str) -> bool:
        return re.search(rf"^\s*(?:\w+\s*,\s*)*{re.escape(name.split('.')[-1])}\b[^=\n]*=", (ROOT / path).read_text(), re.M) is not None

    stale = [f"{name} ({path})" for path, name in table_rows()
             if UPPER_CASE.match(name.split(".")[-1]) and path.startswith(SCANNED) and not assigned(path, name)]
    assert not stale, f"rows for constants that are gone: {stale}"
