"""The training loop: gradient accumulation, clipping, loss scaling, the non-finite guard, lr schedule, eval, periodic
checkpoints and preemption.

One optimizer step = ``trainer.grad_accum_steps`` micro-batches of ``data.batch_size`` samples on every rank, i.e.
``grad_accum_steps * batch_size * world_size`` samples (times ``seq_len`` tokens for token data). A batch meets the
model and the loss as :mod:`hydratrain.train.batch` says; the first micro-batch of a launch checks that contract, so
a forward that refuses the batch or a loss that refuses the outputs is a one-line config error on every rank.
Gradient sync runs only on the last micro-batch (the strategy's ``grad_sync``). Every rank constructs the
:class:`Trainer` and calls every method together.

Non-finite guard (``trainer.on_nonfinite``, :mod:`hydratrain.train.nonfinite`): a step whose global gradient norm is
not finite has its update dropped on the device (``stop``: that update and every one after it, until the next log
step raises :class:`~hydratrain.errors.DivergenceError`; ``skip``: that update, counted, until
``trainer.max_consecutive_nonfinite`` in a row). With a fused optimizer (``optim.impl=auto``'s choice on CPU and
CUDA) the loop reads nothing from the device between log steps: the guard's counts are read where the loop
synchronises anyway (a log step, an eval, a checkpoint save, the end)."""
from __future__ import annotations

import contextlib
import logging
import math
import time
import warnings
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn
from torch.optim.lr_scheduler import LRScheduler
from torch.profiler import record_function

from hydratrain import timing
from hydratrain.checkpoint.manager import CheckpointManager
from hydratrain.checkpoint.preemption import Preemption, hold_sigterm
from hydratrain.checkpoint.stateful import SchedulerState
from hydratrain.data.streams import ShardedBatches
from hydratrain.dist.launch import resume_command, stop_if_launcher_gone
from hydratrain.errors import ConfigError, DivergenceError
from hydratrain.optim import steps_per_evaluation, total_steps
from hydratrain.parallel.ac_compile import CompileClock, eager
from hydratrain.parallel.precision import Precision
from hydratrain.parallel.strategy import Strategy, is_collective_timeout
from hydratrain.plan import is_out_of_memory
from hydratrain.train import batch as batches_
from hydratrain.train.callbacks import Callbacks
from hydratrain.train.evaluate import Evaluator
from hydratrain.train.nonfinite import NonFiniteGuard, drops_updates_on_device
from hydratrain.train.progress import FitResult, TrainProgress
from hydratrain.train.step_logger import StepLogger

log = logging.getLogger("hydratrain.trainer")


def _range(name: str) -> contextlib.AbstractContextManager:
    """A labelled range in the trace while a profiler records (``trainer.profile.steps``:
    :mod:`hydratrain.train.profiler`), else nothing: ``record_function`` costs tens of microseconds even with no
    profiler running (a step's 6 ranges: 138 us, against 8 us with this check, on a loaded 2-core CPU)."""
    return record_function(name) if torch.autograd._profiler_enabled() else contextlib.nullcontext()


