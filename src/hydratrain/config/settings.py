"""Resolved settings: each group's hydratrain keys read once, with their one default, into a frozen object.

    data = DataSettings.of(cfg.data)     # data.batch_size, .num_workers, ... whether the option file lists them or not
    model = ModelSettings.of(cfg.model)  # model.init_device, model.init_from

The defaults are the schema's (:class:`~hydratrain.config.data.LoaderKeys`, :class:`~hydratrain.config.model.
ModelKeys`): a composed config already holds every key, and a config made by hand (a test's ``OmegaConf.create``)
gets the same values here. Nothing else reads these keys with a default of its own.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Union, cast

from omegaconf import OmegaConf

from hydratrain.config.data import LOADER_KEYS, LoaderKeys
from hydratrain.config.model import MODEL_KEYS, ModelKeys
from hydratrain.config.schema import LoraConfig

_LOADER_DEFAULTS = LoaderKeys()
_MODEL_DEFAULTS = ModelKeys()


def _value(node: Any, key: str, default: Any) -> Any:
    return node.get(key, default) if node is not None and hasattr(node, "get") else default


def option_value(node: Any, key: str, schema: type) -> Any:
    """``node``'s ``key``, or the default that the option schema ``schema`` declares for it when this option has no
    such key (``wrap_policy.min_num_params`` under ``wrap_policy=none``): the schema stays its one owner."""
    return _value(node, key, getattr(schema, key))


@dataclass(frozen=True)
class DataSettings:
    """The ``data`` group as the run reads it."""

    batch_size: Union[int, str]  # samples per micro-batch per rank; "auto" until :meth:`with_batch_size`
    val_fraction: float
    num_workers: int
    pin_memory: Optional[bool]
    persistent_workers: bool
    prefetch_factor: Optional[int]
    collate_fn: Any  # a _target_ node, or None
    seq_len: int  # tokens per sample for token data; 0 for a dataset node (its samples are counted as samples)
    is_dataset: bool  # a dataset node (``_target_``) rather than a built-in corpus

    @classmethod
    def of(cls, data: Any) -> "DataSettings":
        """The settings of a ``data`` node (composed or hand-made)."""
        values = {f.name: _value(data, f.name, getattr(_LOADER_DEFAULTS, f.name))
                  for f in dataclasses.fields(LoaderKeys)}
        if isinstance(values["batch_size"], str) and values["batch_size"].strip().lower() == "auto":
            values["batch_size"] = "auto"
        is_dataset = data is not None and OmegaConf.is_dict(data) and "_target_" in data
        return cls(**values, seq_len=int(_value(data, "seq_len", 0) or 0), is_dataset=is_dataset)

    def with_batch_size(self, batch_size: int) -> "DataSettings":
        return dataclasses.replace(self, batch_size=batch_size)


@dataclass(frozen=True)
class ModelSettings:
    """hydratrain's keys of the ``model`` node as the run reads them (not passed to the constructor)."""

    init_device: str
    init_from: Optional[str]

    @classmethod
    def of(cls, model: Any) -> "ModelSettings":
        return cls(**{f.name: _value(model, f.name, getattr(_MODEL_DEFAULTS, f.name))
                      for f in dataclasses.fields(ModelKeys)})


@dataclass(frozen=True)
class LoraSettings:
    """The ``peft`` group (``+peft=lora``) as the run reads it; :meth:`of` gives None when the run names no peft."""

    r: int
    alpha: float
    dropout: float
    target_modules: Optional[tuple[str, ...]]  # None: peft's default for the architecture

    @classmethod
    def of(cls, cfg: Any) -> Optional["LoraSettings"]:
        """The settings of the run config ``cfg``'s ``peft`` node, or None without one."""
        node = _value(cfg, "peft", None)
        if node is None:
            return None
        values = {f.name: _value(node, f.name, getattr(LoraConfig, f.name, None)) for f in dataclasses.fields(cls)}
        targets = values["target_modules"]
        return cls(r=int(values["r"]), alpha=float(values["alpha"]), dropout=float(values["dropout"]),
                   target_modules=None if targets is None else tuple(str(t) for t in targets))


#: the keys every composed config holds whether or not an option file lists them
OWNED_KEYS = frozenset([f"data.{k}" for k in LOADER_KEYS] + [f"model.{k}" for k in MODEL_KEYS])


def plus_as_force(overrides: list[str]) -> list[str]:
    """Command-line overrides with ``+KEY=VALUE`` of an :data:`OWNED_KEYS` key written ``++KEY=VALUE``: before these
    keys were in every composed config, a user's option file that left one out needed Hydra's ``+``
    (``+model.init_device=meta``), which Hydra now refuses for a key that is there. ``++`` sets it either way, so
    such commands keep working."""
    out = []
    for item in overrides:
        key = item[1:].split("=", 1)[0] if item.startswith("+") and not item.startswith("++") else None
        out.append("+" + item if key in OWNED_KEYS else item)
    return out


def node_dict(node: Any) -> dict[str, Any]:
    """A config node (or a mapping) as a plain, resolved dict with str keys."""
    out = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else dict(node)
    if not isinstance(out, dict):
        raise TypeError(f"not a mapping node: {type(out).__name__}")
    return cast(dict[str, Any], out)
