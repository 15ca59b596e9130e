"""Adapters that give torch objects the ``state_dict``/``load_state_dict`` of
``torch.distributed.checkpoint.stateful.Stateful``, with hydratrain's rules for what a resume restores.

- :class:`ModelState`, :class:`OptimizerState`: ``torch.distributed.checkpoint.state_dict`` (parameter names without
  DDP/FSDP/AC/compile prefixes; DTensor shards under FSDP), so a checkpoint loads into any strategy and world size.
  Under ``+peft=lora`` the model's part is its trainable parameters (the adapters) only.
  On load the optimizer keeps the saved moments and step counts but takes its hyper-parameters (lr, betas, eps,
  weight decay) from this run's config: resuming with a new ``optim.lr`` means the new lr (fine-tuning intent). The
  implementation (``optim.impl``: torch's ``foreach``/``fused`` flags) is this run's too, whatever the checkpoint's
  writer used: it changes how the update is computed, not its result.
  Quantised moments (``optim=adamw8bit``: torchao's ``OptimState8bit``, which DCP cannot write) are saved
  dequantised to float32 and quantised again on load, so a checkpoint of either optimizer loads into the other, on
  any strategy and world size, and an 8-bit run resumes exactly (re-quantising dequantised codes gives the same
  codes). torchao keeps ``lr``/``initial_lr`` as 0-d tensors where torch's AdamW has floats; the checkpoint manager
  reads each entry in the kind it was stored in and hands it over in this run's kind (``manager._load_template``).
- :class:`SchedulerState`: keeps the saved step count; the schedule and peak lr come from this run's config.
- :class:`RNGState`: this process's torch (CPU and CUDA), numpy and python RNG states.
"""
from __future__ import annotations

import io
import random
from typing import Any, Optional

import numpy as np
import torch
from torch import nn

from hydratrain.optim import Schedule
from hydratrain.parallel.init import canonical_name

HYPERPARAMETERS = ("lr", "initial_lr", "betas", "eps", "weight_decay")
IMPLEMENTATION = ("foreach", "fused", "capturable")  # torch.optim's choice of kernels: this run's, not the saved one


def set_group_value(group: dict, key: str, value) -> None:
    """``group[key] = value``, keeping the entry's kind: a tensor entry (torchao's optimizers keep ``lr`` as a 0-d
    tensor and refuse a float) is filled in place, a number stays a number."""
    if isinstance(group.get(key), torch.Tensor):
        group[key].fill_(float(value))
    else:
        group[key] = float(value) if isinstance(value, torch.Tensor) else value


