"""Activation checkpointing and ``torch.compile``, applied per block (:mod:`hydratrain.parallel.blocks`) before the
strategy wraps the model (the order torchtitan uses: AC, then compile, then FSDP)."""
from __future__ import annotations

from functools import partial
from typing import Optional

from torch import nn

from hydratrain.parallel.blocks import Blocks, find_blocks


def apply_activation_checkpointing(model: nn.Module, blocks: Optional[Blocks] = None) -> int:
    """Wrap each of ``blocks`` (default: :func:`~hydratrain.parallel.blocks.find_blocks`) with non-reentrant
    activation checkpointing; returns how many were wrapped.

    Uses ``torch.distributed.algorithms._checkpoint.checkpoint_wrapper`` (its prefix is stripped from state-dict keys
    by ``torch.distributed.checkpoint.state_dict``, so checkpoints do not depend on it). ``blocks`` then holds the
    wrappers.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    blocks = blocks if blocks is not None else find_blocks(model)
    wrapper = partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    chosen = {id(m) for m in blocks.modules}
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrapper, check_fn=lambda m: id(m) in chosen)
    blocks.modules = [w for w in model.modules() if id(getattr(w, "_checkpoint_wrapped_module", None)) in chosen]
    return len(blocks.modules)


def compile_blocks(blocks: Blocks) -> int:
    """``torch.compile`` each of ``blocks`` in place (``Module.compile`` keeps parameter names; under activation
    checkpointing the block inside its wrapper, so the recomputation runs the compiled block); returns how many.

    Blocks of one class share one forward and, with ``torch._dynamo.config.inline_inbuilt_nn_modules`` (the default
    since torch 2.5), their parameters are graph inputs rather than guarded constants, so one compiled graph serves
    every block instead of one recompile per block (which would hit dynamo's recompile limit on deep models and
    silently fall back to eager).
    """
    for m in blocks.modules:
        getattr(m, "_checkpoint_wrapped_module", m).compile()
    return len(blocks.modules)
