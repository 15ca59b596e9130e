"""Apply, in order, activation checkpointing -> compile -> DDP or FSDP2 ``fully_shard`` to a model.

FSDP2 (``torch.distributed.fsdp.fully_shard``) shards each parameter as a DTensor over a 1-D device mesh. The
``wrap_policy`` chooses which submodules get their own ``fully_shard`` call (their own all-gather/reduce-scatter
unit) before the root module gets one:

- ``transformer_block``: every decoder block (``hydratrain.models.Block``).
- ``size_based``: walking the module tree children-first, a module whose parameters not yet in a unit number at
  least ``wrap_policy.min_num_params`` becomes a unit (the rule of FSDP1's ``size_based_auto_wrap_policy``).
- ``none``: the root only.

Models built on the meta device are sharded first and only then materialised (``to_empty``) and initialised, so
each rank allocates only its shard.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn

from hydratrain.models import Block
from hydratrain.precision import mixed_precision_policy

log = logging.getLogger(__name__)


def apply_activation_checkpointing(model: nn.Module) -> int:
    """Wrap each decoder block with non-reentrant activation checkpointing; returns how many were wrapped.

    Uses ``torch.distributed.algorithms._checkpoint.checkpoint_wrapper`` (the wrapper prefix is stripped from
    state-dict keys by ``torch.distributed.checkpoint.state_dict``, so checkpoints do not depend on it).
    """
    from functools import partial

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (CheckpointImpl,
                                                                             apply_activation_checkpointing,
                                                                             checkpoint_wrapper)

    wrapper = partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrapper, check_fn=lambda m: isinstance(m, Block))
    return sum(1 for m in model.modules() if isinstance(m, Block))


def compile_blocks(model: nn.Module) -> int:
    """``torch.compile`` each decoder block in place (``Module.compile`` keeps parameter names)."""
    n = 0
    for m in model.modules():
        if isinstance(m, Block):
            m.compile()
            n += 1
    return n


def size_based_units(model: nn.Module, min_num_params: int) -> list[nn.Module]:
    """Non-root modules that become FSDP units under the size rule, children before parents."""
    units: list[nn.Module] = []
    claimed: set[int] = set()

    def visit(module: nn.Module) -> None:
        for child in module.children():
            visit(child)
        if module is model or isinstance(module, (nn.ModuleList, nn.ModuleDict)):  # no forward: cannot be a unit
            return
        free = [p for p in module.parameters() if id(p) not in claimed]
        if sum(p.numel() for p in free) >= min_num_params:
            units.append(module)
            claimed.update(id(p) for p in free)

    visit(model)
    return units


def shard_units(model: nn.Module, wrap_policy_cfg) -> list[nn.Module]:
    """The submodules that ``wrap_policy`` gives their own ``fully_shard`` call (the root excluded)."""
    name = wrap_policy_cfg.name
    if name == "transformer_block":
        return [m for m in model.modules() if isinstance(m, Block)]
    if name == "size_based":
        units = size_based_units(model, wrap_policy_cfg.min_num_params)
        # A tied weight must live in one unit: skip units that own only part of a shared parameter set.
        shared = {id(model.lm_head.weight)} if getattr(model, "cfg", None) and model.cfg.tie_embeddings else set()
        return [u for u in units if not shared & {id(p) for p in u.parameters()}]
    return []


def apply_fsdp(model: nn.Module, cfg, device: torch.device) -> int:
    """``fully_shard`` each unit of ``cfg.wrap_policy`` then the root; returns the number of units (root included).

    Options: ``strategy.reshard_after_forward``, ``strategy.cpu_offload`` (``CPUOffloadPolicy``; pinned memory only
    with CUDA), and ``precision`` -> ``MixedPrecisionPolicy``.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    import torch.distributed as dist

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    kwargs = dict(mesh=mesh, reshard_after_forward=cfg.strategy.reshard_after_forward,
                  mp_policy=mixed_precision_policy(cfg.precision))
    if cfg.strategy.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    units = shard_units(model, cfg.wrap_policy)
    for unit in units:
        fully_shard(unit, **kwargs)
    # The root holds what no unit took; it is never resharded after forward since backward needs it at once.
    fully_shard(model, **{**kwargs, "reshard_after_forward": False if units else cfg.strategy.reshard_after_forward})
    return len(units) + 1


def parallelize(model: nn.Module, cfg, device: torch.device, on_meta: bool) -> tuple[nn.Module, str]:
    """Apply AC, compile and the strategy to ``model``; materialise it if built on meta. Returns (model, summary).

    ``single``: the model moved to ``device``. ``ddp``: ``DistributedDataParallel`` (needs a process group).
    ``fsdp``: ``fully_shard`` per wrap policy. Raises ValueError for an unknown ``strategy.name``.
    """
    notes = []
    if cfg.activation_checkpointing:
        notes.append(f"activation checkpointing on {apply_activation_checkpointing(model)} blocks")
    if cfg.trainer.compile:
        notes.append(f"compiled {compile_blocks(model)} blocks")
    name = cfg.strategy.name
    if name == "fsdp":
        n = apply_fsdp(model, cfg, device)
        notes.append(f"fsdp: sharded {n} modules ({n - 1} by wrap_policy={cfg.wrap_policy.name} + root), "
                     f"reshard_after_forward={cfg.strategy.reshard_after_forward}, "
                     f"cpu_offload={cfg.strategy.cpu_offload}")
        if on_meta:
            model.to_empty(device="cpu" if cfg.strategy.cpu_offload else device)
            model.init_weights()
    else:
        if on_meta:
            model.to_empty(device=device)
            model.init_weights()
        model.to(device)
        if name == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                        bucket_cap_mb=cfg.strategy.bucket_cap_mb,
                        find_unused_parameters=cfg.strategy.find_unused_parameters)
            notes.append("ddp")
        elif name != "single":
            raise ValueError(f"strategy.name={name!r}: allowed single, ddp, fsdp")
        else:
            notes.append("single")
    return model, "; ".join(notes)


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module under a DDP wrapper (FSDP2 and AC keep the module itself)."""
    return model.module if hasattr(model, "module") and isinstance(model, nn.parallel.DistributedDataParallel) \
        else model


def local_param_bytes(model: nn.Module) -> int:
    """Bytes of parameter storage this rank holds (the local shard of each DTensor), in bytes."""
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


