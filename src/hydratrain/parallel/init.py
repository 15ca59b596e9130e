"""Initial weights for any model, after a build on the meta device and for an eager build: the init protocols.

A model says how it initialises by the first of these it has (the conventions of torchtitan, Lightning and
composer; hydratrain's own GPT uses the first):

1. ``model.init_param_(name, tensor, generator)``: fill the full-shape ``tensor`` of parameter ``name`` drawing
   from ``generator`` (and ``model.init_buffers()``, if defined, recomputes buffers). Each parameter gets its own
   ``torch.Generator`` seeded by (``trainer.seed``, its name), so an eager build, a meta build materialised after
   sharding and one sharded over any number of ranks start from the same numbers; under FSDP each rank draws one
   parameter at a time and keeps its slice, so no rank ever holds the whole model.
2. ``model.init_weights()``: the whole model at once, from the global RNG seeded with ``trainer.seed``. Under FSDP
   every sharded parameter is lent a full-size tensor for the call (the model is materialised whole on each rank
   once, then each rank keeps its slices): exact at any world size.
3. ``reset_parameters()`` of every module that owns parameters or buffers (``torch.nn`` layers have it,
   ``nn.MultiheadAttention`` as ``_reset_parameters()``; BatchNorm's also resets its running statistics), children
   before parents (as constructors run: ``nn.MultiheadAttention``'s zeroes its ``out_proj.bias``), each from the
   global RNG seeded by (``trainer.seed``, the module's name), lent full-size tensors under FSDP, one module at a
   time. A module that owns parameters or buffers and has no
   ``reset_parameters()`` cannot be initialised after a meta build: :func:`uninitialisable` names them.

Protocols 1 and 2 run after an eager build too (so it matches a meta build); protocol 3 does not: an eager build
keeps what the constructor drew (from the global RNG seeded with ``trainer.seed``, the same on every rank), since a
constructor may initialise beyond ``reset_parameters()`` and re-running it would undo that.

On CPU/gloo meshes DTensor has no offset-based RNG, so drawing into each rank's shard directly would give every shard
the same numbers; lending full tensors sidesteps it on every device. ``to_empty`` replaces each Parameter module by
module, which unties weights shared between modules: :func:`to_empty_keeping_ties` re-ties them.
"""
from __future__ import annotations

import contextlib
import zlib
from typing import TYPE_CHECKING, Callable, Iterator, Optional

import torch
from torch import nn

from hydratrain.protocols import has_init_buffers, has_init_param, has_init_weights, reset_parameters_of

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor
    from typing_extensions import TypeIs

WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")  # activation checkpointing, torch.compile
PER_PARAMETER, WHOLE_MODEL, PER_MODULE = "init_param_", "init_weights", "reset_parameters"


def canonical_name(name: str) -> str:
    """A parameter's (or module's) name without the prefixes wrappers add (activation checkpointing,
    ``torch.compile``), so its initial values do not depend on which wrappers the run uses."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name.replace("._checkpoint_wrapped_module", "").replace("._orig_mod", "")


def param_seed(seed: int, name: str) -> int:
    """The seed of parameter (or module) ``name``'s generator: a stable mix of the run seed and the canonical name
    (crc32), < 2**63."""
    return (seed * 1_000_003 + zlib.crc32(canonical_name(name).encode())) % (2**63 - 1)


def generators(seed: int, device: torch.device) -> Callable[[str], torch.Generator]:
    """``name -> torch.Generator`` on ``device``'s type, seeded with :func:`param_seed`."""
    def make(name: str) -> torch.Generator:
        return torch.Generator(device=device).manual_seed(param_seed(seed, name))
    return make


def protocol(model: nn.Module) -> str:
    """Which init protocol ``model`` follows: :data:`PER_PARAMETER`, :data:`WHOLE_MODEL` or :data:`PER_MODULE`."""
    if has_init_param(model):
        return PER_PARAMETER
    if has_init_weights(model):
        return WHOLE_MODEL
    return PER_MODULE


def protocol_of_class(cls: type) -> str:
    """:func:`protocol` of a model class, before it is built (``init_device=auto`` builds on meta only for the first
    two). A factory function says what it builds by its return annotation (``def causal_lm(...) -> HFCausalLM``):
    the protocol of that class; a factory without one counts as :data:`PER_MODULE`."""
    if not isinstance(cls, type):
        cls = returned_class(cls) or cls
    if has_init_param(cls):
        return PER_PARAMETER
    if has_init_weights(cls):
        return WHOLE_MODEL
    return PER_MODULE


