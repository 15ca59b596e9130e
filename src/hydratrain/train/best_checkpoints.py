"""The best checkpoints by a metric: a callback that keeps the ``save_top_k`` best and exports the best weights.

    python train.py checkpoint.monitor=eval/accuracy checkpoint.mode=max checkpoint.save_top_k=2

After each evaluation whose ``checkpoint.monitor`` value enters the top k (by ``checkpoint.mode``), the run saves a
checkpoint of that step (if the step has none yet). Those checkpoints are kept beside the ``checkpoint.keep_last``
latest ones that resume uses; one pushed out of the top k is deleted at once, unless it is among the latest.
``best_checkpoints.json`` in the run dir lists them, best first (step, value, path). At the end of the run the best
one's weights are written as ``best/model.safetensors`` (the format of ``model.safetensors``). With
``trainer.objective_at=best``, ``results.json`` and a sweeper get ``trainer.objective``'s value at the best
evaluation instead of the final one. The list is checkpointed, so a resumed run keeps ranking where it left off.
"""
from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any, Optional

from hydratrain.checkpoint.export import export
from hydratrain.checkpoint.manager import CheckpointManager, step_dir_name
from hydratrain.train.callbacks import Callback, RunView, improves

log = logging.getLogger("hydratrain.callbacks")

RECORD = "best_checkpoints.json"


class BestCheckpoints(Callback):
    def __init__(self, manager: CheckpointManager, monitor: str, mode: str = "min", save_top_k: int = 1,
                 objective: str = "eval/loss", objective_at_best: bool = False):
        self.manager, self.monitor, self.mode, self.k = manager, monitor, str(mode), int(save_top_k)
        self.objective, self.objective_at_best = objective, objective_at_best
        self.best: list[dict] = []  # {"step", "value", "objective"}, best first

    # --------------------------------------------------------------------------------------------------- hooks
    def on_eval_end(self, run: RunView, step: int, metrics: dict) -> None:
        value = metrics.get(self.monitor)
        if value is None or not math.isfinite(value) or any(b["step"] == step for b in self.best):
            return
        if len(self.best) >= self.k and not improves(value, self.best[-1]["value"], self.mode):
            return
        entry = {"step": step, "value": float(value), "objective": _number(metrics.get(self.objective))}
        better = [b for b in self.best if not improves(value, b["value"], self.mode)]  # ties: the earlier first
        self.best = (better + [entry] + [b for b in self.best if b not in better])[:self.k]
        self._protect()
        if self.manager.last_saved_step == step:  # (saved before this evaluation: the run's last step)
            self._write_record(run)
        else:
            run.request_checkpoint()

    def on_checkpoint_saved(self, run: RunView, step: int, path: Path) -> None:
        if any(b["step"] == step for b in self.best):
            self._write_record(run)

    def on_fit_end(self, run: RunView, result: Any) -> None:
        if not self.best:
            return
        top = self.best[0]
        if self.objective_at_best and top["objective"] is not None:
            result.objective = top["objective"]
        result.best = {"step": top["step"], self.monitor: top["value"]}
        if run.is_main:
            ckpt = self.manager.root / step_dir_name(top["step"])
            out = export(ckpt, run.run_dir / "best" / "model.safetensors")
            log.info("best checkpoint by %s (%s): step %d, %.6g; its weights: %s", self.monitor, self.mode,
                     top["step"], top["value"], out)

    # -------------------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict:
        return {"best": json.dumps(self.best)}

    def load_state_dict(self, state: dict) -> None:
        self.best = json.loads(state.get("best") or "[]")
        self._protect(prune=False)  # (while resuming: the next ranking prunes)

    # ----------------------------------------------------------------------------------------------- helpers
    def _protect(self, prune: bool = True) -> None:
        self.manager.protect({b["step"] for b in self.best}, prune)

    def _write_record(self, run: RunView) -> None:
        if not run.is_main:
            return
        record = {"monitor": self.monitor, "mode": self.mode, "save_top_k": self.k,
                  "best": [{**b, "path": str(self.manager.root / step_dir_name(b["step"]))} for b in self.best]}
        path = run.run_dir / RECORD
        tmp = path.with_name(f".{RECORD}.tmp")
        tmp.write_text(json.dumps(record, indent=1) + "\n")
        os.replace(tmp, path)


def _number(value: Optional[float]) -> Optional[float]:
    return float(value) if value is not None else None
