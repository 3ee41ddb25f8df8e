"""The shared runtime is a leaf: nothing in specmesh/ imports a service or the orchestrator.

The services and the orchestrator build on specmesh; an import the other way round would
tie the runtime to what runs on it (and, at import time, load both services into each).
Lazy imports inside functions count too: ast sees every import statement, wherever it is.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

RUNTIME = Path(__file__).resolve().parent.parent / "specmesh"
ABOVE_THE_RUNTIME = ("draft_service", "target_service", "orchestrator")


def imported_modules(source: str) -> list[tuple[int, str]]:
    """(line, module) of every import in `source`, relative ones aside (they stay inside specmesh)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def forbidden_imports(source: str) -> list[tuple[int, str]]:
    return [(line, module) for line, module in imported_modules(source)
            if module.split(".")[0] in ABOVE_THE_RUNTIME]


def runtime_files() -> list[Path]:
    files = sorted(RUNTIME.rglob("*.py"))  # the generated stubs in specmesh/v1 too
    assert len(files) > 10, f"found only {len(files)} runtime files under {RUNTIME}"
    return files


@pytest.mark.parametrize("path", runtime_files(), ids=lambda path: str(path.relative_to(RUNTIME)))
def test_the_runtime_imports_no_service_and_no_orchestrator(path):
    assert forbidden_imports(path.read_text()) == []


@pytest.mark.parametrize("source", [
    "from draft_service.server import create_server",
    "import target_service.engine",
    "import os, orchestrator",
    "def later():\n    from orchestrator.deployment import replicas\n",
    "if True:\n    import draft_service as d\n",
])
def test_the_check_finds_every_kind_of_import(source):
    assert len(forbidden_imports(source)) == 1


@pytest.mark.parametrize("source", [
    "from specmesh.engine import ModelEngine",
    "from . import engine",
    "import orchestrators_elsewhere",
    "# from orchestrator import loop",
])
def test_the_check_lets_the_runtime_and_lookalikes_through(source):
    assert forbidden_imports(source) == []
