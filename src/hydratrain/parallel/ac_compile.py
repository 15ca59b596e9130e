"""Activation checkpointing and ``torch.compile``, applied per decoder block before the strategy wraps the model
(the order torchtitan uses: AC, then compile, then FSDP)."""
from __future__ import annotations

from functools import partial

from torch import nn

from hydratrain.models import Block


def apply_activation_checkpointing(model: nn.Module) -> int:
    """Wrap each decoder block with non-reentrant activation checkpointing; returns how many were wrapped.

    Uses ``torch.distributed.algorithms._checkpoint.checkpoint_wrapper`` (its prefix is stripped from state-dict keys
    by ``torch.distributed.checkpoint.state_dict``, so checkpoints do not depend on it).
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    wrapper = partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrapper, check_fn=lambda m: isinstance(m, Block))
    return sum(1 for m in model.modules() if isinstance(m, Block))


def compile_blocks(model: nn.Module) -> int:
    """``torch.compile`` each decoder block in place (``Module.compile`` keeps parameter names); returns how many.

    The blocks share one forward and, with ``torch._dynamo.config.inline_inbuilt_nn_modules`` (the default since
    torch 2.5), their parameters are graph inputs rather than guarded constants, so one compiled graph serves every
    block instead of one recompile per block (which would hit dynamo's recompile limit on deep models and silently
    fall back to eager).
    """
    n = 0
    for m in model.modules():
        if isinstance(m, Block):
            m.compile()
            n += 1
    return n
