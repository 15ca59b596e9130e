"""Evaluation over the fixed eval set (``hydratrain.data.streams.EvalBatches``): the same samples, each counted once,
whatever the world size and batch size, so ``eval/loss`` is comparable across the runs of a sweep that varies them.
"""
from __future__ import annotations

import math
from typing import ContextManager

import torch
import torch.nn.functional as F
from torch import nn


class Evaluator:
    """Mean next-token loss and perplexity of a model over ``eval_batches``, synced across ranks by torchmetrics.

    The loss is the sum of the valid (non-padding) tokens' losses over their count, both kept by
    ``torchmetrics.SumMetric`` and reduced over all ranks by its ``compute()`` (every rank calls); perplexity is
    ``exp`` of that mean (the definition torchmetrics' ``Perplexity`` computes, without a second softmax over the
    logits). (``MeanMetric``'s weights cannot mask the padding: with ``nan_strategy="disable"`` torchmetrics 1.9
    replaces them with ones.)
    """

    def __init__(self, eval_batches, device: torch.device):
        self.batches, self.device = eval_batches, device

    @torch.no_grad()
    def evaluate(self, model: nn.Module, autocast: ContextManager) -> tuple[float, float]:
        """(mean loss in nats/token, perplexity) of ``model`` (every rank calls; the model is put back in train
        mode)."""
        from torchmetrics import SumMetric

        loss_sum = SumMetric(nan_strategy="disable").to(self.device)
        tokens = SumMetric(nan_strategy="disable").to(self.device)
        was_training = model.training
        model.eval()
        for x, y, valid in self.batches:
            with autocast:
                logits = model(x)
            token_loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none").view_as(y)
            mask = valid[:, None].expand_as(token_loss)
            loss_sum.update(torch.where(mask, token_loss, torch.zeros_like(token_loss)).sum(dtype=torch.float64))
            tokens.update(mask.sum(dtype=torch.float64))
        model.train(was_training)
        loss = (loss_sum.compute() / tokens.compute()).item()
        return loss, math.exp(loss) if math.isfinite(loss) and loss < 700 else math.inf
