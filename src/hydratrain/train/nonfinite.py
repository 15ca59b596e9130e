"""The non-finite guard (``trainer.on_nonfinite``): drop the update of a step whose global gradient norm is not
finite, without reading the device every step.

Each step, :meth:`NonFiniteGuard.update` turns that step's global gradient norm (a 0-d device tensor, the same on
every rank: gradients are reduced before it is taken, so a non-finite loss on any rank shows in it) into a 0-d
float32 *skip* flag on the device (1.0: drop this update) and keeps its counts on the device too. The update is
dropped on the device by the optimizer itself: torch's fused optimizers take the flag as ``found_inf`` (the
attribute ``torch.amp.GradScaler`` hands them; the kernel leaves parameters, moments and the step count untouched
when it is non-zero), and with fp16 the grad scaler drops the step itself. Nothing is read on the host until
:meth:`NonFiniteGuard.read`, which the trainer calls where it synchronises anyway: at a log step, before an eval or a
checkpoint save, and at the end (every step for an optimizer without ``found_inf``: the for-loop or foreach AdamW,
torchao's 8-bit AdamW; and with ``strategy.cpu_offload`` on CUDA, whose update runs on the CPU).

``stop``: from the first non-finite step on, every update is dropped, and the next :meth:`read` raises
:class:`~hydratrain.errors.DivergenceError` naming that step, so the weights, the optimizer state and every checkpoint
stay as they were after the last finite step (the step counter and the schedule may have run on to the read).
``skip``: each such update is dropped, counted (``train/skipped_steps``), warned about at the read, and the read
raises once ``trainer.max_consecutive_nonfinite`` steps in a row were skipped (with fp16 this limit is the only rule).
"""
from __future__ import annotations

import logging
import math
from typing import Callable, Optional

import torch

from hydratrain.dist.collectives import rank_and_world
from hydratrain.errors import DivergenceError

log = logging.getLogger("hydratrain.trainer")

def stop_advice(grad_clip: Optional[float]) -> str:
    """What to change after a divergence: the clipping named as it is set (a clip already on is lowered)."""
    clip = f"lower trainer.grad_clip (now {grad_clip:g})" if grad_clip else "set trainer.grad_clip (1.0 is common)"
    return f"lower optim.lr, raise scheduler.warmup_steps, or {clip}"


def drops_updates_on_device(optimizer: torch.optim.Optimizer, device: torch.device) -> bool:
    """Whether ``optimizer.step()`` can drop an update on ``device`` without the host: torch's fused Adam, AdamW and
    SGD take a ``found_inf`` flag (declared by ``_step_supports_amp_scaling``, the contract ``torch.amp.GradScaler``
    relies on), every parameter group must still be fused (a group's flags are what its step reads), and every
    parameter must live on ``device``'s kind, where the flag is (with ``strategy.cpu_offload`` on CUDA the update
    runs on the CPU, and a flag copied there without a synchronisation could be read before it arrives)."""
    return (bool(getattr(optimizer, "_step_supports_amp_scaling", False))
            and all(g.get("fused") for g in optimizer.param_groups)
            and all(p.device.type == device.type for g in optimizer.param_groups for p in g["params"]))


