"""Adapters that give torch objects the ``state_dict``/``load_state_dict`` of
``torch.distributed.checkpoint.stateful.Stateful``, with hydratrain's rules for what a resume restores.

- :class:`ModelState`, :class:`OptimizerState`: ``torch.distributed.checkpoint.state_dict`` (parameter names without
  DDP/FSDP/AC/compile prefixes; DTensor shards under FSDP), so a checkpoint loads into any strategy and world size.
  On load the optimizer keeps the saved moments and step counts but takes its hyper-parameters (lr, betas, eps,
  weight decay) from this run's config: resuming with a new ``optim.lr`` means the new lr (fine-tuning intent).
- :class:`SchedulerState`: keeps the saved step count; the schedule and peak lr come from this run's config.
- :class:`RNGState`: this process's torch (CPU and CUDA), numpy and python RNG states.
"""
from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from torch import nn

HYPERPARAMETERS = ("lr", "initial_lr", "betas", "eps", "weight_decay")


class ModelState:
    def __init__(self, model: nn.Module):
        self.model = model

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.model)

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(self.model, state)


class OptimizerState:
    """The optimizer's state; its configured hyper-parameters win over the saved ones (captured at construction,
    before a scheduler changes ``lr``)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer
        self.configured = [{k: g[k] for k in HYPERPARAMETERS if k in g} for g in optimizer.param_groups]

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.model, self.optimizer, state)
        for group, configured in zip(self.optimizer.param_groups, self.configured):
            group.update(configured)


class SchedulerState:
    """A ``LambdaLR``'s step count; on load the lr of every group is recomputed from the configured base lr and
    schedule (the scheduler's own ``lr_lambdas``, built from this run's config) at the saved step."""

    def __init__(self, scheduler: torch.optim.lr_scheduler.LambdaLR):
        self.scheduler = scheduler

    def state_dict(self) -> dict:
        return {"last_epoch": self.scheduler.last_epoch, "_step_count": self.scheduler._step_count}

    def load_state_dict(self, state: dict) -> None:
        s = self.scheduler
        s.last_epoch = int(state["last_epoch"])
        s._step_count = int(state.get("_step_count", s.last_epoch + 1))
        lrs = [base * factor(s.last_epoch) for base, factor in zip(s.base_lrs, s.lr_lambdas)]
        for group, lr in zip(s.optimizer.param_groups, lrs):
            group["lr"] = lr
        s._last_lr = lrs


class RNGState:
    """This process's RNG states: torch CPU (and CUDA of ``device``), numpy's global, python's ``random``."""

    def __init__(self, device: torch.device):
        self.device = device

    def state_dict(self) -> dict[str, Any]:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state = {"torch": torch.get_rng_state(), "numpy_keys": torch.from_numpy(keys.astype(np.int64)),
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