class ModelState:
    """The model's parameters and buffers; ``trainable_only`` (LoRA adapters on a frozen base): the trainable
    parameters alone, since the run builds the frozen ones again from their source (``model.pretrained``)."""

    def __init__(self, model: nn.Module, trainable_only: bool = False):
        self.model, self.trainable_only = model, trainable_only

    def _options(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(ignore_frozen_params=self.trainable_only, strict=not self.trainable_only)

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        state = get_model_state_dict(self.model, options=self._options())
        if self.trainable_only:  # (torch keeps a tied alias of a frozen weight, lm_head.weight: by name, all go)
            frozen = {canonical_name(n.removeprefix("module.")) for n, p in
                      self.model.named_parameters(remove_duplicate=False) if not p.requires_grad}
            state = {k: v for k, v in state.items() if k not in frozen}
        return state

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(self.model, state, options=self._options())


class OptimizerState:
    """The optimizer's state; its configured hyper-parameters win over the saved ones (captured at construction,
    before a scheduler changes ``lr``)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer
        self.configured = [{k: g[k].clone() if isinstance(g[k], torch.Tensor) else g[k]
                            for k in HYPERPARAMETERS + IMPLEMENTATION if k in g} for g in optimizer.param_groups]

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        state: dict[str, Any] = get_optimizer_state_dict(self.model, self.optimizer)
        if "state" in state:  # new dicts: the per-parameter ones are the optimizer's own
            state["state"] = {name: {k: _dequantised(v) if _quantised(v) else v for k, v in values.items()}
                              for name, values in state["state"].items()}
        return state

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        # the optimizer's quantised buffers, filled again from the loaded float32 values below
        buffers = {id(p): {k: v for k, v in values.items() if _quantised(v)}
                   for p, values in self.optimizer.state.items()}
        set_optimizer_state_dict(self.model, self.optimizer, state)
        for p, values in self.optimizer.state.items():
            for key, buffer in buffers.get(id(p), {}).items():
                buffer.copy_(values[key])  # quantises
                values[key] = buffer
        for group, configured in zip(self.optimizer.param_groups, self.configured):
            # this optimizer's own values, and kinds (a checkpoint of torch's AdamW holds a float lr, torchao's a
            # tensor, and each optimizer refuses the other kind)
            group.update({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in configured.items()})
            if group.get("fused") or group.get("capturable"):  # these kernels keep the step count on the device
                for p in group["params"]:
                    state = self.optimizer.state.get(p, {})
                    if isinstance(state.get("step"), torch.Tensor):
                        state["step"] = state["step"].to(device=p.device, dtype=torch.float32)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _quantised(value: Any) -> bool:
    """A tensor (or a DTensor of one) whose values are stored quantised: a tensor subclass with ``dequantize()``
    (torchao's ``OptimState8bit``/``OptimState4bit``/``OptimStateFp8``)."""
    if not isinstance(value, torch.Tensor):
        return False
    local = _local(value)
    return type(local) is not torch.Tensor and callable(getattr(local, "dequantize", None))


def _dequantised(value: torch.Tensor) -> torch.Tensor:
    """``value`` as float32 values of the same (global) shape and placement.

    Block-wise quantisation (torchao's ``OptimState8bit``: per block, ``scale`` = the block's largest magnitude,
    codes = the nearest entries of a 256-value map of [-1, 1]) is undone as ``map[code] * scale``. The signed map
    ends at -0.993 and 1.0, so in a block whose largest magnitude was negative no value comes back as large as the
    scale, and quantising again would find a smaller scale and move codes (measured: 3 of 16384). There the most
    negative value is written as ``-scale``, its value before quantisation; quantising the result again then gives
    the same scale and codes, so a resume is exact.
    """
    local = _local(value)
    plain = local.dequantize(torch.float32)  # type: ignore[call-arg]  # torchao's subclasses take the dtype
    scale, codes = getattr(local, "scale", None), getattr(local, "codes", None)
    if isinstance(scale, torch.Tensor) and isinstance(codes, torch.Tensor) and scale.numel() \
            and codes.numel() % scale.numel() == 0:
        blocks = plain.reshape(scale.numel(), -1)
        scale = scale.reshape(-1, 1).float()
        largest = blocks.abs().amax(dim=1, keepdim=True)
        short = (largest < scale) & (largest > 0)  # the largest value was negative and came back smaller
        low = blocks.argmin(dim=1, keepdim=True)
        blocks.scatter_(1, low, torch.where(short, -scale, blocks.gather(1, low)))
        plain = blocks.reshape(plain.shape)
    if hasattr(value, "to_local"):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(plain, value.device_mesh, value.placements,  # type: ignore[attr-defined]  # a DTensor
                                  run_check=False, shape=value.shape,
                                  stride=value.stride())
    return plain


class SchedulerState:
    """A ``LambdaLR``'s step count; on load the lr of every group is recomputed from the configured base lr and
    schedule (the scheduler's own ``lr_lambdas``, built from this run's config) at the saved step. The saved run's
    own lr for the next step (``lr``, from checkpoints of 2026-12 on) is kept as :attr:`saved_lr` to compare
    (:meth:`lr_change`)."""

    def __init__(self, scheduler: torch.optim.lr_scheduler.LambdaLR):
        self.scheduler = scheduler
        self.saved_lr: Optional[float] = None

    def state_dict(self) -> dict:
        return {"last_epoch": self.scheduler.last_epoch, "_step_count": self.scheduler._step_count,
                "lr": float(self.scheduler.get_last_lr()[0])}

    def load_state_dict(self, state: dict) -> None:
        s = self.scheduler
        s.last_epoch = int(state["last_epoch"])
        s._step_count = int(state.get("_step_count", s.last_epoch + 1))
        lrs = [base * factor(s.last_epoch) for base, factor in zip(s.base_lrs, s.lr_lambdas)]
        for group, lr in zip(s.optimizer.param_groups, lrs):
            set_group_value(group, "lr", lr)
        s._last_lr = [float(lr) for lr in lrs]
        self.saved_lr = float(state["lr"]) if state.get("lr") is not None else None

    def retarget(self, steps: int) -> None:
        """The schedule stretched or shortened to ``steps`` optimizer steps in all, and the groups' lr at the
        restored step set on it (``trainer.max_epochs`` after a resume on another batch geometry:
        :meth:`hydratrain.train.trainer.Trainer.keep_the_epoch_limit`)."""
        for schedule in self.scheduler.lr_lambdas:
            if isinstance(schedule, Schedule):  # (scheduler_state makes a SchedulerState of Schedules only)
                schedule.total_steps = steps
        self.load_state_dict(self.state_dict())

    def lr_change(self, step: int) -> Optional[str]:
        """One line when the lr of optimizer step ``step + 1`` (the first after a resume at ``step``) on this run's
        schedule differs (by more than 1e-6 relative) from the one the saved run's schedule gave it: an extended
        ``trainer.max_steps`` under a decaying schedule sends the lr back up (a public report against another
        trainer), a changed ``optim.lr`` or schedule moves it. None when they agree or the checkpoint
        predates the saved ``lr``."""
        now = float(self.scheduler.get_last_lr()[0])
        if self.saved_lr is None or abs(now - self.saved_lr) <= 1e-6 * max(abs(now), abs(self.saved_lr)):
            return None
        schedule = self.scheduler.lr_lambdas[0]
        which = (f"{schedule.name} over {schedule.total_steps} steps"  # type: ignore[attr-defined]  # a Schedule
                 if hasattr(schedule, "total_steps")
                 else "this run's schedule")
        ratio = f"x{now / self.saved_lr:.3g}" if self.saved_lr else "from 0"
        return (f"resumed at step {step}: the lr of step {step + 1} is {now:.3e} on this launch's schedule ({which}, "
                f"base lr {self.scheduler.base_lrs[0]:.3g}) and was {self.saved_lr:.3e} on the saved run's "
                f"({ratio}): the lr follows this launch's config (docs/checkpoints.md, Resuming with other "
                "hyper-parameters)")


class OwnSchedulerState:
    """A scheduler of one's own (``scheduler._target_``): its own ``state_dict``, and the values it had set in the
    optimizer's parameter groups (the lr, and e.g. OneCycleLR's cycled momentum or betas), both as one value (DCP
    stores it whole). Loaded after the optimizer, whose load puts the configured values back, so the next step runs
    with the values the saved run's next step had."""

    def __init__(self, scheduler: Any):
        self.scheduler = scheduler

    def state_dict(self) -> dict:
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.scheduler.optimizer.param_groups]
        buffer = io.BytesIO()
        torch.save({"scheduler": self.scheduler.state_dict(), "groups": groups}, buffer)
        return {"state": buffer.getvalue()}

    def load_state_dict(self, state: dict) -> None:
        saved = torch.load(io.BytesIO(state["state"]), weights_only=True)
        self.scheduler.load_state_dict(saved["scheduler"])
        for group, values in zip(self.scheduler.optimizer.param_groups, saved["groups"]):
            for key, value in values.items():
                if key in group and key not in IMPLEMENTATION:
                    set_group_value(group, key, value)

    def lr_change(self, step: int) -> Optional[str]:
        return None


def scheduler_state(scheduler: Any) -> Any:
    """The Stateful of ``scheduler``: :class:`SchedulerState` for the built-in schedules, else
    :class:`OwnSchedulerState`."""
    lambdas = getattr(scheduler, "lr_lambdas", None)
    if isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR) and lambdas and isinstance(lambdas[0], Schedule):
        return SchedulerState(scheduler)
    return OwnSchedulerState(scheduler)


class RNGState:
    """This process's RNG states: torch CPU (and CUDA of ``device``), numpy's global, python's ``random``."""

    def __init__(self, device: torch.device):
        self.device = device

    def state_dict(self) -> dict[str, Any]:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state = {"torch": torch.get_rng_state(),  # (legacy get_state: a tuple, keys an array)
                 "numpy_keys": torch.from_numpy(keys.astype(np.int64)),  # type: ignore[attr-defined]
                 "numpy_rest": [kind, int(pos), int(has_gauss), float(cached)], "python": list(random.getstate())}
        if self.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (entries missing from ``state`` are left alone)."""
        if "torch" in state:
            torch.set_rng_state(state["torch"])
        if "numpy_keys" in state and "numpy_rest" in state:
            kind, pos, has_gauss, cached = state["numpy_rest"]
            np.random.set_state((kind, state["numpy_keys"].numpy().astype(np.uint32), pos, has_gauss, cached))
        if "python" in state:
            version, internal, gauss = state["python"]
            random.setstate((version, tuple(internal), gauss))
        if "cuda" in state and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda"], self.device)
