"""Start-up objects left out of the garbage collector's full collections.

A process that has imported torch, transformers and grpc holds some 430,000 objects that live as
long as it does. Every full (generation 2) collection walks them all, a pause of hundreds of ms
on a small CPU while the orchestrator's event loop (every stream) or a service's step waits
(docs/design/cpu-kernels-and-precision.md). Frozen once start-up is
over (`gc.freeze`), they are left out of every later collection; what serving allocates is still
collected, and a frozen object is still freed when its last reference goes.
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)


def freeze_start_up_heap(process: str) -> int:
    """Collect what start-up left behind, then freeze the rest; the number of objects frozen."""
    gc.collect()  # start-up's own garbage is freed, not frozen
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("%s: %d start-up objects left out of garbage collection (gc.freeze)", process, frozen)
    return frozen
