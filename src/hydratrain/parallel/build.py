"""Build the run's :class:`~hydratrain.parallel.strategy.Strategy` from the config (:func:`build_strategy`: fsdp on
one rank may train as single) and the model under it (:func:`build_model`: build, parallelize, initialise).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from hydratrain import components
from hydratrain.config.schema import FSDPStrategy
from hydratrain.config.settings import LoraSettings, option_value
from hydratrain.config.values import shard_on_one_rank_setting
from hydratrain.errors import ConfigError
from hydratrain.parallel import init as param_init
from hydratrain.parallel import lora
from hydratrain.parallel.fsdp import FSDP, HSDP
from hydratrain.parallel.precision import Precision
from hydratrain.parallel.strategy import DDP, Single, Strategy

log = logging.getLogger(__name__)


STRATEGIES = {"single": Single, "ddp": DDP, "fsdp": FSDP, "hsdp": HSDP}


def single_on_one_rank(name: str, setting, world_size: int, device_type: str, cpu_offload: bool) -> Optional[str]:
    """Why ``strategy=name`` (``fsdp``/``hsdp``) on ``world_size`` rank(s) of a ``device_type`` device trains as
    ``strategy=single``, or None when it keeps its own strategy. ``setting``: ``strategy.shard_on_one_rank``.

    At world size 1 FSDP shards nothing: every rank holds all parameters, gradients and optimizer state either way,
    and what FSDP2 still does per unit (copying the parameters into unsharded ones in the compute dtype before each
    forward and again before each backward, the gradient reduction, DTensor dispatch in the optimizer and the norm)
    is pure cost; on one H200 gpt_small (8 x 1024 tokens, bf16) trained at 137,934 tokens/s under FSDP against
    211,034-254,310 under ``single`` (``bench/results/h200-2026-11-30``, torch 2.11). ``auto`` trains as ``single``
    on CUDA only: on a CPU FSDP at world size 1 is kept (the CPU tests exercise it on purpose, and no speed is at
    stake there); with ``cpu_offload`` FSDP is kept, since offloading the shards is what saves device memory.

    Pure: reads no device. Raises :class:`ConfigError` naming ``strategy.shard_on_one_rank`` when it is not
    auto/true/false, or is false with ``strategy.cpu_offload=true`` at world size 1."""
    value = shard_on_one_rank_setting(setting)
    if name not in ("fsdp", "hsdp") or world_size != 1 or value == "true":
        return None
    if cpu_offload:
        if value == "false":
            raise ConfigError("strategy.shard_on_one_rank", False, "strategy.cpu_offload=true needs FSDP's shards; "
                              "allowed with cpu_offload: auto or true")
        return None
    if value == "false":
        return f"strategy={name} on 1 rank trains as strategy=single (strategy.shard_on_one_rank=false)"
    if device_type != "cuda":
        return None
    return (f"strategy={name} on 1 GPU trains as strategy=single: one rank shards nothing, and FSDP's per-unit "
            "copies and hooks only cost time (strategy.shard_on_one_rank=true keeps FSDP)")


def build_strategy(cfg, world_size: Optional[int] = None, device_type: Optional[str] = None) -> Strategy:
    """The :class:`Strategy` for ``cfg.strategy.name`` (validated by ``hydratrain.config``). Given the launch's
    ``world_size`` and ``device_type``, ``fsdp``/``hsdp`` on one rank may become :class:`Single`
    (:func:`single_on_one_rank`, logged once); without them the configured strategy is built as it is."""
    name = str(cfg.strategy.name)
    if world_size is not None and device_type is not None:
        why = single_on_one_rank(name, option_value(cfg.strategy, "shard_on_one_rank", FSDPStrategy), world_size,
                                 device_type, bool(option_value(cfg.strategy, "cpu_offload", FSDPStrategy)))
        if why:
            log.info(why)
            return Single(cfg)
    return STRATEGIES[name](cfg)


def build_model(cfg, strategy: Strategy, precision: Precision, device: torch.device, vocab_size: Optional[int]):
    """The model of ``cfg.model`` (:func:`hydratrain.components.build_model`; a ``vocab_size`` keyword that is null
    gets ``vocab_size``), built where ``strategy`` says, parallelized and initialised.

    Returns (model to train, the plain module under any wrapper, parameter count, summary line). Raises
    :class:`ConfigError`: a meta build of a model that nothing could initialise (:func:`~hydratrain.parallel.init.
    uninitialisable`), or what the build raised.
    """
    kind = param_init.protocol_of_class(components.model_class(cfg))
    build_device = strategy.build_device(device, kind)
    raw = components.build_model(cfg, build_device, vocab_size, checked=True)  # on meta: the one check() built
    on_meta = build_device.type == "meta"
    if on_meta:
        lacking = param_init.uninitialisable(raw)
        if lacking:
            shown = ", ".join(lacking[:4]) + (f" and {len(lacking) - 4} more" if len(lacking) > 4 else "")
            raise ConfigError("model.init_device", strategy.init_device(), f"built on meta, the model must be "
                              f"initialised after sharding, but {shown} own parameters or buffers without a "
                              "reset_parameters() (and the model has no init_weights()): give them one, or build it "
                              "with storage: ++model.init_device=cpu (or cuda)")
    adapters = LoraSettings.of(cfg)
    if adapters is not None:  # (+peft=lora: the base frozen, adapters added, before any wrapper)
        raw = lora.apply(raw, adapters)
    n_params = ParamCount.of(raw)
    model, summary = strategy.parallelize(raw, precision, device, cfg.trainer.seed, built_on_meta=on_meta)
    if adapters is not None:
        summary += (f"; LoRA r={adapters.r} alpha={adapters.alpha:g}: {n_params.trainable:,} trainable parameters of "
                    f"{n_params.total:,}, the base frozen")
    return model, raw, n_params, summary


def count_text(n: float) -> str:
    """``n`` in three significant figures with a K/M/B/T suffix, as model sizes are written: 950, 17.2K, 124M, 1.2B."""
    for unit, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if float(f"{n:.3g}") >= unit:
            value = float(f"{n / unit:.3g}")
            return f"{value:g}{suffix}"
    return f"{n:g}"


@dataclass(frozen=True)
class ParamCount:
    """A model's parameters: all of them and the trainable ones (``requires_grad``), counted whole (an FSDP shard
    counts as its full parameter). Reads ``124M parameters``, or ``124M parameters (1.2M trainable)`` when some are
    frozen."""

    total: int
    trainable: int

    @classmethod
    def of(cls, model: nn.Module) -> "ParamCount":
        params = list(model.parameters())
        return cls(sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad))

    def __str__(self) -> str:
        frozen = f" ({count_text(self.trainable)} trainable)" if self.trainable != self.total else ""
        return f"{count_text(self.total)} parameters{frozen}"
