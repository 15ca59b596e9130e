"""Which submodules FSDP shards as their own unit (their own all-gather / reduce-scatter) before the root.

- ``transformer_block`` (and ``auto``, the default): every block of the model
  (:func:`hydratrain.parallel.blocks.find_blocks`: ``wrap_policy.block_classes``, a Hugging Face model's
  ``_no_split_modules``, or the class of the children of its largest ``nn.ModuleList``).
- ``size_based``: walking the module tree children-first, a module whose parameters not yet in a unit number at
  least ``wrap_policy.min_num_params`` becomes a unit (the rule of FSDP1's ``size_based_auto_wrap_policy``).
- ``none``: the root only.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from hydratrain.parallel.blocks import Blocks, find_blocks


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


def _shared_parameters(model: nn.Module) -> set[int]:
    """ids of parameters registered under more than one module (tied weights)."""
    seen: dict[int, int] = {}
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None:
                seen[id(p)] = seen.get(id(p), 0) + 1
    return {pid for pid, n in seen.items() if n > 1}


def shard_units(model: nn.Module, wrap_policy_cfg, blocks: Optional[Blocks] = None) -> list[nn.Module]:
    """The submodules that ``wrap_policy`` gives their own ``fully_shard`` call (the root excluded); ``blocks``: the
    model's (default: :func:`~hydratrain.parallel.blocks.find_blocks` with ``wrap_policy.block_classes``). A tied
    weight must live in one unit, so a unit that owns only some of a tied weight's modules is dropped (the root keeps
    it)."""
    name = str(wrap_policy_cfg.name)
    if name in ("transformer_block", "auto"):
        if blocks is None:
            blocks = find_blocks(model, wrap_policy_cfg.get("block_classes"))
        units = list(blocks.modules)
    elif name == "size_based":
        units = size_based_units(model, wrap_policy_cfg.min_num_params)
    else:
        return []
    shared = _shared_parameters(model)
    lifted = _lift_out_of_checkpointing(model, [u for u in units if not shared & {id(p) for p in u.parameters()}])
    return list({id(u): u for u in lifted}.values())  # one unit per wrapper, in order


def _lift_out_of_checkpointing(model: nn.Module, units: list[nn.Module]) -> list[nn.Module]:
    """Each unit, replaced by the outermost activation-checkpointing wrapper around it, if any.

    FSDP's pre-forward hook (the all-gather and the cast to ``MixedPrecisionPolicy.param_dtype``) must run outside
    the checkpointed region, as torchtitan applies it: with the hook inside, torch 2.11's recomputation in backward
    saw fp32 parameters where the forward had bf16 ones and raised ``CheckpointError`` (torch 2.13 passes either
    way). A unit below a wrapper (a block's attention under ``size_based``) is merged into the wrapper's unit."""
    wrapper_of: dict[int, nn.Module] = {}
    for m in model.modules():  # parents before children: the outermost wrapper is seen first
        if isinstance(getattr(m, "_checkpoint_wrapped_module", None), nn.Module):
            for sub in m.modules():
                wrapper_of.setdefault(id(sub), m)
    return [wrapper_of.get(id(u), u) for u in units]


def mixed_dtypes(model: nn.Module, units: list[nn.Module], ignored: set[int]) -> Optional[str]:
    """What keeps FSDP from sharding ``model`` when ``units`` (in the order ``fully_shard`` is called on them, the
    root after them) each take the parameters in them that no earlier unit took, ``ignored`` (ids) left out: the
    first unit whose parameters are not all of one dtype (``fully_shard`` holds a unit's parameters as one flat
    buffer), as ``scale (float64) in the root unit, whose other parameters are float32``; None when there is none."""
    names = {id(p): n for n, p in model.named_parameters()}
    claimed = set(ignored)
    for unit in [*units, model]:
        params = [p for p in unit.parameters() if id(p) not in claimed]
        claimed.update(id(p) for p in params)
        counts: dict[torch.dtype, int] = {}
        for p in params:
            counts[p.dtype] = counts.get(p.dtype, 0) + 1
        if len(counts) < 2:
            continue
        common = max(counts, key=lambda dtype: counts[dtype])
        odd = [f"{names[id(p)]} ({str(p.dtype).removeprefix('torch.')})" for p in params if p.dtype != common]
        where = "the root unit" if unit is model else f"the unit {type(unit).__name__}"
        shown = ", ".join(odd[:4]) + (f" and {len(odd) - 4} more" if len(odd) > 4 else "")
        return f"{shown} in {where}, whose other parameters are {str(common).removeprefix('torch.')}"
    return None
