"""The ``optim`` group: the built-in optimizers' schemas (:mod:`hydratrain.optim` builds them) and the checks of
their values. An optimizer of one's own (``_target_``) is checked against its class in
:mod:`hydratrain.config.validate`. No torch import."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, List

from omegaconf import DictConfig, ListConfig, OmegaConf

from hydratrain.config.values import Option, Ranges, has_target
from hydratrain.errors import ConfigError


class OptimName(Option):
    adamw = "adamw"
    adamw8bit = "adamw8bit"


class AdamWImpl(Option):
    auto = "auto"
    for_loop = "for_loop"
    foreach = "foreach"
    fused = "fused"


@dataclass
class AdamWConfig:
    """``torch.optim.AdamW``; weight decay on matrices only (see ``hydratrain.optim``)."""

    option: ClassVar[OptimName] = OptimName.adamw
    name: OptimName = OptimName.adamw
    lr: float = 1e-3  # peak learning rate
    weight_decay: float = 0.1  # applied to matrices only (not norms or biases)
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    # torch's implementation: auto = fused where torch has the fused kernel for the parameters' device (CPU, CUDA),
    # else foreach (decided at run time and logged); for_loop | foreach | fused force one
    impl: AdamWImpl = AdamWImpl.auto
    # [{match: <glob on parameter names>, lr_scale: 0.1, weight_decay: 0.0}, ...]: the first match wins
    param_groups: List[Dict[str, Any]] = field(default_factory=list)


@dataclass
class AdamW8bitConfig:
    """torchao's ``AdamW8bit``: both moments kept as 8-bit codes with one fp32 scale per ``block_size`` values
    (about 1/4 of fp32 AdamW's state); tensors under 4096 values, or not a multiple of block_size, stay fp32."""

    option: ClassVar[OptimName] = OptimName.adamw8bit
    name: OptimName = OptimName.adamw8bit
    lr: float = 1e-3  # peak learning rate
    weight_decay: float = 0.1  # applied to matrices only (not norms or biases)
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    block_size: int = 256  # values per quantisation block (one fp32 scale each)
    # [{match: <glob on parameter names>, lr_scale: 0.1, weight_decay: 0.0}, ...]: the first match wins
    param_groups: List[Dict[str, Any]] = field(default_factory=list)


RANGES = Ranges(positive=("optim.lr", "optim.eps"), non_negative=("optim.weight_decay",))
#: adamw8bit's own keys (validate checks them after the strategy's, where they were added)
ADAMW8BIT_RANGES = Ranges(positive=("optim.block_size",))


def check_param_groups(cfg: DictConfig) -> None:
    """``optim.param_groups``: a list of ``{match: glob, lr_scale: > 0, weight_decay: >= 0}`` (whether each glob
    matches a parameter is known once the model is built). Raises ConfigError naming the entry's key."""
    entries = cfg.optim.get("param_groups") or []
    if not isinstance(entries, (list, ListConfig)):
        raise ConfigError("optim.param_groups", entries, "must be a list of {match, lr_scale, weight_decay}")
    for i, entry in enumerate(entries):
        key = f"optim.param_groups[{i}]"
        if not OmegaConf.is_dict(entry) or not isinstance(entry.get("match"), str) or not entry.match:
            raise ConfigError(f"{key}.match", entry.get("match") if OmegaConf.is_dict(entry) else entry,
                              "each entry needs match: a glob on parameter names (tok_emb.*, blocks.*.attn.*)")
        unknown = [k for k in entry if k not in ("match", "lr_scale", "weight_decay")]
        if unknown:
            raise ConfigError(f"{key}.{unknown[0]}", entry[unknown[0]], "allowed keys: match, lr_scale, weight_decay")
        for k, least in (("lr_scale", 0.0), ("weight_decay", None)):
            value = entry.get(k)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or \
                    (value <= least if least is not None else value < 0):
                raise ConfigError(f"{key}.{k}", value, "must be finite and " + ("> 0" if least is not None else ">= 0"))


def check_betas(cfg: DictConfig) -> None:
    """A built-in optimizer's betas (one of one's own takes its class's keywords)."""
    if not has_target(cfg.optim) and (not 0.0 <= cfg.optim.beta1 < 1.0 or not 0.0 <= cfg.optim.beta2 < 1.0):
        raise ConfigError("optim.beta1/beta2", (cfg.optim.beta1, cfg.optim.beta2), "must be in [0, 1)")