class Trainer:
    """Runs :meth:`fit`. Components come built (see ``hydratrain.run``); the trainer owns the loop only.

    Args:
        tcfg: the ``trainer`` config node (read only).
        model, strategy, precision, device: the parallelized model and the decisions it was built with.
        optimizer, scheduler, scaler: the update (the scaler is always present; disabled unless fp16).
        train_batches: this rank's micro-batches (an iterator factory with a data position).
        evaluator: ``evaluate(model, autocast) -> {"loss": ..., name: ...}`` over the fixed eval set.
        loss_fn: ``loss(outputs, targets) -> 0-d mean`` (the ``loss`` component).
        contract: ``(model target, loss target)``, the config values the first micro-batch's errors name.
        step_logger: the logging window, TensorBoard and progress (``hydratrain.train.step_logger``).
        checkpoints: a ``CheckpointManager`` (``save(step)``, ``latest()``), or None.
        preemption: a ``Preemption`` (``should_stop(votes)``, agreed by all ranks at log steps).
        progress: the :class:`TrainProgress` (restored by the checkpoint manager before :meth:`fit`).
        max_steps: optimizer steps the run trains to.
        save_every, save_last: checkpoint cadence (``checkpoint.every_n_steps``, ``checkpoint.save_last``).
    """

    def __init__(self, *, tcfg: DictConfig, model: nn.Module, strategy: Strategy, precision: Precision,
                 device: torch.device, optimizer: torch.optim.Optimizer, scheduler: LRScheduler,
                 scaler: torch.amp.GradScaler, train_batches: ShardedBatches, evaluator: Evaluator,
                 step_logger: StepLogger, checkpoints: Optional[CheckpointManager], preemption: Preemption,
                 progress: TrainProgress, max_steps: int, save_every: int = 0, save_last: bool = False,
                 loss_fn: Callable[..., torch.Tensor], contract: tuple[str, str] = ("", ""),
                 callbacks: Optional[Callbacks] = None):
        self.tcfg, self.model, self.strategy, self.precision, self.device = tcfg, model, strategy, precision, device
        self.optimizer, self.scheduler, self.scaler = optimizer, scheduler, scaler
        self.train_batches, self.evaluator, self.logger = train_batches, evaluator, step_logger
        self.checkpoints, self.preemption, self.progress = checkpoints, preemption, progress
        self.max_steps, self.save_every, self.save_last = max_steps, save_every, save_last
        self.autocast = strategy.autocast(precision, device)
        self.loss_fn, self.contract = loss_fn, contract
        self.guard: Optional[NonFiniteGuard] = None  # made at the first step, after any resume
        self._guard_on_device = False
        self._contract_checked = False
        self._stage, self._outputs = "forward", None  # where loss_of is, for the first batch's error line
        self._own_loss: Optional[bool] = None  # whether the model returns its own loss (seen at the first forward)
        # batches_.item_counter's rule, decided after the first forward
        self._counter: Optional[Callable[[Any], torch.Tensor]] = None
        self.callbacks = callbacks if callbacks is not None else Callbacks({}, device)
        self._evaluated: tuple = (None, {}, {})  # (step, values, tagged with the callbacks' own) of the latest eval
        self._plateau = steps_per_evaluation(scheduler)

    # ----------------------------------------------------------------------------------------------- steps
    def loss_of(self, batch) -> torch.Tensor:
        """The 0-d loss of one micro-batch (:mod:`hydratrain.train.batch`: forward in the autocast region, then the
        model's own loss or ``loss_fn(outputs, targets)``)."""
        self._stage = "forward"
        outputs = batches_.forward(self.model, batch, self.autocast)
        self._stage = "loss"
        if not self._contract_checked:  # kept for the first batch's error line only (it holds the logits)
            self._outputs = outputs
            self._check_outputs_visible(outputs)
        if self._own_loss is None:
            self._own_loss = batches_.builtin_loss(outputs) is not None
            self._counter = batches_.item_counter(self.loss_fn, self.model, self._own_loss, batch)
            self.evaluator.counts(self._counter, self._own_loss and batches_.hf_kind(self.model) != "causal")
        return batches_.loss_of(outputs, batch, self.loss_fn)

    def _count(self, batches: list) -> Optional[tuple]:
        """The step's target counts (:func:`~hydratrain.train.batch.item_counter`): ``(n_i per micro-batch, their
        sum, the all-reduce of the sum over the ranks in flight or None)``; None when every micro-batch weighs the
        same. The all-reduce is started here and waited for by :meth:`_divisors`, so that it runs during the first
        forward instead of holding every rank at one more meeting point (a blocking one cost 5 % of a 2-rank gloo
        step)."""
        if self._counter is None:
            return None

        counts = torch.stack([self._counter(b) for b in batches])
        total = counts.sum()
        world = dist.get_world_size() if dist.is_initialized() else 1
        return counts, total, dist.all_reduce(total, async_op=True) if world > 1 else None

    def _divisors(self, batches: list, counted: Optional[tuple]) -> tuple[list, Optional[torch.Tensor]]:
        """What each micro-batch's loss is divided by before its backward: ``grad_accum_steps`` when every
        micro-batch weighs the same, else ``N / (n_i * world_size)`` with ``n_i`` its targets and ``N`` the step's on
        all ranks (``counted``, from :meth:`_count`; counted here at the first step, whose forward decides the
        rule): the gradient DDP/FSDP average over the ranks is then that of the mean over all N targets. A
        micro-batch with no target (``n_i = 0``), and every one of a step with none on any rank (``N = 0``), is
        divided by infinity: a zero gradient. Returns (the divisors, 0-d device tensors; the step's "no target on
        any rank" flag, a 0-d bool device tensor, or None when every micro-batch weighs the same). No host
        synchronisation."""
        accum = len(batches)
        counted = counted or self._count(batches)
        if counted is None:
            return [accum] * accum, None

        counts, total, work = counted
        if work is not None:
            work.wait()
        world = dist.get_world_size() if dist.is_initialized() else 1
        divisors = torch.where(total > 0, total / (counts * world), math.inf).to(torch.float32)
        return list(divisors.unbind()), total == 0

    def _check_outputs_visible(self, outputs) -> None:
        """Under FSDP, the output's tensors must be reachable as PyTorch walks module outputs (tensors, and lists,
        tuples, dicts, dataclasses of them: ``torch.distributed.utils._apply_to_tensors``): FSDP hooks the backward
        of the tensors it finds there to gather the root's parameters again, and an output object it cannot walk
        (a plain class, a ``SimpleNamespace``) left backward on freed parameters, an opaque storage error. Raises
        :class:`ConfigError` naming ``model._target_``."""
        if not self.strategy.shards_parameters or isinstance(outputs, torch.Tensor):
            return
        from torch.distributed.utils import _apply_to_tensors

        found: list = []
        _apply_to_tensors(lambda x: found.append(x) or x, outputs)  # type: ignore[func-returns-value]  # (keeps x)
        if not found:
            raise ConfigError("model._target_", self.contract[0], f"its forward returns a {type(outputs).__name__}, "
                              "whose tensors FSDP cannot see (it walks tensors, lists, tuples, dicts and dataclasses): "
                              "return one of those (a dict {'logits': ...} or a dataclass), or use strategy=ddp")

    def _cast_weights_hint(self, why: str) -> str:
        """Advice for a forward that failed on mixed dtypes under FSDP's cast weights without autocast (a float32
        tensor the forward made itself met bf16 weights), else ''."""
        mixed = "dtype" in why.lower() or "BFloat16" in why or "Half" in why
        if not (mixed and self.precision.compute_dtype != torch.float32
                and isinstance(self.autocast, contextlib.nullcontext)):
            return ""
        dtype = str(self.precision.compute_dtype).removeprefix("torch.")
        return (f"; under strategy={self.strategy.name} precision={self.precision.name} FSDP casts the weights to "
                f"{dtype} and no autocast runs, so a float32 tensor the forward makes itself (x.float()) meets {dtype} "
                "weights: set precision.fsdp_autocast=true (autocast, as strategy=ddp runs it), or make it in the "
                "weights' dtype")

    def _check_no_new_parameters(self, known: set) -> None:  # (by name: FSDP swaps the root's Parameter objects)
        """A forward that creates parameters on its first call (``if self.fc is None: self.fc = nn.Linear(...)``)
        made them after the optimizer and the strategy took the model's parameters: they would never be updated
        nor synced across ranks, while exported as if trained. Raises :class:`ConfigError` naming them."""
        new = [name for name, _ in self.strategy.unwrap(self.model).named_parameters() if name not in known]
        if new:
            shown = ", ".join(new[:4]) + (f" and {len(new) - 4} more" if len(new) > 4 else "")
            raise ConfigError("model._target_", self.contract[0], f"its forward created parameters ({shown}) on its "
                              "first call, after the optimizer and the strategy took the model's parameters, so "
                              "they would never train: create them in __init__ (give the input size as a keyword)")

    def checked_loss_of(self, batch) -> torch.Tensor:
        """:meth:`loss_of`, where an error of the forward or the loss on this launch's first micro-batch becomes a
        :class:`ConfigError` naming ``model._target_`` or ``loss._target_``, the batch's shapes and the error (the
        same on every rank: every rank checks its own first batch)."""
        if self._contract_checked:
            return self.loss_of(batch)

        model_target, loss_target = self.contract
        known = {name for name, _ in self.strategy.unwrap(self.model).named_parameters()}
        try:
            with warnings.catch_warnings():  # torch's elementwise losses warn, then broadcast (B, 1) against (B,)
                warnings.filterwarnings("error", message="Using a target size .* different to the input size",
                                        category=UserWarning)
                loss = self.loss_of(batch)
            self._check_no_new_parameters(known)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                key, target = ("model._target_", model_target) if self._own_loss else ("loss._target_", loss_target)
                raise ConfigError(key, target, f"{'its .loss is' if self._own_loss else 'returned'} "
                                  f"{batches_.shapes(loss)}, not a 0-d tensor: return the mean alone (log other terms "
                                  "as metrics)")
            if torch.is_grad_enabled() and not loss.requires_grad:
                raise ConfigError("loss._target_", loss_target, "its result does not depend on the model's parameters "
                                  "(no grad_fn: the outputs detached, computed under no_grad, or every parameter "
                                  "frozen), so there is nothing to train")
            self.evaluator.check_metrics(self._outputs, batch)  # at step 1, not after a whole run at the eval
            unseen = [k for k in batches_.unseen_outputs(self._outputs) if "loss" in k.lower()]
            if unseen:
                log.warning("model._target_=%s returns %s beside its logits, which the loss node (%s) does not see: "
                            "it gets the logits only, so %s trains nothing; return the total as 'loss' (a key or "
                            "attribute of the output) to train on it", model_target, ", ".join(unseen), loss_target,
                            unseen[0])
        except (TypeError, ValueError, RuntimeError, IndexError, KeyError, AttributeError, AssertionError,
                UserWarning) as err:
            if is_out_of_memory(err) or isinstance(err, ConfigError) or is_collective_timeout(err):
                raise  # (a timeout: the forward was waiting for the others; fit reports it)
            why = (str(err).strip().splitlines() or [type(err).__name__])[0]
            if self._stage == "forward":
                inputs = batch if isinstance(batch, dict) else batch[0]
                raise ConfigError("model._target_", model_target, f"its forward refused the first batch (inputs "
                                  f"{batches_.shapes(inputs)}): {type(err).__name__}: {why}"
                                  f"{self._cast_weights_hint(why)}") from err
            predicted = batches_.prediction(self._outputs)
            hint = ("; the model returns a tuple: return a dict with its 'logits' (the loss and the metrics get them) "
                    "or give a loss that takes the tuple") if isinstance(predicted, (tuple, list)) else ""
            unseen = batches_.unseen_outputs(self._outputs)
            if unseen:
                hint = (f"; it gets the output's 'logits' only, not {', '.join(unseen)}: to use them, compute the loss "
                        "in the forward and return it as 'loss'")
            if isinstance(batch, dict) and "labels" not in batch:
                hint = (f"; a dict batch gives the loss its 'labels', and this one has none (its keys: "
                        f"{', '.join(map(str, batch))}): name the targets 'labels'")
            raise ConfigError("loss._target_", loss_target, f"refused the model's outputs "
                              f"{batches_.shapes(predicted)} against targets "
                              f"{batches_.shapes(batches_.targets_of(batch))}: {type(err).__name__}: {why}{hint}") \
                from err
        finally:
            self._outputs = None
        self._contract_checked = True
        return loss

    def train_step(self, batches) -> tuple[torch.Tensor, torch.Tensor, float, torch.Tensor]:
        """One optimizer step over ``grad_accum_steps`` micro-batches; the non-finite guard drops its update when the
        gradient norm is not finite (without a host synchronisation when the optimizer takes ``found_inf``).

        Returns (the loss over the micro-batches, a 0-d device tensor: their mean, or, when the loss counts its
        targets (:meth:`_divisors`), the sum of ``loss_i * n_i * world_size / N``, whose mean over the ranks is the
        mean over the step's N targets; pre-clipping global grad norm, the same; the
        lr this update used; the skip flag, a 0-d device tensor, non-zero when the update was dropped). Raises
        :class:`DivergenceError` per ``trainer.on_nonfinite`` when the guard is read.
        """
        if self.guard is None:
            self._guard_on_device = drops_updates_on_device(self.optimizer, self.device)
            self.guard = NonFiniteGuard(self.tcfg.on_nonfinite, self.tcfg.max_consecutive_nonfinite, self.device,
                                        self.scaler.is_enabled(), self.progress.consecutive_skipped,
                                        self.tcfg.grad_clip)
        accum = self.tcfg.grad_accum_steps
        total = torch.zeros((), device=self.device)
        probe = None  # this launch's first micro-batch, for the eval-mode check after its first step
        waited = time.perf_counter()
        with _range("hydratrain/data_wait"):
            micro_batches = [next(batches) for _ in range(accum)]  # all first: the step's targets weigh its losses
        self.logger.data_waited(time.perf_counter() - waited)
        divisors, counted = None, self._count(micro_batches)  # (None until the first forward decides the rule)
        empty = None  # a step with no target on any rank: nothing to learn from, its update is dropped
        for micro, batch in enumerate(micro_batches):
            first = not self._contract_checked
            if first:
                probe = batch
            with self.strategy.grad_sync(self.model, micro == accum - 1):
                try:
                    with self.strategy.check_first_forward(self.model) if first else contextlib.nullcontext(), \
                            _range("hydratrain/forward"):
                        loss = self.checked_loss_of(batch)
                    if divisors is None:  # after the first forward, which tells whose loss it is
                        divisors, empty = self._divisors(micro_batches, counted)
                    with _range("hydratrain/backward"):  # (DDP's and FSDP's reduce overlaps it)
                        self.scaler.scale(loss / divisors[micro]).backward()
                except RuntimeError as err:
                    explained = self.strategy.explain(self.model, err, self.progress.step + 1)
                    if explained is None:
                        raise
                    raise explained from err
            if first:
                self.strategy.check_first_gradients(self.model)
            if self._counter is None:
                total += loss.detach()
            else:  # a micro-batch whose targets are all ignored: a NaN mean over none, a zero gradient, weight 0
                total += torch.where(divisors[micro].isinf(), 0.0, loss.detach() / divisors[micro])
        loss = total / accum if self._counter is None else total
        # fp16 with a step that has no target: the scaler takes no skip flag, so the flag is read (fp16 only) and the
        # scaler left alone: no step, and no update that would count the step towards growing the scale
        scaler_idle = self.scaler.is_enabled() and empty is not None and bool(empty)
        with _range("hydratrain/grad_sync"):  # unscale, the global norm (an all-reduce), clipping
            if not scaler_idle:
                self.scaler.unscale_(self.optimizer)
            grad_norm = self.strategy.clip_grad_norm_(self.model, self.tcfg.grad_clip, self.device)
        lr = float(self.optimizer.param_groups[0]["lr"])  # a value: a tensor lr (torchao) is filled in place later
        with _range("hydratrain/optimizer_step"):
            skip = self.guard.update(self.progress.step + 1, grad_norm, loss, empty)
            if self.scaler.is_enabled():
                if not scaler_idle:
                    self.scaler.step(self.optimizer)  # drops a non-finite update itself
                    self.scaler.update()
            elif self._guard_on_device:
                # as GradScaler hands it to a fused optimizer
                self.optimizer.found_inf = skip  # type: ignore[attr-defined]
                try:
                    self.optimizer.step()
                finally:
                    del self.optimizer.found_inf  # type: ignore[attr-defined]
            else:
                self.read_guard(self.progress.step + 1)  # this optimizer cannot drop an update on the device
                if not bool(skip):
                    self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            if not self._plateau:  # (ReduceLROnPlateau: after each evaluation, by its callback)
                self.scheduler.step()
        self.progress.step += 1
        if probe is not None:
            self._check_eval_mode(probe)
        return loss, grad_norm, lr, skip

    def _check_eval_mode(self, batch) -> None:
        """The eval runs the model in eval mode, where some models return other outputs (torchvision's inception_v3
        and googlenet drop their auxiliary logits): after this launch's first step, one no-grad eval-mode forward of
        its first micro-batch, the loss and each metric (on copies), so an output the loss or a metric refuses is one
        config-error line now, not a traceback at the first eval after the training. Raises :class:`ConfigError`."""
        stage, outputs = "forward", None
        self.model.eval()
        try:
            with torch.no_grad():
                outputs = batches_.forward(self.model, batch, self.autocast)
                stage = "loss"
                self.evaluator.check_loss(outputs, batch)  # and learns whether the loss communicates
                self.evaluator.check_metrics(outputs, batch)
        except (TypeError, ValueError, RuntimeError, IndexError, KeyError, AttributeError, AssertionError) as err:
            if is_out_of_memory(err) or isinstance(err, ConfigError) or is_collective_timeout(err):
                raise  # (a timeout: the forward was waiting for the others; fit reports it)
            why = f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0]}"
            if stage == "forward":
                raise ConfigError("model._target_", self.contract[0], "in eval mode (model.eval(), as the eval runs "
                                  f"it) its forward refused the first batch: {why}") from err
            raise ConfigError("loss._target_", self.contract[1], "refused the model's eval-mode outputs "
                              f"{batches_.shapes(batches_.prediction(outputs))} (model.eval(), as the eval runs it; "
                              f"in training mode they were accepted): {why}") from err
        finally:
            self.model.train()

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

    def keep_the_epoch_limit(self) -> None:
        """After a resume: ``trainer.max_epochs`` limits samples, not steps, so on another ``data.batch_size``,
        ``trainer.grad_accum_steps`` or world size :func:`~hydratrain.optim.total_steps` from the restored data
        position differs from the config's own count. Re-targets :attr:`max_steps`, the step logger and the lr
        schedule (its length, at the restored step) when it does."""
        if self.tcfg.max_epochs is None:
            return
        steps = total_steps(self.tcfg, self.train_batches, done=self.progress.step)
        if steps == self.max_steps:
            return
        log.warning("trainer.max_epochs=%d from the restored data position (epoch %d) at this run's batch geometry: "
                    "%d optimizer steps in all, not the %d the config alone gives; the lr schedule is re-targeted to "
                    "%d steps", self.tcfg.max_epochs, self.train_batches.position()[0], steps, self.max_steps, steps)
        self.max_steps = self.logger.max_steps = steps
        state = self.checkpoints.components["scheduler"] if self.checkpoints is not None else None
        if not isinstance(state, SchedulerState):  # (a scheduler of one's own keeps the length it was built with)
            log.warning("the scheduler (%s) keeps its own length; set its run-length keyword (scheduler._target_'s) "
                        "to %d to end with the run", type(self.scheduler).__qualname__, steps)
            return
        state.retarget(steps)

    # ------------------------------------------------------------------------------------------------- fit
    def fit(self) -> FitResult:
        """Train until ``max_steps``; eval every ``trainer.eval_every_n_steps`` and at the end; checkpoint per the
        cadence; stop after saving when a preemption signal arrives. Returns the :class:`FitResult`."""
        result, t_start = FitResult(), time.perf_counter()
        first = self.progress.step + 1  # this launch's first step (> 1 after a resume)
        self.logger.start(self.progress.step)
        batches = iter(self.train_batches)
        self.model.train()
        compiled = getattr(self.strategy, "compiled", None)
        clock = CompileClock(compiled, self.device) if compiled else None
        try:
            self.preemption.arm()  # from here a preemption signal stops at a step, after a save
            self.callbacks.call("on_fit_start")
            while self.progress.step < self.max_steps:
                stop_if_launcher_gone(f"before step {self.progress.step + 1}")  # (torchrun killed: no signal came)
                self.callbacks.call("on_train_step_start", self.progress.step + 1)
                started = time.perf_counter()
                loss, grad_norm, lr, skipped = self.train_step(batches)
                step = self.progress.step
                if clock is not None:
                    clock.step_done(step - first, started, last=step == self.max_steps)
                self.logger.step_done(step, loss, skipped)
                if step == first:
                    self.logger.drop_timing()  # start-up (allocations, compile) stays out of tokens/s
                    timing.mark("first step")
                    result.startup_s = timing.record()
                    log.info("start-up: %s", timing.summary())
                votes = None  # the ranks' preemption votes, reduced with the log line's values at a log step
                logs: dict = {}
                if self.logger.due(step):
                    diverged = self.read_guard(step, defer=True)  # this step synchronises anyway (its all-reduce)
                    extra = {}
                    if self.scaler.is_enabled():
                        extra["train/loss_scale"] = self.scaler.get_scale()
                    if self.scaler.is_enabled() or self.progress.skipped_steps:
                        extra["train/skipped_steps"] = self.progress.skipped_steps
                    train_loss, votes = self.logger.log(step, grad_norm, lr, timed=step > first, extra=extra,
                                                        vote=self.preemption.vote())
                    logs = self.logger.last_scalars
                    if step == 1:
                        self.progress.first_loss = train_loss
                    if diverged is not None:
                        raise diverged  # after the step's log line and scalars
                self.callbacks.call("on_train_step_end", step, logs)
                ended = self._end_of_step(step, votes)
                if ended == "preempted":
                    result.preempted = True
                    break
                if ended == "stopped":
                    if not logs:  # the run's last step: its window is logged as a last step's is
                        train_loss, _ = self.logger.log(step, grad_norm, lr, timed=step > first)
                        if step == 1:
                            self.progress.first_loss = train_loss
                    log.info("stopping after step %d of %d: %s", step, self.max_steps, self.callbacks.stopped)
                    break
        except RuntimeError as err:
            hold_sigterm()  # until hydratrain.run has logged why this rank ends
            if not is_collective_timeout(err):
                raise
            # wherever it surfaced (a log step's all-reduce, the next step's gather): one line, not a traceback
            raise self.strategy.explain(self.model, err, self.progress.step + 1) from err
        except BaseException:
            hold_sigterm()  # until hydratrain.run has logged why this rank ends
            raise
        finally:
            self.preemption.close()
            self.logger.close_bar()
            self.logger.trackers.flush()  # what was logged before an error stays readable
        self._finish_save()  # the end of training waits for the save in flight
        self.read_guard(self.progress.step)
        result.steps, result.steps_this_launch = self.progress.step, self.progress.step - first + 1
        result.first_loss, result.skipped_steps = self.progress.first_loss, self.progress.skipped_steps
        result.train_loss = self.logger.last_loss
        if result.preempted:
            return result
        if self.checkpoints is not None and self.checkpoints.last_saved_step != self.progress.step and self.save_last:
            self.logger.fold_window()
            self.strategy.sync_buffers(self.model)
            self._save(self.progress.step, wait=True)
        step = self.progress.step
        evaluated = self._evaluated[1] if self._evaluated[0] == step else self._eval_and_log(step)
        if self.callbacks and self.checkpoints is not None and self.callbacks.agree()[1] \
                and self.checkpoints.last_saved_step != step:  # (the final evaluation is among the best)
            self.logger.fold_window()
            self.strategy.sync_buffers(self.model)
            self._save(step, wait=True)
        if self.checkpoints is not None and self.checkpoints.last_saved_step != step and step >= first \
                and self._last_checkpoint() is not None:  # (after the final evaluation's save, if it made one)
            log.info("steps after %s are in no checkpoint (checkpoint.save_last=false): a relaunch with a larger "
                     "trainer.max_steps resumes from it and trains them again: %s trainer.max_steps=<more>",
                     self._last_checkpoint(), resume_command(self.checkpoints.root.parent))
        result.eval_loss = evaluated.get("loss", math.nan)
        result.eval_perplexity = evaluated.get("perplexity", math.nan)
        result.eval_metrics = {k: v for k, v in evaluated.items() if k not in ("loss", "perplexity")}
        result.objective = self._evaluated[2].get(self.tcfg.objective, math.nan)  # (eval/*, or eval_ema/*: the EMA's)
        result.seconds = time.perf_counter() - t_start
        rate, result.mfu, result.data_wait_fraction = self.logger.run_rates()
        result.samples_per_sec = rate / self.logger.tokens_per_sample
        if self.logger.unit == "tokens":
            result.tokens_per_sec = rate
        result.stopped_early = self.callbacks.stopped
        self.callbacks.call("on_fit_end", result)
        return result

    def _eval_due(self, step: int) -> bool:
        every_eval = self.tcfg.eval_every_n_steps
        return bool(every_eval) and step % every_eval == 0 and step < self.max_steps

    def _end_of_step(self, step: int, votes: Optional[float]) -> Optional[str]:
        """Eval, periodic save, and the preemption and callbacks' agreements after optimizer step ``step``
        (``votes``: the ranks' mean preemption vote when this was a log step, else None). Returns "preempted" or
        "stopped" (a callback asked) to stop now, else None."""
        logged, evaluated = votes is not None, self._eval_due(step)
        if evaluated:
            self.read_guard(step)
            self._eval_and_log(step)
        # the callbacks' requests are agreed where every rank meets anyway: a log step or an evaluation
        stopped, wanted = self.callbacks.agree() if self.callbacks and (logged or evaluated) else (False, False)
        stop = self.preemption.should_stop(votes)
        due = (self.save_every and step % self.save_every == 0) or wanted
        if self.checkpoints is not None and (due or stop) and self.checkpoints.last_saved_step != step:
            self.read_guard(step)  # before the progress it saves, and never a state the guard would stop at
            self.strategy.sync_buffers(self.model)
            with self.logger.paused():
                self.logger.fold_window()  # the window rides in the progress it saves, the same on every rank
                self._save(step, wait=stop)
        elif stop:
            self._finish_save()  # (this step's save may be in flight) before the stop line names the last checkpoint
        elif logged:
            self._finish_save(only_if_written=True)  # the ranks meet here anyway
        if stop:
            self.preemption.stopping(step, self._last_checkpoint())
            return "preempted"
        return "stopped" if stopped else None

    def _save(self, step: int, wait: bool = False) -> None:
        """Save step ``step``, after completing the save in flight (``checkpoint.async_save``: at most one); ``wait``:
        complete this one too before returning (a preemption's, the end's). ``on_checkpoint_saved`` is called as
        each save is complete."""
        assert self.checkpoints is not None  # (every caller checked)
        self._finish_save()
        self.callbacks.call("on_save_checkpoint", step)
        with _range("hydratrain/checkpoint_save"):
            path = self.checkpoints.save(step)
        if path is not None:
            self.callbacks.call("on_checkpoint_saved", step, path)
        elif wait:
            self._finish_save()

    def _finish_save(self, only_if_written: bool = False) -> None:
        """Complete the save written in the background, if any (``only_if_written``: only if every rank's write has
        finished already); every rank calls."""
        if self.checkpoints is None or not self.checkpoints.in_flight:
            return
        done = self.checkpoints.wait_if_written() if only_if_written else self.checkpoints.wait()
        if done is not None:
            self.callbacks.call("on_checkpoint_saved", *done)

    def evaluate(self) -> dict:
        """The evaluation of the model as it is now, ``{"loss": ..., name: ...}``, logged nowhere (every rank calls;
        also a callback's ``run.evaluate()``)."""
        with self.logger.paused(), eager():  # compiled graphs serve training steps only (ac_compile.eager)
            self.strategy.sync_buffers(self.model)
            return self.evaluator.evaluate(self.model, self.autocast)

    def _eval_and_log(self, step: int) -> dict:
        """Evaluate, log ``eval/<name>`` of every value, return them (``{"loss": ..., ...}``); the callbacks'
        ``on_eval_end`` gets them tagged (``{"eval/loss": ...}``) and may add values of its own (the EMA weights'
        ``eval_ema/*``), kept with the step as :attr:`_evaluated`."""
        values = self.evaluate()
        if "loss" in values and not math.isfinite(values["loss"]):  # (no loss: the eval set has no target)
            raise DivergenceError(f"non-finite eval loss ({values['loss']}) at step {step}", step,
                                  self._last_checkpoint())
        tagged = {f"eval/{name}": value for name, value in values.items()}
        self.logger.trackers.scalars(tagged, step)
        formats = {"loss": ".4f", "perplexity": ".3f"}
        log.info("eval at step %d: %s", step, " ".join(f"{name} {value:{formats.get(name, '.4g')}}"
                                                       for name, value in values.items()))
        self._evaluated = (step, values, tagged)
        self.callbacks.call("on_eval_end", step, tagged)
        return values
