"""A draft's OpenMP threads give their cores back soon: a draft often shares cores with its target.

torch runs its CPU kernels on OpenMP (libgomp), whose idle threads spin at every barrier for
about 300,000 iterations (milliseconds) before they sleep. Alone, that saves a wake-up between
kernels. Beside another busy process on the same cores (the embedded deployment, a draft and a
target on one CPU; replicas sharing a Ray node) a spinning thread holds a core that a working
thread of the other process needs, and it is the draft's spinning that stalls the pair
(measured by `benchmarks/openmp_contention.py`; figures in docs/design/cpu-kernels-and-precision.md).

So the draft role starts with a short spin (specmesh.roles: Role.openmp_spin_count) and the
target keeps libgomp's own: alone a short spin costs each step a wake-up per kernel, a few percent
of the target's step.

libgomp reads the setting once, when it loads (at `import torch`), so it must be in a process's
environment before that: the local launcher spawns a draft replica with it
(`child_environment`), a Ray draft replica gets it in its runtime_env, and `python -m
draft_service` sets it before it imports torch. A user's own OMP_WAIT_POLICY or GOMP_SPINCOUNT
is left as it is.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

from specmesh.roles import Role

USER_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def spin_environment(role: Role) -> dict[str, str]:
    """What a process of `role` should start with: nothing where the role keeps libgomp's own
    spin or the user chose a setting."""
    if role.openmp_spin_count is None or any(name in os.environ for name in USER_SETTINGS):
        return {}
    return {"GOMP_SPINCOUNT": role.openmp_spin_count}


def set_spin_count(role: Role) -> None:
    """For this process: call before torch is imported."""
    os.environ.update(spin_environment(role))


@contextlib.contextmanager
def child_environment(role: Role) -> Iterator[None]:
    """While a child of `role` is spawned (it inherits this environment), then as it was."""
    settings = spin_environment(role)
    os.environ.update(settings)
    try:
        yield
    finally:
        for name in settings:
            os.environ.pop(name, None)
