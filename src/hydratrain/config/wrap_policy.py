"""The ``wrap_policy`` group: one schema per option (:mod:`hydratrain.parallel.wrap_policy` acts on them) and the
check of the option against the strategy (``block_classes``, which imports them, is checked with the components in
:mod:`hydratrain.config.validate`). No torch import."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, List, Optional

from omegaconf import MISSING, DictConfig

from hydratrain.config.strategy import SHARDED
from hydratrain.config.values import Option, Ranges
from hydratrain.errors import ConfigError


class WrapPolicyName(Option):
    auto = "auto"
    none = "none"
    size_based = "size_based"
    transformer_block = "transformer_block"


@dataclass
class WrapPolicyConfig:
    """Which submodules FSDP shards as their own unit before the root (see ``hydratrain.parallel.wrap_policy``).
    Only ``strategy=fsdp`` and ``hsdp`` shard; other strategies allow ``auto`` (the default) and ``none`` only."""

    option: ClassVar[Optional[WrapPolicyName]] = None
    name: WrapPolicyName = MISSING


@dataclass
class NamedWrapPolicy(WrapPolicyConfig):
    """``none``: the root only; no further keys."""


@dataclass
class BlockWrapPolicy(WrapPolicyConfig):
    """``auto`` (transformer_block under fsdp, else none) and ``transformer_block``: each block is its own unit."""

    # the block classes, as dotted names (mypkg.nets.Block) or class names (LlamaDecoderLayer); null = found in the
    # model: a Hugging Face model's _no_split_modules, else the class of the children of its largest nn.ModuleList
    # or nn.Sequential. A dotted name must import to an nn.Module class (checked before the run starts). Activation
    # checkpointing and trainer.compile use the same blocks.
    block_classes: Optional[List[str]] = None


@dataclass
class SizeBasedWrapPolicy(WrapPolicyConfig):
    option: ClassVar[WrapPolicyName] = WrapPolicyName.size_based
    name: WrapPolicyName = WrapPolicyName.size_based
    min_num_params: int = 100_000  # a module with at least this many not-yet-sharded parameters becomes a unit


RANGES = Ranges(positive=("wrap_policy.min_num_params",))


def check(cfg: DictConfig) -> None:
    """Only a sharding strategy wraps modules: another one takes ``auto`` or ``none``."""
    strategy = cfg.strategy.name
    if cfg.wrap_policy.name not in (WrapPolicyName.auto, WrapPolicyName.none) and strategy not in SHARDED:
        raise ConfigError("wrap_policy", cfg.wrap_policy.name, f"only strategy=fsdp or hsdp shards modules by a wrap "
                          f"policy (this run: strategy={strategy}); allowed here: auto, none")
