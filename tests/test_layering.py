"""Imports go one way: down the tiers, never up, never sideways between peers.

The shared runtime (specmesh/) is a leaf: nothing in it imports a service or the orchestrator; an
import the other way round would tie the runtime to what runs on it (and, at import time, load both
services into each). Inside the orchestrator the packages are cut by what runs when (README,
"Architecture"): the algorithm (`decoding`) under the serving path (`serving`: front doors, clients,
round streams, pools, failover), under `control` (supervision, launch, Ray, scaling, rollouts), under
the prompt sets the tools share, under the tools (`bench`, `distill`), under the command line (`cli`,
`python -m orchestrator`). So a request's path never loads what supervises it or what trains its draft.
Inside specmesh/ likewise: shared leaves < model loading < the engine < the server plumbing.
Lazy imports inside functions count too: ast sees every import statement, wherever it is.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
RUNTIME = ROOT / "specmesh"
ABOVE_THE_RUNTIME = ("draft_service", "target_service", "orchestrator")
# Lowest first. A package may import its own modules and those of the tiers below it; packages in one
# tier are peers and import nothing of each other.
ORCHESTRATOR_TIERS = (
    ("orchestrator.decoding",),
    ("orchestrator.serving",),
    ("orchestrator.control",),
    ("orchestrator.prompts",),
    ("orchestrator.bench", "orchestrator.distill"),
    ("orchestrator.cli", "orchestrator.__main__"),
)
# The runtime's own groups, lowest first: shared leaves, model loading, the engine, the server plumbing (whose
# `service` starts a model service over a loaded engine).
RUNTIME_TIERS = (
    ("specmesh.errors", "specmesh.ewma", "specmesh.gathering", "specmesh.heap", "specmesh.roles", "specmesh.timing_noise",
     "specmesh.v1"),
    ("specmesh.loading",),
    ("specmesh.engine",),
    ("specmesh.server",),
)


def imported_modules(source: str) -> list[tuple[int, str]]:
    """(line, module) of every import in `source`, relative ones aside (none are used). `from a.b import c`
    counts as `a.b.c`: c may be a module of the package a.b."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
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
    "def later():\n    from orchestrator.control import replicas\n",
    "if True:\n    import draft_service as d\n",
])
def test_the_check_finds_every_kind_of_import(source):
    assert len(forbidden_imports(source)) == 1


@pytest.mark.parametrize("source", [
    "from specmesh.engine.model_engine import ModelEngine",
    "from . import engine",
    "import orchestrators_elsewhere",
    "# from orchestrator import loop",
])
def test_the_check_lets_the_runtime_and_lookalikes_through(source):
    assert forbidden_imports(source) == []


# ---- the orchestrator's tiers

def package_of(module: str, tiers=ORCHESTRATOR_TIERS) -> str | None:
    """The tiered package `module` (dotted) is in or is, None when it is in none of them."""
    for tier in tiers:
        for package in tier:
            if module == package or module.startswith(package + "."):
                return package
    return None


def tier_of(package: str, tiers=ORCHESTRATOR_TIERS) -> int:
    return next(index for index, tier in enumerate(tiers) if package in tier)


def upward_imports(module: str, source: str, tiers=ORCHESTRATOR_TIERS) -> list[tuple[int, str]]:
    """(line, module) of every import in `source` (the module `module`) of a package in its own tier or
    above, other than its own package."""
    own = package_of(module, tiers)
    found = []
    for line, imported in imported_modules(source):
        other = package_of(imported, tiers)
        if imported.split(".")[0] == own.split(".")[0] and other is None and imported.count(".") == 1:
            found.append((line, imported))  # `from orchestrator import x`: a package no tier holds
        elif other is not None and other != own and tier_of(other, tiers) >= tier_of(own, tiers):
            found.append((line, imported))
    return found


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def tiered_files(root: str) -> list[Path]:
    """Every module under `root` but its top __init__.py (which imports nothing)."""
    return sorted(path for path in (ROOT / root).rglob("*.py") if path != ROOT / root / "__init__.py")


@pytest.mark.parametrize(("root", "tiers"), [("orchestrator", ORCHESTRATOR_TIERS), ("specmesh", RUNTIME_TIERS)])
def test_every_module_is_in_a_tier(root, tiers):
    """A new package (or top-level module) gets its place in the tiers, and in the README, on purpose."""
    files = tiered_files(root)
    assert len(files) > 30
    assert [module_name(path) for path in files if package_of(module_name(path), tiers) is None] == []


@pytest.mark.parametrize("path", tiered_files("orchestrator"), ids=lambda path: str(path.relative_to(ROOT)))
def test_orchestrator_imports_go_down_the_tiers(path):
    assert upward_imports(module_name(path), path.read_text()) == []


@pytest.mark.parametrize("path", tiered_files("specmesh"), ids=lambda path: str(path.relative_to(ROOT)))
def test_runtime_imports_go_down_its_groups(path):
    assert upward_imports(module_name(path), path.read_text(), RUNTIME_TIERS) == []


@pytest.mark.parametrize(("module", "source"), [
    ("orchestrator.serving.pool", "from orchestrator.control.supervisor import LocalPoolController"),
    ("orchestrator.serving.servicer", "import orchestrator.cli.main"),
    ("orchestrator.decoding.loop", "def later():\n    from orchestrator.serving import clients\n"),
    ("orchestrator.control.pools", "from orchestrator.distill.online import OnlineDistiller"),
    ("orchestrator.control.launch", "if True:\n    from orchestrator.bench import app as bench\n"),
    ("orchestrator.bench.app", "from orchestrator.distill import examples"),  # peers
    ("orchestrator.distill.examples", "import orchestrator.bench.args"),
    ("orchestrator.serving.server", "from orchestrator import control"),
    ("orchestrator.serving.server", "from orchestrator import something_untiered"),
])
def test_the_tier_check_finds_every_upward_import(module, source):
    assert len(upward_imports(module, source)) == 1


@pytest.mark.parametrize(("module", "source"), [
    ("orchestrator.serving.pool", "from orchestrator.serving.clients import DraftClient"),
    ("orchestrator.serving.servicer", "from orchestrator.decoding.loop import run_round"),
    ("orchestrator.control.build", "from orchestrator.serving import servicer"),
    ("orchestrator.cli.main", "from orchestrator.distill.online import online_distill_options"),
    ("orchestrator.__main__", "import orchestrator.control.launch"),
    ("orchestrator.serving.server", "import orchestrators_elsewhere.control"),
    ("orchestrator.serving.server", "# from orchestrator.control import launch"),
])
def test_the_tier_check_lets_downward_imports_through(module, source):
    assert upward_imports(module, source) == []


@pytest.mark.parametrize(("module", "source", "upward"), [
    ("specmesh.loading.models", "from specmesh.engine.model_engine import ModelEngine", 1),
    ("specmesh.engine.session", "def later():\n    from specmesh.server import metrics\n", 1),
    ("specmesh.errors", "import specmesh.roles", 1),  # leaves are peers
    ("specmesh.server.service", "from specmesh.engine.model_engine import ModelEngine", 0),
    ("specmesh.engine.model_engine", "from specmesh.loading import models\nfrom specmesh.errors import Invalid", 0),
])
def test_the_runtime_group_check(module, source, upward):
    assert len(upward_imports(module, source, RUNTIME_TIERS)) == upward
