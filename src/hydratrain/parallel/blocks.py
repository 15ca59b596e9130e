"""A model's blocks: the repeated submodules that FSDP shards as units, activation checkpointing recomputes and
``trainer.compile`` compiles one by one. Found for any model, without knowing its classes:

- ``wrap_policy.block_classes``: dotted paths (``mypkg.nets.Block``, ``torch.nn.Embedding``: imported, matched by
  class identity) or bare class names (``LlamaDecoderLayer``), matched against the classes of the model's modules;
- else a Hugging Face model's ``_no_split_modules`` (the class names ``transformers`` itself keeps whole when it
  splits a model across devices; accelerate's FSDP auto-wrap reads the same list);
- else the class of the children of the model's largest ``nn.ModuleList`` or ``nn.Sequential`` (by the parameters of
  its children) whose children are all of one class and own parameters: the decoder layers of a transformer, the
  blocks of a CNN's stages (torchvision's ResNet and timm's models hold them in ``nn.Sequential``); lists of lists
  (stages of blocks) give the blocks inside them. A parametrization's list (``weight_norm``) is not one, and
  ``nn.Sequential`` itself is never the block class: it would match every ``nn.Sequential`` of the model.

Containers without a forward of their own (``nn.ModuleList``, ``nn.ModuleDict``) are never blocks: nothing calls them,
so FSDP cannot shard them as a unit and activation checkpointing or compile would wrap nothing.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Sequence, Union

from torch import nn

from hydratrain.errors import ConfigError
from hydratrain.protocols import no_split_module_names


@dataclass
class Blocks:
    """The blocks of a model: ``modules`` (in model order, outermost matches only), their ``classes``, and how they
    were found (``source``: ``wrap_policy.block_classes``, ``_no_split_modules`` or ``the largest nn.ModuleList``
    (or ``nn.Sequential``))."""

    modules: list
    classes: tuple
    source: str

    def describe(self) -> str:
        """``4 Block`` or ``2 Down + 2 Up``: the count per class (the model's own classes, whatever wraps them)."""
        counts: dict[str, int] = {}
        for m in self.modules:
            name = _class_name(_inner(m))
            counts[name] = counts.get(name, 0) + 1
        return " + ".join(f"{n} {c}" for c, n in counts.items()) or "no blocks"


def _class_name(module: nn.Module) -> str:
    """The module's class name before FSDP2 swapped its class for ``FSDP<name>``."""
    cls = type(module)
    if cls.__name__.startswith("FSDP") and len(cls.__mro__) > 2:
        return cls.__mro__[2].__name__ if cls.__mro__[1].__name__ == "FSDPModule" else cls.__mro__[1].__name__
    return cls.__name__


def _inner(module: nn.Module) -> nn.Module:
    """The module under activation-checkpointing and compile wrappers."""
    while True:
        inner = getattr(module, "_checkpoint_wrapped_module", None) or getattr(module, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return module
        module = inner


def _outermost(model: nn.Module, matches) -> list[nn.Module]:
    """Modules of ``model`` for which ``matches(module)`` holds, skipping any inside an earlier match."""
    found: list[nn.Module] = []
    inside: set[int] = set()
    for m in model.modules():
        if id(m) in inside or m is model:
            continue
        if matches(m):
            found.append(m)
            inside.update(id(s) for s in m.modules())
    return found


def _no_split_names(model: nn.Module) -> list[str]:
    return no_split_module_names(model)


CONTAINERS = (nn.ModuleList, nn.ModuleDict)  # no forward of their own: never a block


def largest_module_list(model: nn.Module) -> Optional[Union[nn.ModuleList, nn.Sequential]]:
    """The ``nn.ModuleList`` or ``nn.Sequential`` of ``model`` holding the most parameters in its children, among
    those whose children are all of one class that is neither a container (:data:`CONTAINERS`) nor
    ``nn.Sequential`` itself (a generic class: as a block class it would match every ``nn.Sequential``; a subclass of
    it, ``class Block(nn.Sequential)``, is a class of the model's own and may be one), or None when it has
    none. A ``ParametrizationList`` (``weight_norm``, ``spectral_norm``: it holds the original weight, its children
    compute from it and own nothing) and a list whose children own no parameters are not lists of blocks."""
    from torch.nn.utils.parametrize import ParametrizationList

    best, most = None, 0
    for m in model.modules():
        if not isinstance(m, (nn.ModuleList, nn.Sequential)) or isinstance(m, ParametrizationList) or not len(m):
            continue
        kinds = {type(_inner(c)) for c in m}
        kind = next(iter(kinds))
        if len(kinds) != 1 or kind is nn.Sequential or issubclass(kind, CONTAINERS):
            continue
        n = sum(p.numel() for c in m for p in c.parameters())
        if n > most:
            best, most = m, n
    return best


@functools.lru_cache(maxsize=None)
def _resolved(name: str) -> Optional[type]:
    """The class a dotted ``name`` imports as (``torch.nn.Embedding``, whose ``__module__`` is
    ``torch.nn.modules.sparse``), or None (a bare name, or one that does not import to a class)."""
    if "." not in name:
        return None
    from hydra.utils import get_object

    try:
        obj = get_object(name)
    except Exception:  # noqa: BLE001 (not importable: matched by its spelling)
        return None
    return obj if isinstance(obj, type) else None


def _class_matches(cls: type, name: str) -> bool:
    resolved = _resolved(name)
    if resolved is not None:
        return cls is resolved
    return name in (cls.__name__, cls.__qualname__, f"{cls.__module__}.{cls.__qualname__}")


def find_blocks(model: nn.Module, block_classes: Optional[Sequence[str]] = None, key: str = "wrap_policy.block_classes"
                ) -> Blocks:
    """The :class:`Blocks` of ``model`` (see the module docstring). Modules under activation-checkpointing or
    compile wrappers are matched by the class they wrap, and the outermost wrapper is returned.

    Raises :class:`~hydratrain.errors.ConfigError` naming ``key`` when a given class name matches no module.
    """
    if block_classes:
        names = [str(n) for n in block_classes]
        present = {type(_inner(m)) for m in model.modules()}
        for name in names:
            if any(_class_matches(c, name) for c in CONTAINERS):
                raise ConfigError(key, names, f"{name!r} is a container without a forward of its own (nothing calls "
                                  "it, so it cannot be a unit): name the class of the modules inside it")
            if not any(_class_matches(c, name) for c in present):
                known = sorted({c.__name__ for c in present if c not in (nn.ModuleList, nn.ModuleDict)})
                raise ConfigError(key, names, f"{name!r} matches no module of the model; its classes with "
                                  f"parameters: {', '.join(known[:12])}")
        return _blocks(model, lambda c: any(_class_matches(c, n) for n in names), key)
    names = _no_split_names(model)
    if names:
        found = _blocks(model, lambda c: c.__name__ in names, "_no_split_modules")
        if found.modules:
            return found
    biggest = largest_module_list(model)
    if biggest is not None:
        kind = type(_inner(biggest[0]))
        return _blocks(model, lambda c: c is kind, f"the largest {type(biggest).__name__}")
    return Blocks([], (), "none found")


def _blocks(model: nn.Module, class_matches, source: str) -> Blocks:
    def matches(m: nn.Module) -> bool:
        cls = type(_inner(m))
        return not issubclass(cls, CONTAINERS) and class_matches(cls)

    modules = _outermost(model, matches)
    return Blocks(modules, tuple(dict.fromkeys(type(_inner(m)) for m in modules)), source)
