"""What the loop reports, and when: log lines, TensorBoard scalars and the progress bar.

Each logged scalar means exactly this (docs/metrics.md):

- ``train/loss``: mean over the steps of the logging window (since the previous log line) and over ranks of each
  step's loss, itself the mean next-token cross-entropy (nats/token) over the step's micro-batches. A step whose
  update was dropped (non-finite, ``train/skipped_steps``) is left out, as Megatron-LM leaves skipped iterations out
  of its loss averages: its loss is usually NaN and would hide the other steps'; NaN when every step was dropped.
- ``train/lr``: the learning rate the optimizer update of that step used.
- ``train/grad_norm``: that step's global L2 gradient norm before clipping (all ranks and shards).
- ``perf/tokens_per_sec`` (token data; ``perf/samples_per_sec`` for a dataset): tokens of all ranks over the wall
  time of the window's steps, eval and checkpoint time excluded (:meth:`StepLogger.paused`); ``perf/mfu``: the
  model FLOPs of those tokens (or samples) as a fraction of the peak (``hydratrain.metrics``; not logged when the
  peak is not known).
- ``perf/data_wait``: the share of that time rank 0 spent waiting for its next micro-batch (the loader works one
  batch ahead, so this stays near 0).
- ``mem/peak``: this rank's peak memory so far in bytes (``hydratrain.metrics.peak_memory_bytes``).
- ``train/loss_scale``, ``train/skipped_steps`` (fp16; skipped steps also count non-finite steps skipped with
  ``trainer.on_nonfinite=skip``).

Losses stay on the device between log steps: the one host synchronisation is the all-reduce at a log step, which also
carries each rank's preemption vote (``hydratrain.checkpoint.preemption``).
"""
from __future__ import annotations

import contextlib
import logging
import math
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterable, Iterator, Optional

import torch

from hydratrain.dist.collectives import all_reduce_mean
from hydratrain.metrics import TensorBoardLogger, peak_memory_bytes
from hydratrain.train.trackers import Tracker, Trackers

log = logging.getLogger("hydratrain.trainer")

LINE_TAGS = ("train/", "perf/", "mem/")  # prefixes of the scalars a log line writes (:meth:`StepLogger.log`)


