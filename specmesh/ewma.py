"""The one exponentially weighted moving average every learned cost and rate in specmesh uses."""

from __future__ import annotations

import math


class Ewma:
    """An average that follows its samples: each new one moves it by `weight` of the gap.

    Empty until the first sample, which it takes as it is; non-finite samples are ignored, so a
    garbage measurement never poisons what was learned.
    """

    def __init__(self, weight: float, value: float | None = None):
        if not 0.0 < weight <= 1.0:
            raise ValueError(f"weight must be in (0, 1], got {weight}")
        self.weight = weight
        self.value = value

    def update(self, sample: float) -> float | None:
        if math.isfinite(sample):
            self.value = sample if self.value is None else self.value + self.weight * (sample - self.value)
        return self.value

    def reset(self) -> None:
        self.value = None

    def get(self, default: float) -> float:
        return default if self.value is None else self.value


def kept_over(keep: float, share: float) -> float:
    """What an average that keeps `keep` of its evidence over one step keeps over `share` of a step (a
    session's round among n side by side counts 1/n of the batch's): `share` steps of it make one step's."""
    return keep if share == 1.0 else keep ** share
