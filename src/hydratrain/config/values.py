"""One config value read: as one of a few allowed values (:func:`compile_setting`, :func:`shard_on_one_rank_setting`),
for the modules that act on them (:mod:`hydratrain.parallel`) and for :mod:`hydratrain.config.validate`; the error
for a value that does not resolve (:func:`unresolvable`). No torch import."""
from __future__ import annotations

from typing import Any

from hydratrain.errors import ConfigError

#: the values of ``trainer.compile`` (what each compiles: :mod:`hydratrain.parallel.ac_compile`)
COMPILE_VALUES = ("auto", "true", "false", "model", "blocks")
#: the values of ``strategy.shard_on_one_rank`` (fsdp and hsdp: :mod:`hydratrain.parallel.strategy`)
SHARD_ON_ONE_RANK_VALUES = ("auto", "true", "false")


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
