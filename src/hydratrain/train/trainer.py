"""The training loop: gradient accumulation, clipping, loss scaling, the non-finite guard, lr schedule, eval,
periodic checkpoints and preemption.

One optimizer step = ``trainer.grad_accum_steps`` micro-batches of ``data.batch_size`` samples on every rank, i.e.
``grad_accum_steps * batch_size * seq_len * world_size`` tokens. Gradient sync runs only on the last micro-batch
(the strategy's ``grad_sync``). Every rank constructs the :class:`Trainer` and calls every method together.

Non-finite guard (``trainer.on_nonfinite``, :mod:`hydratrain.train.nonfinite`): a step whose global gradient norm is
not finite has its update dropped on the device (``stop``: that update and every one after it, until the next log
step raises :class:`~hydratrain.errors.DivergenceError`; ``skip``: that update, counted, until
``trainer.max_consecutive_nonfinite`` in a row). With a fused optimizer (``optim.impl=auto``'s choice on CPU and CUDA)
the loop reads nothing from the device between log steps: the guard's counts are read where the loop synchronises
anyway (a log step, an eval, a checkpoint save, the end).
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from hydratrain import timing
from hydratrain.checkpoint.preemption import hold_sigterm
from hydratrain.errors import DivergenceError
from hydratrain.train.nonfinite import NonFiniteGuard, drops_updates_on_device

log = logging.getLogger("hydratrain.trainer")


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
    tokens_per_sec: float = math.nan  # over the timed windows together, excluding the first step, eval and saves
    mfu: float = math.nan
    data_wait_fraction: float = math.nan  # share of the timed step time rank 0 spent waiting for its next batch
    peak_memory_bytes: int = 0  # max over ranks
    planned_peak_memory_bytes: int = 0  # the memory planner's prediction made at the start, max over ranks
    skipped_steps: int = 0
    seconds: float = 0.0
    preempted: bool = False  # stopped early by a preemption signal after saving a checkpoint (no final eval)
    startup_s: dict = field(default_factory=dict)  # start-up phases up to the first step, seconds (timing.record)


class Trainer:
    """Runs :meth:`fit`. Components come built (see ``hydratrain.run``); the trainer owns the loop only.

    Args:
        tcfg: the ``trainer`` config node (read only).
        model, strategy, precision, device: the parallelized model and the decisions it was built with.
        optimizer, scheduler, scaler: the update (the scaler is always present; disabled unless fp16).
        train_batches: this rank's micro-batches (an iterator factory with a data position).
        evaluator: ``evaluate(model) -> (loss, perplexity)`` over the fixed eval set.
        step_logger: the logging window, TensorBoard and progress (``hydratrain.train.step_logger``).
        checkpoints: a ``CheckpointManager`` (``save(step)``, ``latest()``), or None.
        preemption: a ``Preemption`` (``should_stop(votes)``, agreed by all ranks at log steps).
        progress: the :class:`TrainProgress` (restored by the checkpoint manager before :meth:`fit`).
        max_steps: optimizer steps the run trains to.
        save_every, save_last: checkpoint cadence (``checkpoint.every_n_steps``, ``checkpoint.save_last``).
    """

    def __init__(self, *, tcfg, model: nn.Module, strategy, precision, device: torch.device,
                 optimizer: torch.optim.Optimizer, scheduler, scaler: torch.amp.GradScaler, train_batches, evaluator,
                 step_logger, checkpoints, preemption, progress: TrainProgress, max_steps: int, save_every: int = 0,
                 save_last: bool = False):
        self.tcfg, self.model, self.strategy, self.precision, self.device = tcfg, model, strategy, precision, device
        self.optimizer, self.scheduler, self.scaler = optimizer, scheduler, scaler
        self.train_batches, self.evaluator, self.logger = train_batches, evaluator, step_logger
        self.checkpoints, self.preemption, self.progress = checkpoints, preemption, progress
        self.max_steps, self.save_every, self.save_last = max_steps, save_every, save_last
        self.autocast = strategy.autocast(precision, device)
        self.guard: Optional[NonFiniteGuard] = None  # made at the first step, after any resume
        self._guard_on_device = False

    # ----------------------------------------------------------------------------------------------- steps
    def loss_of(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy (nats/token) of a micro-batch ``x, y`` of shape ``(B, T)``."""
        with self.autocast:
            logits = self.model(x)
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())

    def train_step(self, batches) -> tuple[torch.Tensor, torch.Tensor, float, torch.Tensor]:
        """One optimizer step over ``grad_accum_steps`` micro-batches; the non-finite guard drops its update when the
        gradient norm is not finite (without a host synchronisation when the optimizer takes ``found_inf``).

        Returns (mean loss over the micro-batches, a 0-d device tensor; pre-clipping global grad norm, the same; the
        lr this update used; the skip flag, a 0-d device tensor, non-zero when the update was dropped). Raises
        :class:`DivergenceError` per ``trainer.on_nonfinite`` when the guard is read.
        """
        if self.guard is None:
            self._guard_on_device = drops_updates_on_device(self.optimizer, self.device)
            self.guard = NonFiniteGuard(self.tcfg.on_nonfinite, self.tcfg.max_consecutive_nonfinite, self.device,
                                        self.scaler.is_enabled(), self.progress.consecutive_skipped)
        accum = self.tcfg.grad_accum_steps
        total = torch.zeros((), device=self.device)
        for micro in range(accum):
            waited = time.perf_counter()
            x, y = next(batches)
            self.logger.data_waited(time.perf_counter() - waited)
            with self.strategy.grad_sync(self.model, micro == accum - 1):
                loss = self.loss_of(x, y)
                self.scaler.scale(loss / accum).backward()
            total += loss.detach()
        loss = total / accum
        self.scaler.unscale_(self.optimizer)
        grad_norm = self.strategy.clip_grad_norm_(self.model, self.tcfg.grad_clip, self.device)
        lr = float(self.optimizer.param_groups[0]["lr"])  # a value: a tensor lr (torchao) is filled in place later
        skip = self.guard.update(self.progress.step + 1, grad_norm, loss)
        if self.scaler.is_enabled():
            self.scaler.step(self.optimizer)  # drops a non-finite update itself
            self.scaler.update()
        elif self._guard_on_device:
            self.optimizer.found_inf = skip  # as torch.amp.GradScaler hands it to a fused optimizer
            try:
                self.optimizer.step()
            finally:
                del self.optimizer.found_inf
        else:
            self.read_guard(self.progress.step + 1)  # this optimizer cannot drop an update on the device
            if not bool(skip):
                self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.progress.step += 1
        return loss, grad_norm, lr, skip

    def read_guard(self, step: int, defer: bool = False) -> Optional[DivergenceError]:
        """Bring the guard's counts into :attr:`progress` (a host synchronisation) after step ``step``; raises
        :class:`DivergenceError` per ``trainer.on_nonfinite`` (returns it instead with ``defer``)."""
        err = self.guard.read(self.progress, step, self._last_checkpoint) if self.guard is not None else None
        if err is not None and not defer:
            raise err
        return err

    def _last_checkpoint(self) -> Optional[str]:
        latest = self.checkpoints.last_good() if self.checkpoints is not None else None
        return str(latest) if latest is not None else None

    # ------------------------------------------------------------------------------------------------- fit
    def fit(self) -> FitResult:
        """Train until ``max_steps``; eval every ``trainer.eval_every_n_steps`` and at the end; checkpoint per the
        cadence; stop after saving when a preemption signal arrives. Returns the :class:`FitResult`."""
        result, t_start = FitResult(), time.perf_counter()
        first = self.progress.step + 1  # this launch's first step (> 1 after a resume)
        self.logger.start(self.progress.step)
        batches = iter(self.train_batches)
        self.model.train()
        try:
            self.preemption.arm()  # from here a preemption signal stops at a step, after a save
            while self.progress.step < self.max_steps:
                loss, grad_norm, lr, skipped = self.train_step(batches)
                step = self.progress.step
                self.logger.step_done(step, loss, skipped)
                if step == first:
                    self.logger.drop_timing()  # start-up (allocations, compile) stays out of tokens/s
                    timing.mark("first step")
                    result.startup_s = timing.record()
                    log.info("start-up: %s", timing.summary())
                votes = None  # the ranks' preemption votes, reduced with the log line's values at a log step
                if self.logger.due(step):
                    diverged = self.read_guard(step, defer=True)  # this step synchronises anyway (its all-reduce)
                    extra = {}
                    if self.scaler.is_enabled():
                        extra["train/loss_scale"] = self.scaler.get_scale()
                    if self.scaler.is_enabled() or self.progress.skipped_steps:
                        extra["train/skipped_steps"] = self.progress.skipped_steps
                    train_loss, votes = self.logger.log(step, grad_norm, lr, timed=step > first, extra=extra,
                                                        vote=self.preemption.vote())
                    if step == 1:
                        self.progress.first_loss = train_loss
                    if diverged is not None:
                        raise diverged  # after the step's log line and scalars
                if self._end_of_step(step, votes):
                    result.preempted = True
                    break
        except BaseException:
            hold_sigterm()  # until hydratrain.run has logged why this rank ends
            raise
        finally:
            self.preemption.close()
            self.logger.close_bar()
            self.logger.tb.flush()  # what was logged before an error stays readable
        self.read_guard(self.progress.step)
        result.steps, result.steps_this_launch = self.progress.step, self.progress.step - first + 1
        result.first_loss, result.skipped_steps = self.progress.first_loss, self.progress.skipped_steps
        result.train_loss = self.logger.last_loss
        if result.preempted:
            return result
        if self.checkpoints is not None and self.checkpoints.last_saved_step != self.progress.step:
            if self.save_last:
                self.logger.fold_window()
                self.checkpoints.save(self.progress.step)
            elif self.progress.step >= first and self._last_checkpoint() is not None:
                log.info("steps after %s are in no checkpoint (checkpoint.save_last=false): a relaunch with a larger "
                         "trainer.max_steps resumes from it and trains them again", self._last_checkpoint())
        result.eval_loss, result.eval_perplexity = self._eval_and_log(self.progress.step)
        result.seconds = time.perf_counter() - t_start
        result.tokens_per_sec, result.mfu, result.data_wait_fraction = self.logger.run_rates()
        return result

    def _end_of_step(self, step: int, votes: Optional[float]) -> bool:
        """Eval, periodic save, and the preemption agreement after optimizer step ``step`` (``votes``: the ranks'
        mean preemption vote when this was a log step, else None); True to stop now."""
        every_eval = self.tcfg.eval_every_n_steps
        if every_eval and step % every_eval == 0 and step < self.max_steps:
            self.read_guard(step)
            self._eval_and_log(step)
        stop = self.preemption.should_stop(votes)
        due = self.save_every and step % self.save_every == 0
        if self.checkpoints is not None and (due or stop) and self.checkpoints.last_saved_step != step:
            self.read_guard(step)  # before the progress it saves, and never a state the guard would stop at
            with self.logger.paused():
                self.logger.fold_window()  # the window rides in the progress it saves, the same on every rank
                self.checkpoints.save(step)
        if stop:
            self.preemption.stopping(step, self._last_checkpoint())
        return stop

    def _eval_and_log(self, step: int) -> tuple[float, float]:
        with self.logger.paused():
            loss, ppl = self.evaluator.evaluate(self.model, self.autocast)
        if not math.isfinite(loss):
            raise DivergenceError(f"non-finite eval loss ({loss}) at step {step}", step, self._last_checkpoint())
        self.logger.tb.scalars({"eval/loss": loss, "eval/perplexity": ppl}, step)
        log.info("eval at step %d: loss %.4f perplexity %.3f", step, loss, ppl)
        return loss, ppl
