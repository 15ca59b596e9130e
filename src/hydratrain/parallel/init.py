"""Initial weights that do not depend on how the model was built or distributed.

Every parameter is drawn from its own ``torch.Generator`` seeded by (``trainer.seed``, parameter name), so a model
built eagerly, one built on the meta device and materialised after sharding, and one sharded over any number of
ranks all start from the same numbers (on the same device type). This also sidesteps the missing offset-based RNG of
DTensor on CPU/gloo meshes, where drawing into each rank's shard with the global RNG gives every shard the same
numbers (the full weight would be world_size copies of one block).

``to_empty`` replaces each Parameter module by module, which unties weights shared between modules (tied input and
output embeddings): :func:`to_empty_keeping_ties` re-ties them.
"""
from __future__ import annotations

import zlib
from typing import Callable

import torch
from torch import nn

WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")  # activation checkpointing, torch.compile


def canonical_name(name: str) -> str:
    """A parameter's name without the prefixes wrappers add (activation checkpointing, ``torch.compile``), so its
    initial values do not depend on which wrappers the run uses."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def param_seed(seed: int, name: str) -> int:
    """The seed of parameter ``name``'s generator: a stable mix of the run seed and the canonical name (crc32),
    < 2**63."""
    return (seed * 1_000_003 + zlib.crc32(canonical_name(name).encode())) % (2**63 - 1)


def generators(seed: int, device: torch.device) -> Callable[[str], torch.Generator]:
    """``name -> torch.Generator`` on ``device``'s type, seeded with :func:`param_seed`."""
    def make(name: str) -> torch.Generator:
        return torch.Generator(device=device).manual_seed(param_seed(seed, name))
    return make


def tied_parameters(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Groups of (module, attribute) that hold the same Parameter object, for every parameter held more than once."""
    groups: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                groups.setdefault(id(p), []).append((module, name))
    return [g for g in groups.values() if len(g) > 1]


def retie(groups: list[list[tuple[nn.Module, str]]]) -> None:
    """Point every (module, attribute) of each group at the group's first parameter."""
    for (first_module, first_name), *rest in groups:
        shared = first_module._parameters[first_name]
        for module, name in rest:
            module._parameters[name] = shared


def to_empty_keeping_ties(model: nn.Module, device: torch.device) -> None:
    """``model.to_empty(device=device)`` (uninitialised storage for every parameter and buffer), keeping tied
    parameters tied."""
    groups = tied_parameters(model)
    model.to_empty(device=device)
    retie(groups)


def move_buffers(model: nn.Module, device: torch.device) -> None:
    """Move every buffer to ``device`` (FSDP's CPU offload keeps parameters on the CPU, but buffers such as the
    rotary tables are used by the forward on the compute device)."""
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None and buf.device != device:
                module._buffers[name] = buf.to(device)
