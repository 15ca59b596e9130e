"""Optimizer and learning-rate schedule builders.

- ``adamw``: ``torch.optim.AdamW`` (Loshchilov & Hutter 2019) with weight decay on matrices only; norms' gains and
  biases (1-D tensors) get none, as in GPT-2/LLaMA training recipes.
- ``warmup_cosine``: linear warm-up over ``warmup_steps`` to ``optim.lr``, then cosine decay (Loshchilov & Hutter
  2017, SGDR, one cycle) to ``min_lr_ratio * optim.lr`` at ``total_steps``. ``constant``: warm-up, then flat.
"""
from __future__ import annotations

import math

import torch
from torch import nn


def build_optimizer(model: nn.Module, optim_cfg) -> torch.optim.Optimizer:
    """AdamW over ``model``'s trainable parameters (DTensor shards under FSDP)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": optim_cfg.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=optim_cfg.lr,
                             betas=(optim_cfg.beta1, optim_cfg.beta2), eps=optim_cfg.eps)


def lr_factor(step: int, name: str, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the peak lr for optimizer step ``step`` (0-based) under schedule ``name``."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if name == "constant":
        return 1.0
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, scheduler_cfg, total_steps: int):
    """``torch.optim.lr_scheduler.LambdaLR`` applying :func:`lr_factor`; step it once per optimizer step (the update
    of optimizer step ``s``, 1-based, uses factor ``s - 1``)."""
    name, warmup = str(scheduler_cfg.name), scheduler_cfg.warmup_steps
    min_ratio = scheduler_cfg.get("min_lr_ratio", 1.0)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, name, warmup, total_steps, min_ratio))


def total_steps(trainer_cfg, batches_per_epoch: int) -> int:
    """Optimizer steps the run takes: ``trainer.max_steps`` capped by ``trainer.max_epochs`` worth of micro-batches
    (``batches_per_epoch`` per rank, ``trainer.grad_accum_steps`` per step)."""
    steps = []
    if trainer_cfg.max_steps is not None:
        steps.append(trainer_cfg.max_steps)
    if trainer_cfg.max_epochs is not None:
        steps.append(trainer_cfg.max_epochs * batches_per_epoch // trainer_cfg.grad_accum_steps)
    return max(0, min(steps))
