"""One config value read: as one of a few allowed values (:func:`compile_setting`, :func:`shard_on_one_rank_setting`),
for the modules that act on them (:mod:`hydratrain.parallel`) and for :mod:`hydratrain.config.validate`; the error
for a value that does not resolve (:func:`unresolvable`); what the groups' checks share: the option name type
(:class:`Option`), a key's value (:func:`select`) and the numeric ranges each group declares (:class:`Ranges`). No
torch import."""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Any, Iterable

from omegaconf import DictConfig, OmegaConf

from hydratrain.errors import ConfigError, Placeholder

#: the values of ``trainer.compile`` (what each compiles: :mod:`hydratrain.parallel.ac_compile`)
COMPILE_VALUES = ("auto", "true", "false", "model", "blocks")
#: the values of ``strategy.shard_on_one_rank`` (fsdp and hsdp: :mod:`hydratrain.parallel.strategy`)
SHARD_ON_ONE_RANK_VALUES = ("auto", "true", "false")
#: what a :class:`ConfigError` shows for a key that has no value (``???``)
NO_VALUE = Placeholder("???")


class Option(str, Enum):
    """A config option name. A ``str``, so ``cfg.strategy.name == "fsdp"`` holds; prints as its plain value."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @classmethod
    def values(cls) -> list[str]:
        return [m.value for m in cls]


def _choice(key: str, value: Any, allowed: tuple) -> str:
    """``value`` as one of ``allowed`` (lower case; YAML/CLI booleans become ``true``/``false``). Raises
    :class:`ConfigError` naming ``key`` and the allowed values for anything else."""
    text = ("true" if value else "false") if isinstance(value, bool) else str(value).strip().lower()
    if text not in allowed:
        raise ConfigError(key, value, f"allowed: {', '.join(allowed)}")
    return text


def compile_setting(value: Any) -> str:
    """``trainer.compile`` as one of :data:`COMPILE_VALUES`. Raises :class:`ConfigError` otherwise."""
    return _choice("trainer.compile", value, COMPILE_VALUES)


def shard_on_one_rank_setting(value: Any) -> str:
    """``strategy.shard_on_one_rank`` as one of :data:`SHARD_ON_ONE_RANK_VALUES`. Raises :class:`ConfigError`
    otherwise."""
    return _choice("strategy.shard_on_one_rank", value, SHARD_ON_ONE_RANK_VALUES)


def unresolvable(key: str, raw: Any, err: Exception) -> ConfigError:
    """The config error for ``key``, whose text ``raw`` raised ``err`` (an OmegaConf error) when resolved."""
    why = (str(err).strip().splitlines() or [type(err).__name__])[0]
    return ConfigError(key, raw, f"cannot be resolved: {why}")


def select(cfg: DictConfig, key: str) -> Any:
    """The value of the dotted ``key``; None where the config has no such key or it has no value."""
    return OmegaConf.select(cfg, key, throw_on_missing=False)


def present(cfg: DictConfig, key: str) -> bool:
    """Whether the config holds ``key`` (null counts as held)."""
    return OmegaConf.select(cfg, key, default="<absent>") != "<absent>"


def number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def has_target(node: Any) -> bool:
    """Whether a group's node is one of the researcher's own (``_target_``: a dataset, an optimizer, a schedule)
    rather than a built-in option."""
    return node is not None and "_target_" in node


@dataclass(frozen=True)
class Ranges:
    """A group's numeric keys by the range each must hold (dotted keys, each checked by :func:`check_ranges`)."""

    positive: tuple[str, ...] = ()  # finite and > 0, where the config holds the key (an option may not)
    non_negative: tuple[str, ...] = ()  # finite and >= 0; null too when the group's node has a _target_ of its own
    positive_or_null: tuple[str, ...] = ()  # finite and > 0, or null


def check_ranges(cfg: DictConfig, groups: Iterable[Ranges]) -> None:
    """Every key of ``groups`` in its range: all groups' ``positive`` keys first, then ``non_negative``, then
    ``positive_or_null``, each in the order ``groups`` gives. Raises :class:`ConfigError` on the first outside."""
    groups = tuple(groups)

    def check(key: str, allow_zero: bool = False, allow_none: bool = False) -> None:
        value = select(cfg, key)
        if value is None and allow_none:
            return
        if value is None or not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
            raise ConfigError(key, value, "must be finite and " + (">= 0" if allow_zero else "> 0"))

    for key in (key for ranges in groups for key in ranges.positive):
        if present(cfg, key):
            check(key)
    for key in (key for ranges in groups for key in ranges.non_negative):
        check(key, allow_zero=True, allow_none=has_target(cfg.get(key.split(".", 1)[0])))
    for key in (key for ranges in groups for key in ranges.positive_or_null):
        check(key, allow_none=True)
