"""The run config's schema: :class:`TrainConfig` (one field per config group, plus a few top-level switches), the
option schemas of every group (:data:`SCHEMAS`) and their ConfigStore registration.

Each group's schema and the checks of its values live in one module (:mod:`hydratrain.config.data`, ``.model``,
``.strategy``, ``.precision``, ``.wrap_policy``, ``.launcher``, ``.optim``, ``.scheduler``, ``.paths``, ``.trainer``,
``.checkpoint``, ``.logger``); the groups with no options (``distributed``, ``plan``) and the top-level keys are
here. Every option name is defined once, as an :class:`~hydratrain.config.values.Option` Enum; Hydra rejects any other
value while composing (``strategy.name=fsdq`` -> ``Invalid value 'fsdq', expected one of [single, ddp, fsdp]``).
Groups whose options take different keys get one dataclass per option (``ddp`` has ``bucket_cap_mb``, ``fsdp`` has
``cpu_offload``), stored as ``schema/<group>/<option>`` and pulled in by each ``conf/<group>/<option>.yaml``
(``defaults: [/schema/...@_here_]``), so a key that an option does not use is a composition error instead of being
silently ignored. ``TrainConfig`` ties the groups together and is registered as ``train_schema`` (listed first in
``conf/train.yaml``).

Importing this module has no side effects and does not import torch; call :func:`register_configs` once.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig

from hydratrain.config.checkpoint import CheckpointConfig
from hydratrain.config.data import (
    LOADER_KEYS,
    HFDatasetData,
    LoaderKeys,
    PythonStdlibBPEData,
    PythonStdlibData,
    SyntheticData,
    TextFilesData,
    TokenBinData,
    TokenizedTextData,
)
from hydratrain.config.launcher import (
    LocalLauncher,
    RayLauncher,
    SlurmLauncher,
    SubmititLocalLauncher,
    TorchrunLauncher,
)
from hydratrain.config.logger import LoggerConfig
from hydratrain.config.model import MODEL_KEYS, ModelKeys
from hydratrain.config.optim import AdamW8bitConfig, AdamWConfig
from hydratrain.config.paths import DefaultPaths, WorkspacePaths
from hydratrain.config.precision import AutoPrecision, BF16Precision, FP8Precision, FP16Precision, FP32Precision
from hydratrain.config.scheduler import ConstantSchedule, WarmupCosineSchedule
from hydratrain.config.strategy import DDPStrategy, FSDPStrategy, HSDPStrategy, SingleStrategy
from hydratrain.config.trainer import TrainerConfig
from hydratrain.config.values import Option, Ranges
from hydratrain.config.wrap_policy import BlockWrapPolicy, NamedWrapPolicy, SizeBasedWrapPolicy
from hydratrain.errors import ConfigError

#: what the rest of hydratrain imports from here (each defined in its group's module)
__all__ = ["LOADER_KEYS", "MODEL_KEYS", "SCHEMAS", "AdamW8bitConfig", "AdamWConfig", "FSDPStrategy", "LoaderKeys",
           "ModelKeys", "SizeBasedWrapPolicy", "TrainConfig", "register_configs"]


class Device(Option):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class RunMode(Option):
    train = "train"
    eval = "eval"


@dataclass
class DistributedConfig:
    """Process-group behaviour (see ``hydratrain.dist.process_group``)."""

    failure_timeout_s: float = 60.0  # when a rank raises or dies, every other rank exits within this many seconds
    collective_timeout_s: float = 600.0  # a collective that waits longer than this fails (process-group timeout)


@dataclass
class PlanConfig:
    """The memory planner (``hydratrain.plan``): the per-rank peak predicted at the start of every run and by
    ``python -m hydratrain.plan``, against a budget."""

    enabled: bool = True  # log the prediction at the start of every run (and warn when it exceeds the budget)
    memory_gb: Optional[float] = None  # per-rank budget, GiB; null = the device's (CUDA: total memory; CPU: the
    #                                    available RAM shared by the node's ranks)
    world_size: Optional[int] = None  # python -m hydratrain.plan: ranks to plan for; null = WORLD_SIZE or 1
    ranks_per_node: Optional[int] = None  # python -m hydratrain.plan on CPU: ranks sharing this node's RAM; null = all


@dataclass
class LoraConfig:
    """``+peft=lora``: LoRA adapters (Hu et al. 2021) through ``peft`` (extra ``[peft]``) on the model's named Linear
    layers; the base weights stay frozen (see ``hydratrain.parallel.lora``)."""

    r: int = 8  # rank of each adapter (A: r x in, B: out x r)
    alpha: float = 16.0  # the update B @ A is scaled by alpha / r
    dropout: float = 0.0  # dropout on the adapter's input
    # module names (or name suffixes) to adapt: [q_proj, v_proj]; null = peft's default for the architecture
    target_modules: Optional[List[str]] = None


@dataclass
class TrainConfig:
    """The whole run config: one field per config group, plus a few top-level switches."""

    # Components, each a Hydra node built with hydra.utils.instantiate (see hydratrain.components): the model
    # (_target_ + keyword arguments; init_device and init_from are hydratrain's), the loss (a callable
    # loss(outputs, targets) -> mean), the eval metrics ({name: torchmetrics node}, logged as eval/<name>); data is
    # a built-in corpus (name: ...) or a _target_ node returning datasets.
    model: Any = field(default_factory=lambda: asdict(ModelKeys()))  # the option file's keys merge onto these
    loss: Any = MISSING
    metrics: Dict[str, Any] = field(default_factory=dict)  # {name: _target_ node}: eval metrics, logged eval/<name>
    callbacks: Dict[str, Any] = field(default_factory=dict)  # {name: _target_ node}: hooks into the loop, in order
    data: Any = field(default_factory=lambda: asdict(LoaderKeys()))  # the option file's keys merge onto these
    strategy: Any = MISSING
    precision: Any = MISSING
    wrap_policy: Any = MISSING
    launcher: Any = MISSING
    optim: Any = MISSING
    scheduler: Any = MISSING
    paths: Any = MISSING
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    peft: Optional[LoraConfig] = None  # +peft=lora: train LoRA adapters, the base frozen (extra [peft])
    activation_checkpointing: bool = False  # recompute each block (the model's repeated layers) in backward
    # train | eval: evaluate checkpoint.resume_from (a run dir: its best, else its latest checkpoint) or
    # model.init_from on the val and test splits, training nothing (eval_results.json)
    mode: RunMode = RunMode.train
    device: Device = Device.auto  # auto (cuda if available) | cpu | cuda


# group -> {option: schema}; each conf/<group>/<option>.yaml starts with `- /schema/<group>/<option>@_here_`
SCHEMAS: dict[str, dict[str, type]] = {
    "data": {o.value: c for c in (PythonStdlibData, TextFilesData, SyntheticData, TokenBinData, TokenizedTextData,
                                  PythonStdlibBPEData, HFDatasetData) for o in [c.option]},
    "strategy": {o.value: c for c in (SingleStrategy, DDPStrategy, FSDPStrategy, HSDPStrategy) for o in [c.option]},
    "precision": {o.value: c for c in (AutoPrecision, FP32Precision, BF16Precision, FP16Precision,
                                       FP8Precision) for o in [c.option]},
    "wrap_policy": {"auto": BlockWrapPolicy, "none": NamedWrapPolicy, "transformer_block": BlockWrapPolicy,
                    "size_based": SizeBasedWrapPolicy},
    "launcher": {o.value: c for c in (LocalLauncher, TorchrunLauncher, SlurmLauncher, SubmititLocalLauncher,
                                      RayLauncher) for o in [c.option]},
    "optim": {o.value: c for c in (AdamWConfig, AdamW8bitConfig) for o in [c.option]},
    "paths": {o.value: c for c in (DefaultPaths, WorkspacePaths) for o in [c.option]},
    "scheduler": {o.value: c for c in (ConstantSchedule, WarmupCosineSchedule) for o in [c.option]},
}


def register_configs() -> None:
    """Store :class:`TrainConfig` as ``train_schema`` and every option schema as ``schema/<group>/<option>`` in
    Hydra's ConfigStore (idempotent)."""
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    for group, options in SCHEMAS.items():
        for option, schema in options.items():
            cs.store(group=f"schema/{group}", name=option, node=schema)


