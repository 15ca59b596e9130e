"""A ``torch.profiler`` trace of a window of optimizer steps on every rank: a callback that
:mod:`hydratrain.train.extras` builds when ``trainer.profile.steps`` is set.

    torchrun --nproc_per_node 2 train.py trainer.profile.steps=[10,12]

The profiler records from the start of step ``first`` (its data fetch) to the start of step ``last + 1``, so each
step's log line, evaluation and checkpoint save are in it; when ``last`` is the run's last step (or a callback stops
the run inside the window) it records until the end of the fit, final save and evaluation included. Activities: the
CPU, and CUDA on a GPU. Each step is a range ``hydratrain/step_<n>``; inside it the trainer's own ranges
(``hydratrain/data_wait``, ``forward``, ``backward``, ``grad_sync``, ``optimizer_step``, ``checkpoint_save``) label
its phases. Each rank writes, when the window closes:

- ``<run dir>/profile/rank<N>.pt.trace.json``: a Chrome trace (ui.perfetto.dev, chrome://tracing, or TensorBoard's
  profile plugin with ``--logdir <run dir>/profile``: ``rank<N>`` is the worker's name);
- on CUDA, ``<run dir>/profile/rank<N>_memory.pickle``: the allocator's history over the window
  (``torch.cuda.memory._record_memory_history``), which pytorch.org/memory_viz opens.

Outside the window no profiler runs; the trainer's ranges cost a few microseconds a step then. A resumed run whose
first step is inside the window records from that step; one preempted inside it writes no trace.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from hydratrain.train.callbacks import Callback, RunView

log = logging.getLogger("hydratrain.callbacks")

DIR = "profile"


class StepProfiler(Callback):
    """Profiles optimizer steps ``first..last`` (``trainer.profile.steps``) on ``device`` (a CUDA device adds its
    kernels and the memory history)."""

    def __init__(self, first: int, last: int, device: torch.device):
        self.first, self.last, self.device = first, last, device
        self.cuda = device.type == "cuda"
        self.prof: Optional[profile] = None
        self.step_range: Optional[record_function] = None
        self.steps: list[int] = []  # the steps this launch traced

    def on_train_step_start(self, run: RunView, step: int) -> None:
        self._end_step_range()
        if self.prof is not None and step > self.last:
            self._stop(run)
        elif self.prof is None and not self.steps and self.first <= step <= self.last:
            self._start()
        if self.prof is not None:
            self.step_range = record_function(f"hydratrain/step_{step}")
            self.step_range.__enter__()
            self.steps.append(step)

    def on_fit_end(self, run: RunView, result: Any) -> None:
        self._end_step_range()
        if self.prof is not None:
            self._stop(run)

    def _start(self) -> None:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        if self.cuda:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        self.prof = profile(activities=activities)
        self.prof.start()

    def _end_step_range(self) -> None:
        if self.step_range is not None:
            self.step_range.__exit__(None, None, None)
            self.step_range = None

    def _stop(self, run: RunView) -> None:
        assert self.prof is not None
        self.prof.stop()
        out = Path(run.run_dir) / DIR
        out.mkdir(parents=True, exist_ok=True)
        trace = out / f"rank{run.rank}.pt.trace.json"
        self.prof.export_chrome_trace(str(trace))
        self.prof = None
        if self.cuda:
            torch.cuda.memory._dump_snapshot(str(out / f"rank{run.rank}_memory.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
        log.info("profile: steps %d-%d traced to %s", self.steps[0], self.steps[-1], trace)