def returned_class(factory: Callable) -> Optional[type]:
    """The class ``factory``'s return annotation names, or None (no annotation, not a class, does not resolve)."""
    import typing

    try:
        returned = typing.get_type_hints(factory).get("return")
    except Exception:  # noqa: BLE001 (a forward reference that does not resolve: no annotation to go by)
        return None
    return returned if isinstance(returned, type) else None


def _reset_of(module: nn.Module) -> Optional[Callable[[], None]]:
    """The module's ``reset_parameters()``, or ``nn.MultiheadAttention``'s ``_reset_parameters()`` (the one
    ``torch.nn`` layer that names it so), or None."""
    return reset_parameters_of(module)


def _owns_state(module: nn.Module) -> bool:
    return any(p is not None for p in module._parameters.values()) or \
        any(b is not None for b in module._buffers.values())


def uninitialisable(model: nn.Module) -> list[str]:
    """Names (and classes) of the modules that own parameters or buffers but have no ``reset_parameters()``, when
    the model follows :data:`PER_MODULE` (empty otherwise): after a meta build nothing would initialise them."""
    if protocol(model) != PER_MODULE:
        return []
    return [f"{canonical_name(name) or '<root>'} ({type(m).__name__})" for name, m in model.named_modules()
            if _owns_state(m) and _reset_of(m) is None
            and not hasattr(m, "_checkpoint_wrapped_module")]


def _is_dtensor(t: torch.Tensor) -> TypeIs[DTensor]:
    return hasattr(t, "to_local") and hasattr(t, "device_mesh")