class NonFiniteGuard:
    """Per-step non-finite check with its counts on ``device``; see the module docstring.

    Args:
        policy: ``trainer.on_nonfinite``, ``stop`` or ``skip``.
        max_consecutive: ``trainer.max_consecutive_nonfinite``: raise once this many steps in a row were skipped.
        device: where the step's gradient norm lives.
        scaler_skips: fp16's grad scaler drops non-finite updates itself (``policy`` then does not apply; the limit
            on consecutive skips does).
        consecutive: steps skipped in a row just before this launch (``TrainProgress.consecutive_skipped`` on resume).
        grad_clip: ``trainer.grad_clip`` (0: none), which the advice after a divergence names as it is set.
    """

    def __init__(self, policy: str, max_consecutive: int, device: torch.device, scaler_skips: bool,
                 consecutive: int = 0, grad_clip: Optional[float] = None):
        self.stop = str(policy) == "stop" and not scaler_skips
        self.warn = not scaler_skips  # the scaler's skips are routine (the loss scale searching down), not news
        self.max_consecutive = int(max_consecutive)
        self.advice = stop_advice(grad_clip)
        zero = torch.zeros((), dtype=torch.float64, device=device)
        self._consecutive = zero + consecutive
        self._halted = torch.zeros((), dtype=torch.bool, device=device)
        self._count = zero.clone()  # updates dropped since the last read
        self._first = zero.clone()  # step, grad norm and loss of the first of them (step 0: none)
        self._first_norm, self._first_loss = zero.clone(), zero.clone()
        self._last = zero.clone()  # step of the last of them
        self._limit_step = zero.clone()  # first step since the last read at which the run of skips hit the limit
        # steps with no target since the last read: how many, the first, the last
        self._empty, self._first_empty, self._last_empty = zero.clone(), zero.clone(), zero.clone()

    def update(self, step: int, grad_norm: torch.Tensor, loss: torch.Tensor,
               empty: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Record optimizer step ``step`` (1-based) with its global ``grad_norm`` and mean ``loss`` (0-d device
        tensors). ``empty``: the step had no target on any rank (every one ignored by the loss; a 0-d bool device
        tensor, or None): its update is dropped too, since a step with nothing to learn from would still decay the
        weights and the optimizer's moments, and it is counted as skipped but is no divergence (under ``stop`` it
        halts nothing; it neither adds to nor breaks a run of non-finite steps). Returns the skip flag: a 0-d
        float32 device tensor, 1.0 when this step's update must be dropped. Only device ops: no host
        synchronisation."""
        bad = ~torch.isfinite(grad_norm.detach())
        if empty is not None:
            bad = bad & ~empty
        skip = bad | self._halted if self.stop else bad
        if self.stop:
            self._halted = skip
        if empty is not None:
            self._first_empty = torch.where(empty & (self._first_empty == 0), step, self._first_empty)
            self._last_empty = torch.where(empty, step, self._last_empty)
            self._empty = self._empty + empty
            skip = skip | empty
        first = bad & (self._first == 0)
        self._first = torch.where(first, step, self._first)
        self._first_norm = torch.where(first, grad_norm.detach().double(), self._first_norm)
        self._first_loss = torch.where(first, loss.detach().double(), self._first_loss)
        self._last = torch.where(bad, step, self._last)
        self._count = self._count + skip
        self._consecutive = torch.where(bad, self._consecutive + 1, 0.0 if empty is None
                                        else torch.where(empty, self._consecutive, 0.0))
        hit = (self._consecutive >= self.max_consecutive) & (self._limit_step == 0)
        self._limit_step = torch.where(hit, step, self._limit_step)
        return skip.float()

    def _loss_over_ranks(self, loss: float) -> tuple[float, int, int]:
        """(the step's loss: the mean of the ranks' ``loss``, as ``train/loss``; how many ranks' loss was not finite;
        the world size). A collective: :meth:`read` calls it on every rank alike when updates were dropped, which
        the global gradient norm decides for all. Each rank used to report its own loss: rank 0's line read "loss
        5.252", pointing at the lr, when rank 1's batch had given a NaN loss."""
        world = rank_and_world()[1]
        both = torch.tensor([loss, 0.0 if math.isfinite(loss) else 1.0], dtype=torch.float64, device=self._count.device)
        if world > 1:
            torch.distributed.all_reduce(both)
        total, ranks = both.tolist()
        return total / world, int(ranks), world

    def read(self, progress, step: int, last_checkpoint: Callable[[], Optional[str]]) -> Optional[DivergenceError]:
        """Bring the counts to the host (one synchronisation) after optimizer step ``step``: add them to ``progress``
        (a ``TrainProgress``: ``skipped_steps``, ``consecutive_skipped``) and warn about skipped updates. Returns the
        :class:`DivergenceError` to raise (``stop`` after a non-finite step; ``max_consecutive`` skips in a row), else
        None. ``last_checkpoint()`` names the newest checkpoint for the error."""
        count, consecutive, first, norm, loss, last, limit_step, empty, first_empty, last_empty = torch.stack(
            [self._count, self._consecutive, self._first, self._first_norm, self._first_loss, self._last,
             self._limit_step, self._empty, self._first_empty, self._last_empty]).tolist()
        for t in (self._count, self._first, self._last, self._limit_step, self._empty, self._first_empty,
                  self._last_empty):
            t.zero_()
        progress.skipped_steps += int(count)
        progress.consecutive_skipped = int(consecutive)
        if empty:
            more = f" and {int(empty) - 1} more step(s) up to step {int(last_empty)}" if empty > 1 else ""
            log.warning("step %d%s had no target on any rank (every target is ignored: the loss's ignore_index, or "
                        "a class weight of 0): nothing to learn from, update skipped (counted in train/skipped_steps)",
                        int(first_empty), more)
        count -= empty  # from here: the non-finite steps, and under stop the steps after the first of them
        if not count:
            return None
        first, last = int(first), int(last)
        loss, ranks, world = self._loss_over_ranks(loss)
        what = f"non-finite gradient norm ({norm}) at step {first} (loss {loss:.4g}"
        partial = 0 < ranks < world  # the weights are alike on every rank: some ranks' batches, not the weights
        what += (f": not finite on {ranks} of {world} ranks, whose batches or forward passes failed)" if partial
                 else ")")
        err = None
        if self.stop:
            after = f", and every update after it up to step {step}," if step > first else ""
            advice = "check that step's data on those ranks" if partial else self.advice
            err = DivergenceError(f"{what}: its update{after} was not applied (trainer.on_nonfinite=stop; "
                                  f"{advice})", first, last_checkpoint())
        else:
            if self.warn:
                more = f" and at {int(count) - 1} more step(s) up to step {last}" if count > 1 else ""
                log.warning("%s%s: update skipped on every rank (trainer.on_nonfinite=skip)", what, more)
            if limit_step:
                err = DivergenceError(f"{self.max_consecutive} steps in a row up to step {int(limit_step)} had "
                                      f"non-finite gradients and were skipped (trainer.max_consecutive_nonfinite="
                                      f"{self.max_consecutive})", int(limit_step), last_checkpoint())
        if err is not None:
            err.same_on_every_rank = True  # the step's loss over ranks, the global norm: each node's first rank says it
        return err
