"""What a forward step costs the target and the draft, as their services last reported it.

Each service measures its step costs at start-up and keeps them current
(specmesh.engine.step_costs); every GetModelInfo carries them (ModelInfo.step_costs, with the
start-up measurements in ModelInfo.planned_step_costs, the fitted model in
ModelInfo.step_model). The orchestrator keeps the latest report per role here, fed from every
ModelInfo it gets: at start-up, and with pools at each health check of each replica (the
latest report of any replica of the role wins: replicas of one pool serve one model on like
hardware). The draft-length policy prices steps with `target.step_s(shape)` and `draft.step_s(shape)`.
"""

from __future__ import annotations

import time

from specmesh.engine.step_costs import StepCosts
from specmesh.v1 import common_pb2

ROLES = ("target", "draft")


class StepReports:
    def __init__(self) -> None:
        self.target: StepCosts | None = None  # None: no report with costs yet
        self.draft: StepCosts | None = None
        self.updated_at: dict[str, float] = {}  # role -> time.monotonic() of its latest report with costs

    def update(self, role: str, info: common_pb2.ModelInfo | None) -> None:
        """Take the costs `info` reports for `role`. A report without usable costs (a service that
        has not measured them, or garbage) keeps the last good table."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, not {role!r}")
        costs = StepCosts.from_proto(info) if info is not None else None
        if costs is None:
            return
        setattr(self, role, costs)
        self.updated_at[role] = time.monotonic()
