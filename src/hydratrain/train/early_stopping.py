"""Early stopping: a callback that stops the run when a metric stops improving.

    python train.py trainer.early_stopping.monitor=eval/loss trainer.early_stopping.patience=3

After each evaluation it compares ``monitor``'s value with the best so far (``mode``, ``min_delta``). After
``patience`` evaluations in a row without an improvement it asks the run to stop; the stop line names the metric,
its best value and that value's step, and the run ends as a normal one (final evaluation, outputs). Its counter is
checkpointed, so a run killed and resumed stops at the same step as the uninterrupted one.
"""
from __future__ import annotations

import logging
from typing import Optional

from hydratrain.train.callbacks import Callback, RunView, improves

log = logging.getLogger("hydratrain.callbacks")


class EarlyStopping(Callback):
    def __init__(self, monitor: str = "eval/loss", mode: str = "min", patience: int = 3, min_delta: float = 0.0):
        self.monitor, self.mode, self.patience, self.min_delta = monitor, str(mode), int(patience), float(min_delta)
        self.best: Optional[float] = None
        self.best_step = 0
        self.evals_without_improvement = 0

    def on_eval_end(self, run: RunView, step: int, metrics: dict) -> None:
        value = metrics.get(self.monitor)
        if value is None:
            return
        if improves(value, self.best, self.mode, self.min_delta):
            self.best, self.best_step, self.evals_without_improvement = float(value), step, 0
            return
        self.evals_without_improvement += 1
        if self.evals_without_improvement >= self.patience and step < run.max_steps:
            run.request_stop(f"early stopping: {self.monitor} has not improved on its best, {self.best:.6g} at step "
                             f"{self.best_step}, in {self.evals_without_improvement} evaluations "
                             f"(trainer.early_stopping.patience={self.patience}, mode={self.mode}, "
                             f"min_delta={self.min_delta:g})")

    def state_dict(self) -> dict:
        return {"best": self.best, "best_step": self.best_step,
                "evals_without_improvement": self.evals_without_improvement}

    def load_state_dict(self, state: dict) -> None:
        best = state.get("best")
        self.best = None if best is None else float(best)
        self.best_step = int(state.get("best_step", 0))
        self.evals_without_improvement = int(state.get("evals_without_improvement", 0))
