"""Early stopping on the validation prompts: the best weights so far, and when to give up.

Every `interval` steps the validation score (higher is better) is measured on the current weights.
An improvement snapshots the trainable tensors (the LoRA adapter, or every weight of a full fine-tune).
After `patience` evaluations without one, the learning rate was too high for where training is:
the best weights come back, the rate is cut, and training goes on; once the cuts are spent, it stops.
Training always ends on the best weights measured, so a budget or rate too large costs time, not quality.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from orchestrator.distill.defaults import LEARNING_RATE_CUTS, PATIENCE

CUT_FACTOR = 1 / 3  # twice cut, the rate that last improved is a ninth: near a standstill

IMPROVED, WAIT, CUT, STOP = "improved", "wait", "cut", "stop"


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


@torch.no_grad()
def load_trainable_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    for name, parameter in model.named_parameters():
        if name in state:
            parameter.copy_(state[name])


@dataclass
class EarlyStopping:
    score: Callable[[torch.nn.Module], float]  # the validation score of the model's current weights
    interval: int  # optimiser steps between evaluations
    patience: int = PATIENCE  # 0: no early stopping, the last weights are kept
    cuts_left: int = LEARNING_RATE_CUTS
    best: float = float("-inf")
    best_step: int = 0
    history: list[tuple[int, float]] = field(default_factory=list)  # (step, score) of every evaluation
    _best_state: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    _waited: int = 0

    @property
    def enabled(self) -> bool:
        return self.patience > 0

    def due(self, step: int, last_step: bool) -> bool:
        return self.enabled and (step % self.interval == 0 or last_step)

    def evaluate(self, model: torch.nn.Module, step: int) -> str:
        """Measures the weights after `step` steps: IMPROVED, WAIT, CUT (the best weights are back:
        cut the learning rate) or STOP."""
        model.eval()
        score = self.score(model)
        model.train()
        self.history.append((step, score))
        if score > self.best:
            self.best, self.best_step, self._waited = score, step, 0
            self._best_state = trainable_state(model)
            return IMPROVED
        self._waited += 1
        if self._waited < self.patience:
            return WAIT
        if self.cuts_left == 0:
            return STOP
        self.cuts_left -= 1
        self._waited = 0
        load_trainable_state(model, self._best_state)
        return CUT

    def restore_best(self, model: torch.nn.Module) -> None:
        if self.enabled and self._best_state:
            load_trainable_state(model, self._best_state)
