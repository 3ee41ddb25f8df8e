"""A model replica imports what it serves with, and nothing of the tools, at its start.

A replaced replica (killed mid-stream, started again by the supervisor) serves only once its
process has imported its modules; on a small CPU those imports are most of its start
(benchmarks/replica_restart.py measures it). Plotting, training, benchmarking, Ray, the HTTP
front door and the tracing SDK (while tracing is off) have no place in them. Each case runs a
fresh interpreter: this test process has imported everything already.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.control.template import PRELOAD

ROOT = Path(__file__).resolve().parent.parent

# What a replica's start must not import, each with what it is there for.
NOT_AT_START = {
    "matplotlib": "plots of specmesh bench and specmesh distill",
    "peft": "LoRA adapters of specmesh distill",
    "hypothesis": "the tests' property checks",
    "ray": "--backend ray only",
    "fastapi": "the orchestrator's HTTP API",
    "uvicorn": "the orchestrator's HTTP API",
    "httpx": "specmesh bench's HTTP client",
    "openai": "the tests' client",
    "orchestrator.bench": "specmesh bench",
    "orchestrator.distill": "specmesh distill (online distillation runs it as a child process)",
    "orchestrator.serving.http_api": "the orchestrator's HTTP API",
    "opentelemetry.sdk": "tracing, loaded where a service traces (specmesh.server.telemetry)",
    "opentelemetry.instrumentation": "tracing, loaded where a service traces (specmesh.server.telemetry)",
    "opentelemetry.exporter": "tracing, loaded where a service exports spans",
}

ENTRY_POINTS = {
    # `python -m target_service|draft_service`, and the servers every deployment creates
    "model services": ["target_service.__main__", "draft_service.__main__", "target_service.server",
                       "draft_service.server", "orchestrator.control.replicas"],
    # a `specmesh serve` replica where it is spawned (the template cannot serve it): a child that imports
    # its parent's main module (the CLI) as __mp_main__ and the supervisor, whose run_replica it unpickles
    "supervised replica": ["orchestrator.cli.main", "orchestrator.control.supervisor"],
    # the warm template the supervisor forks its replicas from (orchestrator.control.template.PRELOAD)
    "replica template": ["orchestrator.control.template", *(name for name in PRELOAD if name != "__main__")],
}


def modules_after_importing(modules: list[str]) -> set[str]:
    code = "; ".join([f"import {module}" for module in modules]
                     + ["import json, sys", "print(json.dumps(sorted(sys.modules)))"])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return set(json.loads(done.stdout.strip().splitlines()[-1]))


def unwanted(imported: set[str]) -> dict[str, str]:
    return {name: why for name, why in NOT_AT_START.items()
            if any(module == name or module.startswith(name + ".") for module in imported)}


@pytest.mark.parametrize("case", list(ENTRY_POINTS))
def test_a_replica_start_imports_no_tool_modules(case):
    imported = modules_after_importing(ENTRY_POINTS[case])
    assert {"torch", "grpc", "specmesh.server.service"} <= imported  # the listing is the serving path's
    assert unwanted(imported) == {}


def test_the_check_finds_a_module_and_its_submodules():
    assert unwanted({"torch", "matplotlib.pyplot", "opentelemetry.sdk.trace", "orchestrator.distill"}) == {
        name: NOT_AT_START[name] for name in ("matplotlib", "opentelemetry.sdk", "orchestrator.distill")}
    assert unwanted({"torch", "rayon", "opentelemetry.trace", "orchestrator.distiller",
                     "orchestrator.control.pools"}) == {}