class StepLogger:
    """The logging window, throughput, TensorBoard and the other trackers, and progress.

    The window's loss sums are kept per rank between log steps (no synchronisation); a checkpoint save folds them
    over ranks into ``progress`` (:meth:`fold_window`), so a resume continues the window exactly on any world size.
    (Stateful too, for checkpoints written before: their per-rank sums.)

    Args:
        run_dir: TensorBoard events go to ``<run_dir>/tensorboard`` (rank 0, when ``tensorboard``).
        device: where the window's loss sum lives.
        tokens_per_step: items (tokens, or samples: ``unit``) of all ranks per optimizer step.
        flops_per_token, peak_flops_total: for MFU: training FLOPs per item, and the peak of all ranks together
            (FLOP/s).
        unit: ``tokens`` (token data) or ``samples``; names the throughput scalar ``perf/<unit>_per_sec``.
        tokens_per_sample: items per sample (``seq_len`` for tokens, 1 for samples).
        log_every: log every this many steps (and at step 1 and the last step).
        is_main: rank 0 (writes TensorBoard, shows the bar).
        trackers: rank 0's other trackers (``hydratrain.train.trackers``): ``self.trackers`` sends each of them what
            TensorBoard gets.
        progress: where the window folded at a checkpoint save is kept (``window_loss_sum``, ``window_steps``: the
            run's ``TrainProgress``, which checkpoints hold once for all ranks); None: a holder of its own.
    """

    def __init__(self, run_dir: Path, device: torch.device, tokens_per_step: int, flops_per_token: float,
                 peak_flops_total: float, log_every: int, max_steps: int, is_main: bool, tensorboard: bool,
                 progress_bar: bool, progress: Optional[Any] = None, unit: str = "tokens",
                 tokens_per_sample: int = 1, trackers: Iterable[Tracker] = ()):
        self.progress = progress if progress is not None else SimpleNamespace(window_loss_sum=0.0, window_steps=0)
        self.unit, self.tokens_per_sample = unit, tokens_per_sample
        self.device, self.tokens_per_step = device, tokens_per_step
        self.log_every, self.max_steps = log_every, max_steps
        self.flops_per_token, self.peak = flops_per_token, peak_flops_total
        self.trackers = Trackers(TensorBoardLogger(run_dir / "tensorboard", tensorboard and is_main), trackers)
        self.tb = self.trackers.tb
        self.window_loss = torch.zeros((), device=device)
        self.window_steps = torch.zeros((), device=device)  # steps counted in window_loss (a device count: no sync)
        self.last_scalars: dict = {}  # the latest log step's scalars (callbacks get them)
        self._timed_s, self._tokens, self._t0, self._paused = 0.0, 0, time.perf_counter(), False
        self._data_s = 0.0  # time spent waiting for micro-batches in the current window
        self.rates: list[tuple[float, float, float]] = []  # (tokens/s, mfu, data wait share) of each timed window
        self._timed_total = [0, 0.0, 0.0]  # tokens, seconds and data-wait seconds of this launch's timed windows
        self.last_loss = math.nan
        self._bar, self._redirect = None, contextlib.ExitStack()
        if is_main and progress_bar:
            from tqdm.auto import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            # disable=None: no bar when stderr is not a terminal (logs, pipes); the log lines carry progress there
            self._bar = tqdm(total=max_steps, desc="train", unit="step", dynamic_ncols=True, mininterval=1.0,
                             disable=None)
            self._redirect.enter_context(logging_redirect_tqdm())  # log lines above the bar, not glued onto it

    # --------------------------------------------------------------------------------------------- Stateful
    def state_dict(self) -> dict:
        return {"window_loss": self.window_loss.detach().clone().cpu(), "window_steps": int(self.window_steps)}

    def load_state_dict(self, state: dict) -> None:
        if "window_steps" in state:
            self.window_loss = state["window_loss"].to(self.device)
            self.window_steps = torch.full((), float(state["window_steps"]), device=self.device)

    # ---------------------------------------------------------------------------------------------- timing
    def start(self, step: int) -> None:
        """Training starts (or resumes) after ``step``: the bar starts there, the clock starts now.

        This launch's TensorBoard events begin with a ``SessionLog.START`` (:meth:`TensorBoardLogger.purge_from`, as
        ``SummaryWriter(purge_step=...)`` writes) at the first step it logs, so TensorBoard drops what earlier
        launches into this run dir logged at the steps logged again now, and no step shows twice or goes back:

        - a resume: after ``step``;
        - a fresh start (``step`` 0: no checkpoint yet, or ``checkpoint.auto_resume=false``): everything; this
          launch's curves replace theirs;
        - nothing left to train (``step >= max_steps``, a finished run requeued): ``step`` and after, where this
          launch writes its eval and end-of-run records again; the scalars of the log line of ``step``
          (:data:`LINE_TAGS`) are logged again as the launch that trained it logged them.

        The first launch writes one too: TensorBoard's server takes the first START of a run for the start of its
        first session and purges only at later ones.
        """
        if self._bar is not None:
            self._bar.reset(total=self.max_steps)
            self._bar.update(step)
        earlier = self.tb.has_earlier_events()
        if step == 0:
            self.tb.purge_from(0)
            if earlier:
                log.warning("%s holds TensorBoard events of an earlier launch; this one starts afresh at step 0, so "
                            "TensorBoard drops them and shows this launch's curves instead", self.tb.log_dir)
        elif step < self.max_steps:
            self.tb.purge_from(step + 1)
            if earlier:
                log.info("TensorBoard drops what earlier launches logged in %s after step %d (logged again now)",
                         self.tb.log_dir, step)
        else:
            self.tb.purge_from(step, keep=(lambda tag: tag.startswith(LINE_TAGS)) if earlier else None)
            if earlier:
                log.info("nothing to train: this launch's eval and end-of-run records of step %d replace the earlier "
                         "ones in %s (the scalars of that step's log line are kept)", step, self.tb.log_dir)
        self.trackers.start_at(step)
        self._t0 = time.perf_counter()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Keep the enclosed time (eval, checkpoint saves) out of tokens/s."""
        if self._paused:
            yield
            return
        self._timed_s += time.perf_counter() - self._t0
        self._paused = True
        try:
            yield
        finally:
            self._paused = False
            self._t0 = time.perf_counter()

    def drop_timing(self) -> None:
        """Forget the time and tokens counted so far (the first step of a launch: allocation, compile)."""
        self._timed_s, self._tokens, self._t0, self._data_s = 0.0, 0, time.perf_counter(), 0.0

    def data_waited(self, seconds: float) -> None:
        """Add time spent waiting for a micro-batch (host wall time, no device sync)."""
        self._data_s += seconds

    # ---------------------------------------------------------------------------------------------- steps
    def step_done(self, step: int, loss: torch.Tensor, skipped: Optional[torch.Tensor] = None) -> None:
        """Add one optimizer step's mean loss (a 0-d device tensor; no host sync) to the window, unless ``skipped``
        (the step's 0-d device flag, non-zero when its update was dropped) says otherwise."""
        if skipped is None:
            self.window_loss += loss.detach()
            self.window_steps += 1
        else:
            kept = skipped == 0
            self.window_loss += torch.where(kept, loss.detach(), 0.0)
            self.window_steps += kept
        self._tokens += self.tokens_per_step
        if self._bar is not None:
            self._bar.update(1)

    def fold_window(self) -> None:
        """Before a checkpoint save (every rank calls; one all-reduce of one number): move this rank's window into
        the folded one in ``progress``: the ranks' mean of the window's loss sums, the same on every rank. Kept per
        rank, a window that a save cut was lost with a rank that no longer exists after a resume on another world
        size, and missing on a new one, so the first log line after the resume mixed windows of different lengths
        (1.5 % off in one measured case)."""
        loss_sum = all_reduce_mean(self.window_loss.reshape(1)).item()
        self.progress.window_loss_sum += loss_sum
        self.progress.window_steps += int(self.window_steps.item())
        self.window_loss.zero_()
        self.window_steps.zero_()

    def due(self, step: int) -> bool:
        return step == 1 or step % self.log_every == 0 or step == self.max_steps

    def log(self, step: int, grad_norm: torch.Tensor, lr: float, timed: bool, extra: Optional[dict] = None,
            vote: float = 0.0) -> tuple[float, float]:
        """Reduce the window over ranks (every rank calls), log one line and the scalars, reset the window.
        ``timed``: report tokens/s and MFU for this window; ``vote``: this rank's value to average over ranks in the
        same all-reduce (the preemption flag). Returns (the window's mean train loss, the mean vote)."""
        stats = all_reduce_mean(torch.stack([self.window_loss.float(), grad_norm.float(),
                                             self.window_loss.new_tensor(vote, dtype=torch.float32)]))
        loss_sum, norm, votes = stats.tolist()  # every rank counts the same steps (a skip is decided for all)
        steps = self.progress.window_steps + int(self.window_steps.item())
        loss = (self.progress.window_loss_sum + loss_sum) / steps if steps else math.nan
        if steps:  # (a window of skipped updates only keeps the loss of the last one that had some)
            self.last_loss = loss
        scalars = {"train/loss": loss, "train/lr": lr, "train/grad_norm": norm,
                   "mem/peak": peak_memory_bytes(self.device)}
        if not steps:  # every update of the window was skipped: no loss to report rather than a NaN one
            del scalars["train/loss"]
        msg = (f"step {step}/{self.max_steps} loss {f'{loss:.4f}' if steps else 'n/a (every update skipped)'} "
               f"lr {lr:.2e} grad_norm {norm:.3f}")
        if timed:
            seconds = self._timed_s + time.perf_counter() - self._t0
            tps = self._tokens / max(seconds, 1e-9)
            mfu = tps * self.flops_per_token / self.peak if self.peak > 0 else math.nan
            wait = self._data_s / max(seconds, 1e-9)
            self.rates.append((tps, mfu, wait))
            for i, value in enumerate((self._tokens, seconds, self._data_s)):
                self._timed_total[i] += value
            scalars.update({f"perf/{self.unit}_per_sec": tps, "perf/data_wait": wait})
            msg += f" {self.unit}/s {tps:,.0f}"
            if math.isfinite(mfu):  # no peak FLOP/s known: no MFU, rather than NaN
                scalars["perf/mfu"] = mfu
                msg += f" mfu {mfu:.2%}"
        for key, value in (extra or {}).items():
            scalars[key] = value
            msg += f" {key.split('/')[-1]} {value:g}"
        self.trackers.scalars(scalars, step)
        self.last_scalars = scalars  # what callbacks get after this step
        log.info(msg)
        if self._bar is not None and steps:
            self._bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
        self.window_loss.zero_()
        self.window_steps.zero_()
        self.progress.window_loss_sum, self.progress.window_steps = 0.0, 0
        self.drop_timing()
        return loss, votes

    def run_rates(self) -> tuple[float, float, float]:
        """(tokens/s, mfu, data wait share) of this launch's timed windows taken together: their tokens over their
        wall seconds, as each window's figure is (NaN if none). Not the mean of the windows' rates: that weighs a
        1-step window like a 100-step one and, by Jensen's inequality, overstates the rate the noisier the steps
        (1709 for 903 tokens/s in one measured run)."""
        tokens, seconds, data_s = self._timed_total
        if not self.rates or seconds <= 0:
            return math.nan, math.nan, math.nan
        tps = tokens / seconds
        return tps, tps * self.flops_per_token / self.peak if self.peak > 0 else math.nan, data_s / seconds

    def close_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self._redirect.close()