#: the numeric keys of the groups defined here
RANGES = Ranges(positive=("distributed.failure_timeout_s", "distributed.collective_timeout_s"),
                positive_or_null=("logger.peak_flops", "plan.memory_gb", "plan.world_size", "plan.ranks_per_node"))


def check_mode(cfg: DictConfig) -> None:
    """``mode=eval`` has weights to evaluate."""
    if str(cfg.mode) == "eval" and not cfg.checkpoint.resume_from and cfg.model.get("init_from") is None:
        raise ConfigError("mode", "eval", "evaluates trained weights: give checkpoint.resume_from=<a run dir, a "
                          "checkpoints dir or a step_XXXXXXXX dir> or model.init_from=<a .safetensors file>")


def check_callback_names(cfg: DictConfig) -> None:
    """A callback of one's own does not take the name of one hydratrain adds (its nodes are checked with the
    components)."""
    if cfg.trainer.ema.decay is not None and "ema" in (cfg.get("callbacks") or {}):
        raise ConfigError("callbacks.ema._target_", cfg.callbacks.ema.get("_target_"), "callbacks.ema is the name of "
                          "trainer.ema's own callback (trainer.ema.decay is set): give yours another name")


def check_peft(cfg: DictConfig) -> None:
    """``+peft=lora``'s values, and no ``model.init_from`` beside it (its file holds the base's names; the run trains
    peft's)."""
    if cfg.get("peft") is None:
        return
    init_from = cfg.model.get("init_from") if cfg.get("model") is not None else None
    if init_from is not None:
        raise ConfigError("model.init_from", init_from, "is not read under +peft=lora: the base comes from "
                          "model.pretrained (a save_pretrained dir, as the run's export/ is)")
    for key in ("r", "alpha"):
        value = cfg.peft[key]
        if not math.isfinite(float(value)) or value <= 0:
            raise ConfigError(f"peft.{key}", value, "must be finite and > 0")
    if not 0 <= float(cfg.peft.dropout) < 1:
        raise ConfigError("peft.dropout", cfg.peft.dropout, "must be >= 0 and < 1")
