"""What control knows of training the draft in the background while serving: this interface, nothing more.

Online distillation (orchestrator.distill.online) is a tool, above control. The command line puts its
settings in `PoolsOptions.online_distill`; the pools ask them for a trainer over themselves once started, the
builder feeds it every finished request, so no control module imports the tool (tests/test_layering.py).
"""

from __future__ import annotations

from typing import Protocol, Sequence


class DraftTrainer(Protocol):
    """Runs beside the pools from `start()` to `stop()`; rolls a better draft out through `pools.replace_model`."""

    def start(self) -> None: ...

    async def stop(self) -> None: ...

    def served(self, prompt_token_ids: Sequence[int], completion_tokens: int) -> None:
        """A finished request; called on the serving path, so it must be quick."""


class DraftTraining(Protocol):
    """The settings of a draft trainer, as `PoolsOptions` carries them (pickled to Ray with the rest)."""

    cpus: float  # what one training run takes; a local Ray cluster is sized for it

    def trainer(self, *, pools, metrics) -> DraftTrainer:
        """`pools`: orchestrator.control.pools.Pools; `metrics`: specmesh.server.metrics.OrchestratorMetrics."""
