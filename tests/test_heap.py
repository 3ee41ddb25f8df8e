"""Start-up objects are frozen out of full collections; what serving allocates is still collected
(specmesh.heap). In a fresh interpreter: freezing this test process would freeze every test's objects."""

from __future__ import annotations

import subprocess
import sys

AFTER_START_UP = """
import gc, weakref
import specmesh.server.service  # what a service imports: torch, transformers, grpc
from specmesh.heap import freeze_start_up_heap

frozen = freeze_start_up_heap("test")
class Node:
    pass
node = Node(); node.self = node  # a cycle made while serving: only a collection frees it
alive = weakref.ref(node)
del node
gc.collect()
print(frozen, gc.get_freeze_count(), alive() is None)
"""


def test_start_up_objects_are_frozen_and_serving_garbage_is_still_collected():
    done = subprocess.run([sys.executable, "-c", AFTER_START_UP], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    frozen, still_frozen, collected = done.stdout.split()
    assert int(frozen) > 100_000 and int(still_frozen) == int(frozen)  # torch alone brings more
    assert collected == "True"
