"""The ``strategy`` group: one schema per option (:mod:`hydratrain.parallel.strategy` acts on them) and the checks
of its values, against the launcher's rank count too. No torch import."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Optional

from omegaconf import MISSING, DictConfig

from hydratrain.config.launcher import launched_processes
from hydratrain.config.values import Option, Ranges, present, select, shard_on_one_rank_setting
from hydratrain.errors import ConfigError


class StrategyName(Option):
    single = "single"
    ddp = "ddp"
    fsdp = "fsdp"
    hsdp = "hsdp"


class Backend(Option):
    gloo = "gloo"
    nccl = "nccl"


@dataclass
class StrategyConfig:
    option: ClassVar[Optional[StrategyName]] = None
    name: StrategyName = MISSING


@dataclass
class SingleStrategy(StrategyConfig):
    """One process, no process group."""

    option: ClassVar[StrategyName] = StrategyName.single
    name: StrategyName = StrategyName.single


@dataclass
class DDPStrategy(StrategyConfig):
    """``torch.nn.parallel.DistributedDataParallel``: a full replica per rank, gradients all-reduced."""

    option: ClassVar[StrategyName] = StrategyName.ddp
    name: StrategyName = StrategyName.ddp
    backend: Optional[Backend] = None  # process-group backend; null = nccl on CUDA, gloo on CPU
    bucket_cap_mb: int = 25  # gradient all-reduce bucket size, MiB
    find_unused_parameters: bool = False


@dataclass
class FSDPStrategy(StrategyConfig):
    """FSDP2 ``fully_shard``: per-parameter sharding over a 1-D device mesh."""

    option: ClassVar[StrategyName] = StrategyName.fsdp
    name: StrategyName = StrategyName.fsdp
    backend: Optional[Backend] = None  # null = nccl on CUDA (plus gloo for CPU tensors with cpu_offload), gloo on CPU
    reshard_after_forward: bool = True  # free gathered params after forward (ZeRO-3) or keep them (ZeRO-2)
    cpu_offload: bool = False  # keep sharded params, grads and optimizer state in CPU memory
    # at world size 1 FSDP shards nothing: auto (train as strategy=single on a GPU, where FSDP's per-unit work
    # costs at small batches; keep FSDP on a CPU and with cpu_offload) | true (always FSDP) | false (always single)
    shard_on_one_rank: Any = "auto"


@dataclass
class HSDPStrategy(FSDPStrategy):
    """FSDP2 ``fully_shard`` over a 2-D device mesh (replicate x shard): parameters sharded within groups of
    ``shard_size`` ranks (reduce-scatter inside a group) and replicated across the groups (all-reduce between them)."""

    option: ClassVar[StrategyName] = StrategyName.hsdp
    name: StrategyName = StrategyName.hsdp
    shard_size: Optional[int] = None  # ranks per shard group; must divide the world size; null = ranks per node


#: the strategies that shard parameters (by a wrap policy, over a device mesh)
SHARDED = (StrategyName.fsdp, StrategyName.hsdp)
RANGES = Ranges(positive=("strategy.bucket_cap_mb",))


def check_shard_on_one_rank(cfg: DictConfig) -> None:
    if present(cfg, "strategy.shard_on_one_rank"):
        shard_on_one_rank_setting(cfg.strategy.shard_on_one_rank)


def check_shard_size(cfg: DictConfig) -> None:
    shard_size = select(cfg, "strategy.shard_size")
    if shard_size is not None and shard_size < 1:
        raise ConfigError("strategy.shard_size", shard_size, "must be >= 1 (ranks per shard group), or null for "
                          "the ranks per node")


def check_launched(cfg: DictConfig) -> None:
    """The strategy against the ranks the launcher starts (those of a launch of one's own: ``check_environment``)."""
    shard_size, launched = select(cfg, "strategy.shard_size"), launched_processes(cfg.launcher)
    if shard_size is not None and launched > 1 and launched % shard_size:
        raise ConfigError("strategy.shard_size", shard_size, f"must divide the {launched} ranks launcher="
                          f"{cfg.launcher.name} starts; allowed: "
                          f"{', '.join(str(d) for d in range(1, launched + 1) if launched % d == 0)}")
    if cfg.strategy.name == StrategyName.single and launched > 1:
        raise ConfigError("strategy.name", "single", f"runs one process but launcher={cfg.launcher.name} starts "
                          f"{launched}; allowed: ddp, fsdp, hsdp")
