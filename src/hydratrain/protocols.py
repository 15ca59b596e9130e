"""The optional hooks a model (or its class) may define, declared once: what the core asks a model for.

A model is any ``torch.nn.Module``; each hook below is optional and the core falls back to a generic path where a
model has none. Each is a :func:`~typing.runtime_checkable` :class:`~typing.Protocol`, so
``isinstance(model, HasFlopsPerToken)`` asks whether the model has it. That check looks only at the attribute's
presence (on the class, for the protocols of methods only); the core calls a hook only when it is callable, so the call
sites ask through the ``has_*`` helpers here, which check exactly that (and work on a class as on an instance: some
hooks are asked of the model class before anything is built) and narrow the type for the call that follows
(``TypeIs``: a model stays an ``nn.Module`` that also has the hook).

A leaf module: it imports only ``typing`` (and ``torch`` for the annotations and inside
:func:`reset_parameters_of`), so any part of the core can import it, the torch-free ones (the planner) included.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol, Sequence, runtime_checkable

if TYPE_CHECKING:  # annotations only, never evaluated at run time (typing_extensions: a dependency of torch's)
    import torch
    from typing_extensions import TypeIs

__all__ = [
    "HasArchitecture", "HasExportTo", "HasFlopsPerToken", "HasInitBuffers", "HasInitParam", "HasInitWeights",
    "HasMaxSeqLen", "HasMemoryPlan", "HasNoSplitModules", "HasResetParameters", "has_architecture", "has_export_to",
    "has_flops_per_token", "has_init_buffers", "has_init_param", "has_init_weights", "has_memory_plan",
    "max_seq_len_of", "no_split_module_names", "reset_parameters_of",
]


# ------------------------------------------------------------------------------------------------ initialisation
@runtime_checkable
class HasInitParam(Protocol):
    """Init protocol 1 (:mod:`hydratrain.parallel.init`, the first the core looks for; hydratrain's GPT has it):
    ``init_param_(name, tensor, generator)`` fills the full-shape ``tensor`` of parameter ``name`` in place, drawing
    from ``generator``. The core calls it once per parameter after a meta build (and after an eager one, so both
    match), with a ``torch.Generator`` seeded by (``trainer.seed``, the parameter's canonical name); under FSDP it
    passes a full-size scratch tensor and keeps this rank's slice. Asked of the class too, before the build
    (``init_device=auto`` builds on meta only for models with protocol 1 or 2)."""

    def init_param_(self, name: str, tensor: torch.Tensor, generator: torch.Generator) -> None: ...


@runtime_checkable
class HasInitBuffers(Protocol):
    """With :class:`HasInitParam`: ``init_buffers()`` recomputes the model's buffers in place (their values are
    garbage after ``to_empty``); the core calls it once after the last ``init_param_``."""

    def init_buffers(self) -> None: ...


@runtime_checkable
class HasInitWeights(Protocol):
    """Init protocol 2 (used when the model has no :class:`HasInitParam`): ``init_weights()`` initialises the whole
    model in place from the global RNG, which the core seeds with ``trainer.seed``; under FSDP every sharded
    parameter is lent a full-size tensor for the call. Asked of the class too, before the build."""

    def init_weights(self) -> None: ...


@runtime_checkable
class HasResetParameters(Protocol):
    """Init protocol 3, per module (a model with neither protocol 1 nor 2): ``reset_parameters()`` of every module
    that owns parameters or buffers (``torch.nn`` layers have it) re-draws that module's own state in place. After a
    meta build the core calls it children first, each from the global RNG seeded by (``trainer.seed``, the module's
    name); a module that owns state without it makes a meta build refuse (``uninitialisable``)."""

    def reset_parameters(self) -> None: ...


# ------------------------------------------------------------------------------------------------ sizes and costs
@runtime_checkable
class HasFlopsPerToken(Protocol):
    """``flops_per_token(seq_len) -> float``: training FLOPs (forward and backward) per token at ``seq_len``
    (hydratrain's GPT: 6N + 12LHQT). The run's MFU uses it where the model has it and the data has a sequence
    length; otherwise the FLOPs are counted on a meta copy of the model."""

    def flops_per_token(self, seq_len: int) -> float: ...


@runtime_checkable
class HasMaxSeqLen(Protocol):
    """``max_seq_len``: the positions the model has weights for (an int), or None for any length. The config check
    refuses a ``data.seq_len`` longer than an int ``max_seq_len`` before any process group starts."""

    @property
    def max_seq_len(self) -> Optional[int]: ...


@runtime_checkable
class HasMemoryPlan(Protocol):
    """A model class's classmethod ``memory_plan(setup) -> Plan | None``: the memory planner
    (:mod:`hydratrain.footprint`) asks it for the plan of a :class:`~hydratrain.footprint.Setup` by the model's own
    memory model; None (or no hook) makes the planner simulate the whole model."""

    def memory_plan(self, setup: Any) -> Any: ...


# ------------------------------------------------------------------------------------------------ checkpoints
@runtime_checkable
class HasArchitecture(Protocol):
    """A model class's classmethod ``architecture(kwargs) -> {key: effective value}``: the constructor keywords
    that change what weights of the same shapes compute, with their effective values for a config's model node.
    A resume (or a weights file) whose saved values differ is refused, naming each key
    (``hydratrain.checkpoint.manager.architecture_diff``)."""

    def architecture(self, kwargs: dict) -> dict: ...


@runtime_checkable
class HasExportTo(Protocol):
    """``export_to(out_dir, state_dict, tokenizer) -> out_dir``: writes the model in its own ecosystem's format
    (hydratrain's Hugging Face models: a save_pretrained dir), given the full CPU weights by parameter name and the
    data's tokenizer.json (or None). The run's export and ``hydratrain.checkpoint.export`` call it where the model
    (or the class a checkpoint's model.json names) has it; otherwise they write a .safetensors file."""

    def export_to(self, out_dir: Any, state_dict: dict, tokenizer: Any = None) -> Any: ...


# ------------------------------------------------------------------------------------------------ sharding
@runtime_checkable
class HasNoSplitModules(Protocol):
    """``_no_split_modules``: the class names of the blocks that must not be split (the Hugging Face convention):
    the units the FSDP wrap and activation checkpointing use, instead of the blocks the core finds by itself."""

    _no_split_modules: Optional[Sequence[str]]


# ------------------------------------------------------------------------------------------------ helpers
def _callable_hook(obj: object, name: str) -> bool:
    """Whether ``obj`` (an instance or a class) has a callable ``name``: the test every call site made."""
    return callable(getattr(obj, name, None))


def has_init_param(obj: object) -> TypeIs[HasInitParam]:
    """``obj`` (a model or its class) has a callable :class:`HasInitParam` hook."""
    return _callable_hook(obj, "init_param_")


def has_init_buffers(obj: object) -> TypeIs[HasInitBuffers]:
    """``obj`` has a callable :class:`HasInitBuffers` hook."""
    return _callable_hook(obj, "init_buffers")


def has_init_weights(obj: object) -> TypeIs[HasInitWeights]:
    """``obj`` (a model or its class) has a callable :class:`HasInitWeights` hook."""
    return _callable_hook(obj, "init_weights")


def has_flops_per_token(obj: object) -> TypeIs[HasFlopsPerToken]:
    """``obj`` has a callable :class:`HasFlopsPerToken` hook."""
    return _callable_hook(obj, "flops_per_token")


def has_memory_plan(obj: object) -> TypeIs[HasMemoryPlan]:
    """``obj`` (a model class) has a callable :class:`HasMemoryPlan` hook."""
    return _callable_hook(obj, "memory_plan")


def has_architecture(obj: object) -> TypeIs[HasArchitecture]:
    """``obj`` (a model class) has a callable :class:`HasArchitecture` hook."""
    return _callable_hook(obj, "architecture")


def has_export_to(obj: object) -> TypeIs[HasExportTo]:
    """``obj`` (a model or its class) has a callable :class:`HasExportTo` hook."""
    return _callable_hook(obj, "export_to")


def reset_parameters_of(module: torch.nn.Module) -> Optional[Callable[[], None]]:
    """The module's :class:`HasResetParameters` hook, or ``nn.MultiheadAttention``'s ``_reset_parameters()`` (the
    one ``torch.nn`` layer that names it so), or None."""
    from torch import nn

    reset = getattr(module, "reset_parameters", None)
    if not callable(reset) and isinstance(module, nn.MultiheadAttention):
        reset = module._reset_parameters
    return reset if callable(reset) else None


def max_seq_len_of(model: object) -> Optional[int]:
    """The model's :class:`HasMaxSeqLen` value when it is an int, else None (no attribute, or any length)."""
    limit = model.max_seq_len if isinstance(model, HasMaxSeqLen) else None
    return limit if isinstance(limit, int) else None


def no_split_module_names(model: object) -> list[str]:
    """The model's :class:`HasNoSplitModules` class names as strings; empty when it has none (or an empty one)."""
    names = model._no_split_modules if isinstance(model, HasNoSplitModules) else None
    return [str(n) for n in names] if names else []
