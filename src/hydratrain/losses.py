"""Built-in losses: callables ``loss(outputs, targets) -> 0-d mean`` (the ``loss`` config group's contract).

Any callable of that shape is a loss (``torch.nn.CrossEntropyLoss()``, ``torch.nn.MSELoss()``, a user's function
given with ``_partial_: true``); the trainer calls it outside the autocast region, on the model's outputs as returned
(``.logits`` of an output object that has them), and divides it by ``trainer.grad_accum_steps`` itself.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class NextTokenLoss:
    """Mean cross-entropy (nats per prediction) over the last dim of ``outputs``, computed in float32.

    Shapes: ``outputs (..., C)`` logits and ``targets (...)`` class ids of the same leading shape: ``(B, T, vocab)``
    against ``(B, T)`` for a language model's next token (the data gives targets shifted by one), ``(B, C)`` against
    ``(B,)`` for a classifier. ``ignore_index`` (default -100, as ``F.cross_entropy``) marks targets that count
    for nothing. ``perplexity``: the eval logs ``exp(eval/loss)`` as ``eval/perplexity`` with it.
    """

    perplexity = True

    def __init__(self, ignore_index: int = -100):
        self.ignore_index = ignore_index

    def __call__(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(outputs.float().flatten(0, -2), targets.flatten(), ignore_index=self.ignore_index)

    def __repr__(self) -> str:
        return f"NextTokenLoss(ignore_index={self.ignore_index})"
