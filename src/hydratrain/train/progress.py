"""What a run has done and what it ends with: :class:`TrainProgress` (checkpointed: where the run is) and
:class:`FitResult` (the final figures ``results.json`` holds). Plain data, read by the trainer, the step logger,
the outputs and the callbacks."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional


@dataclass
class TrainProgress:
    """Where a run is (Stateful): optimizer ``step`` done, steps whose update was skipped (fp16 scaler or
    non-finite), how many of the latest were skipped in a row, the train loss of step 1 (kept across resumes), and
    the logging window's steps up to the last checkpoint save (``window_loss_sum``: the sum over them of the ranks'
    mean loss; ``window_steps``: how many), folded over ranks by ``StepLogger.fold_window``, so the same on every
    rank and on any world size a resume has."""

    step: int = 0
    skipped_steps: int = 0
    consecutive_skipped: int = 0
    first_loss: float = math.nan
    window_loss_sum: float = 0.0
    window_steps: int = 0

    def state_dict(self) -> dict:
        return dict(self.__dict__)

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.consecutive_skipped = int(state.get("consecutive_skipped", 0))
        self.first_loss = float(state.get("first_loss", math.nan))
        self.window_loss_sum = float(state.get("window_loss_sum", 0.0))  # (absent before: the window was per rank)
        self.window_steps = int(state.get("window_steps", 0))


@dataclass
class FitResult:
    """Final figures of a run (rank-0 view, all reduced across ranks)."""

    steps: int = 0  # the step the run ended at
    steps_this_launch: int = 0  # steps trained by this launch (fewer than ``steps`` after a resume)
    first_loss: float = math.nan  # train loss of step 1
    train_loss: float = math.nan  # mean train loss of the last logging window
    eval_loss: float = math.nan
    eval_perplexity: float = math.nan
    eval_metrics: dict = field(default_factory=dict)  # the final eval's {name: value} of every `metrics` entry
    objective: float = math.nan  # the final eval's value of trainer.objective (what a sweeper optimises)
    tokens_per_sec: float = math.nan  # over the timed windows together, excluding the first step, eval and saves
    samples_per_sec: float = math.nan  # the same in samples (tokens / seq_len for token data)
    mfu: float = math.nan
    data_wait_fraction: float = math.nan  # share of the timed step time rank 0 spent waiting for its next batch
    peak_memory_bytes: int = 0  # max over ranks
    planned_peak_memory_bytes: int = 0  # the memory planner's prediction made at the start, max over ranks
    skipped_steps: int = 0
    seconds: float = 0.0
    preempted: bool = False  # stopped early by a preemption signal after saving a checkpoint (no final eval)
    startup_s: dict = field(default_factory=dict)  # start-up phases up to the first step, seconds (timing.record)
    test_metrics: dict = field(default_factory=dict)  # the test split's {name: value} (trainer.test_after_fit)
    best: Optional[dict] = None  # {"step": ..., <checkpoint.monitor>: value} of the best evaluation, when monitored
    stopped_early: Optional[str] = None  # why a callback stopped the run before max_steps (early stopping), or None
