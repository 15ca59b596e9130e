"""The ``scheduler`` group: the built-in learning-rate schedules' schemas (:mod:`hydratrain.optim` builds them)
and the checks of their values. A schedule of one's own (``_target_``) is checked against its class in
:mod:`hydratrain.config.validate`. No torch import."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from omegaconf import MISSING, DictConfig

from hydratrain.config.values import Option, Ranges, select
from hydratrain.errors import ConfigError


class SchedulerName(Option):
    warmup_cosine = "warmup_cosine"
    constant = "constant"


@dataclass
class SchedulerConfig:
    option: ClassVar[Optional[SchedulerName]] = None
    name: SchedulerName = MISSING
    warmup_steps: int = 0  # linear warm-up from optim.lr / warmup_steps (step 1) to optim.lr, optimizer steps


@dataclass
class ConstantSchedule(SchedulerConfig):
    option: ClassVar[SchedulerName] = SchedulerName.constant
    name: SchedulerName = SchedulerName.constant


@dataclass
class WarmupCosineSchedule(SchedulerConfig):
    option: ClassVar[SchedulerName] = SchedulerName.warmup_cosine
    name: SchedulerName = SchedulerName.warmup_cosine
    min_lr_ratio: float = 0.1  # final lr = min_lr_ratio * optim.lr


RANGES = Ranges(non_negative=("scheduler.warmup_steps",))


def check(cfg: DictConfig) -> None:
    ratio = select(cfg, "scheduler.min_lr_ratio")
    if ratio is not None and not 0.0 <= ratio <= 1.0:
        raise ConfigError("scheduler.min_lr_ratio", ratio, "must be in [0, 1]")
