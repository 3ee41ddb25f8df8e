"""A draft service starts with a short OpenMP spin, a target with libgomp's own (specmesh.loading.openmp).

libgomp reads GOMP_SPINCOUNT once, when torch loads it: what counts is the environment at the
moment `import torch` runs, which each entry point, imported in a fresh interpreter, reports here.
The local launcher's replicas are checked in test_local_pools.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from specmesh.loading import openmp
from specmesh.roles import DRAFT

# Imports the entry point and prints GOMP_SPINCOUNT as torch's import begins, then exits: what
# follows cannot change what libgomp read (and loading torch would take seconds per case).
AT_TORCH_IMPORT = """
import os, sys
class Watch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            print(os.environ.get("GOMP_SPINCOUNT"), flush=True)
            os._exit(0)
sys.meta_path.insert(0, Watch())
import {module}
print("torch not imported")
"""


def spin_at_torch_import(module: str, **settings: str) -> str:
    env = {name: value for name, value in os.environ.items() if name not in openmp.USER_SETTINGS}
    done = subprocess.run([sys.executable, "-c", AT_TORCH_IMPORT.format(module=module)], env={**env, **settings},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


def test_python_m_draft_service_sets_the_short_spin_before_torch_loads():
    assert spin_at_torch_import("draft_service.__main__") == DRAFT.openmp_spin_count


def test_python_m_target_service_keeps_libgomps_own_spin():
    assert spin_at_torch_import("target_service.__main__") == "None"


@pytest.mark.parametrize("setting, expected", [({"OMP_WAIT_POLICY": "ACTIVE"}, "None"),
                                               ({"GOMP_SPINCOUNT": "123"}, "123")])
def test_a_users_own_openmp_setting_is_left_as_it_is(setting, expected):
    assert spin_at_torch_import("draft_service.__main__", **setting) == expected


def test_spawning_a_draft_child_leaves_the_parents_environment_as_it_was(monkeypatch):
    for name in openmp.USER_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    with openmp.child_environment(DRAFT):
        assert os.environ["GOMP_SPINCOUNT"] == DRAFT.openmp_spin_count
    assert "GOMP_SPINCOUNT" not in os.environ