def _local_slice(p: DTensor):
    """The index of ``p``'s local shard within its full tensor."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


@contextlib.contextmanager
def _full_parameters(modules: list[nn.Module]) -> Iterator[None]:
    """Every DTensor parameter registered directly on ``modules`` replaced by a full-size plain Parameter (fresh
    storage on the shard's device) for the duration, then each rank's slice copied into its shard and the DTensor put
    back. Plain parameters are left in place. Tied parameters stay tied (one full tensor for one parameter)."""
    lent: dict[int, tuple[DTensor, nn.Parameter]] = {}
    where: list[tuple[nn.Module, str, nn.Parameter]] = []
    for module in modules:
        for name, p in module._parameters.items():
            if p is None or not _is_dtensor(p):
                continue
            if id(p) not in lent:
                local = p.to_local()
                lent[id(p)] = (p, nn.Parameter(torch.empty(p.shape, dtype=local.dtype, device=local.device),
                                               requires_grad=p.requires_grad))
            where.append((module, name, p))
            module._parameters[name] = lent[id(p)][1]
    try:
        yield
    finally:
        with torch.no_grad():
            for shard, full in lent.values():
                shard.to_local().copy_(full[_local_slice(shard)])
        for module, name, p in where:
            module._parameters[name] = p


@contextlib.contextmanager
def _seeded(seed: int, device: torch.device) -> Iterator[None]:
    """The global RNG (CPU, and ``device``'s when it is CUDA) seeded with ``seed`` for the duration, restored after."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
        torch.manual_seed(seed)
        yield


class UninitialisedBuffers(ValueError):
    """After a meta build, the model's init protocol left these buffers as ``to_empty`` made them (garbage)."""


_INIT_OF = {PER_PARAMETER: "init_param_() and init_buffers()", WHOLE_MODEL: "init_weights()",
            PER_MODULE: "the reset_parameters() of its modules"}


def _poison_buffers(model: nn.Module) -> dict[int, int]:
    """Every buffer filled with what an init would not leave in it (NaN; the dtype's largest integer; True), so
    :func:`_unwritten_buffers` can tell which ones the init did not write. Returns ``{id(buffer): version}``."""
    marks = {}
    for buf in model.buffers():
        if buf.is_floating_point() or buf.is_complex():
            buf.fill_(float("nan"))
        elif buf.dtype == torch.bool:
            buf.fill_(True)
        else:
            buf.fill_(torch.iinfo(buf.dtype).max)
        marks[id(buf)] = buf._version
    return marks


def _unwritten_buffers(model: nn.Module, marks: dict[int, int]) -> list[str]:
    """Names of the buffers that are the objects :func:`_poison_buffers` filled, not written in place since (their
    version counter) and still hold its values everywhere (a write through ``.data`` keeps the version)."""
    left = []
    for name, buf in model.named_buffers():
        if id(buf) not in marks or buf._version != marks[id(buf)] or buf.numel() == 0:
            continue
        if buf.is_floating_point() or buf.is_complex():
            unwritten = bool(torch.isnan(buf).all())
        elif buf.dtype == torch.bool:
            unwritten = bool(buf.all())
        else:
            unwritten = bool((buf == torch.iinfo(buf.dtype).max).all())
        if unwritten:
            left.append(canonical_name(name))
    return left


@torch.no_grad()
def initialise(model: nn.Module, seed: int, device: torch.device, built_on_meta: bool) -> Optional[str]:
    """Initialise ``model`` (plain, or sharded by FSDP2: DTensor parameters) by its :func:`protocol`, seeded by
    ``seed``. ``built_on_meta``: it was built on the meta device and materialised with ``to_empty`` (every
    parameter and buffer holds garbage); an eager build following :data:`PER_MODULE` is left as its constructor
    made it. Returns a one-line note of what was done, or None when nothing was. Raises
    :class:`UninitialisedBuffers` when, after a meta build, the init left a buffer unwritten (a rotary table or a
    mask that only the constructor computes): it would hold garbage, different on every rank."""
    marks = _poison_buffers(model) if built_on_meta else {}
    note = _initialise(model, seed, device, built_on_meta)
    left = _unwritten_buffers(model, marks) if built_on_meta else []
    if left:
        shown = ", ".join(left[:4]) + (f" and {len(left) - 4} more" if len(left) > 4 else "")
        raise UninitialisedBuffers(
            f"built on meta, the model's buffers are only as its init makes them, and {_INIT_OF[protocol(model)]} "
            f"left {shown} unset (a constructor's values are lost on meta): compute them there too, or build it "
            "with storage: ++model.init_device=cpu (or cuda)")
    return note


def _initialise(model: nn.Module, seed: int, device: torch.device, built_on_meta: bool) -> Optional[str]:
    kind = protocol(model)
    if kind == PER_PARAMETER and has_init_param(model):
        for name, p in model.named_parameters():
            local = p.to_local() if _is_dtensor(p) else p
            gen = torch.Generator(device=local.device).manual_seed(param_seed(seed, name))
            if _is_dtensor(p):
                full = torch.empty(p.shape, dtype=local.dtype, device=local.device)
                model.init_param_(name, full, gen)
                local.copy_(full[_local_slice(p)])
            else:
                model.init_param_(name, p, gen)
        if has_init_buffers(model):
            model.init_buffers()
        return None
    if kind == WHOLE_MODEL and has_init_weights(model):
        with _seeded(seed, device), _full_parameters(list(model.modules())):
            model.init_weights()
        return "initialised by its init_weights()"
    if not built_on_meta:
        return None
    done = 0
    for name, module in reversed(list(model.named_modules())):  # children first: a parent's reset has the last word
        reset = _reset_of(module)
        if not _owns_state(module) or reset is None:
            continue
        with _seeded(param_seed(seed, name), device), _full_parameters([module]):
            reset()
        done += 1
    return f"initialised by the reset_parameters() of {done} modules"


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


def seed_training_rng(seed: int, rank: int) -> None:
    """After the model is built (its weights the same on every rank), give each rank its own stream of the global
    RNGs for training: dropout and other randomness in the forward draws independently per rank, as it does per
    sample of one process's batch (with one seed on every rank, rank r's masks were rank 0's, position for
    position: transformers issue #31412). Rank 0 keeps its stream, so a one-process run is as before; rank r > 0
    is seeded by (``seed``, ``r``). Randomness that must agree across ranks (a layer dropped for the whole batch, as
    LayerDrop does) draws from a generator of its own seeded alike."""
    import random
    import zlib

    import numpy as np
    import torch

    if rank == 0:
        return
    derived = zlib.crc32(f"{seed}:rank{rank}".encode())
    torch.manual_seed(derived)
    random.seed(derived)
    np.random.seed(derived)
