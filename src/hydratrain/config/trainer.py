"""The ``trainer`` group: the loop's keys (:mod:`hydratrain.train.trainer`), early stopping and the EMA of the
weights, and the checks of their values (against ``checkpoint.monitor`` too; whether a monitored metric is logged
needs the loss and the metrics, checked with the components in :mod:`hydratrain.config.validate`); whether a run
samples text (:func:`language_model`) and which of its keys a run will not use (:func:`unused_keys`). No torch
import."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, List, Optional

from omegaconf import DictConfig, OmegaConf

from hydratrain.config.values import Option, Ranges, compile_setting, has_target
from hydratrain.errors import ConfigError


class NonFinitePolicy(Option):
    stop = "stop"
    skip = "skip"


class MonitorMode(Option):
    min = "min"
    max = "max"


class ObjectiveAt(Option):
    last = "last"
    best = "best"


@dataclass
class EarlyStoppingConfig:
    """Stop when a metric stops improving (``hydratrain.train.early_stopping``); off while ``monitor`` is null."""

    monitor: Optional[str] = None  # eval/loss, eval/<metric>, eval_ema/* (with trainer.ema); null = no early stopping
    mode: MonitorMode = MonitorMode.min  # min: lower is better; max: higher is better
    patience: int = 3  # evaluations in a row without an improvement before the run stops
    min_delta: float = 0.0  # an improvement must beat the best value by more than this


@dataclass
class EMAConfig:
    """An exponential moving average of the trainable weights (``hydratrain.train.ema``); off while ``decay`` is
    null."""

    # in (0, 1), e.g. 0.999: evaluated as eval_ema/* beside eval/*, written as model_ema.safetensors; null = no EMA
    decay: Optional[float] = None
    warmup_steps: int = 0  # the decay ramps linearly from 0 to `decay` over these steps (0: `decay` from step 1)


@dataclass
class ProfileConfig:
    """A ``torch.profiler`` trace of a window of steps on every rank (``hydratrain.train.profiler``); off while
    ``steps`` is null."""

    # [first, last] optimizer steps traced, e.g. [10, 12]: <run dir>/profile/rank{N}.pt.trace.json; null = none
    steps: Optional[List[int]] = None


@dataclass
class TrainerConfig:
    max_steps: Optional[int] = 300  # optimizer steps; null = until max_epochs
    max_epochs: Optional[int] = None  # passes over the train split; null = until max_steps
    grad_accum_steps: int = 1  # micro-batches per optimizer step
    grad_clip: float = 1.0  # max global grad norm; 0 = no clipping (the norm is still logged)
    eval_every_n_steps: int = 100  # 0 = only at the end
    eval_samples: int = 256  # val samples per eval, the same set whatever the world size and batch; 0 = all
    log_every_n_steps: int = 10  # a log line and the train/* and perf/* scalars (also at step 1 and the last step)
    seed: int = 1234  # model init (every rank alike), data order (per epoch), dropout (per rank); eval order: seed 0
    # torch.compile: auto (on CUDA: the whole model, or per block under fsdp/hsdp and ddp with activation
    # checkpointing; elsewhere none) | true (the same on any device) | false | model | blocks
    compile: Any = "auto"
    progress_bar: bool = True  # rank-0 tqdm bar
    sample_tokens: int = 120  # tokens generated at the end (text for byte corpora, ids otherwise); 0 = none
    save_weights: bool = True  # write the full model as model.safetensors in the run dir at the end
    on_nonfinite: NonFinitePolicy = NonFinitePolicy.stop  # non-finite loss/grad norm (outside fp16): stop | skip
    max_consecutive_nonfinite: int = 20  # skip (and fp16's scaler): stop after this many skipped steps in a row
    # what the run returns to a sweeper (Optuna minimises or maximises it): eval/loss, eval/perplexity (token data)
    # or eval/<name> of a metric in `metrics` (eval_ema/* of these with trainer.ema); the final evaluation's value
    objective: str = "eval/loss"
    # which evaluation's value of `objective` results.json and a sweeper get: last (the final evaluation) | best (the
    # evaluation that was best by checkpoint.monitor and checkpoint.mode; monitor null = objective itself)
    objective_at: ObjectiveAt = ObjectiveAt.last
    early_stopping: EarlyStoppingConfig = field(default_factory=EarlyStoppingConfig)
    test_after_fit: bool = False  # evaluate the data's test split with the best (else the last) weights at the end
    ema: EMAConfig = field(default_factory=EMAConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)


RANGES = Ranges(positive=("trainer.grad_accum_steps", "trainer.log_every_n_steps", "trainer.max_consecutive_nonfinite"),
                non_negative=("trainer.grad_clip", "trainer.eval_every_n_steps", "trainer.eval_samples",
                              "trainer.sample_tokens"),
                positive_or_null=("trainer.max_steps", "trainer.max_epochs"))


#: the loss of a language model (conf/loss/next_token.yaml), named as its node names it: config imports no loss
NEXT_TOKEN_LOSS = "hydratrain.losses.NextTokenLoss"


def language_model(cfg: DictConfig) -> bool:
    """Whether the run trains a language model on token data (a built-in corpus and the next-token loss, which
    reports perplexity): only then is there a text sample to generate (``trainer.sample_tokens``,
    :func:`hydratrain.train.outputs.write_outputs`)."""
    return not has_target(cfg.data) and OmegaConf.select(cfg, "loss._target_") == NEXT_TOKEN_LOSS


def unused_keys(cfg: DictConfig) -> list[str]:
    """The keys of ``cfg`` that a run of it will not use, each as ``key (what it is for: when it is used)``, which
    ``--cfg job`` prints after the config (:mod:`hydratrain.cli`). A key is listed only when its value asks for
    something the run will not do: ``trainer.sample_tokens`` > 0 without :func:`language_model` (0 asks for no
    sample, so no run uses it either way)."""
    unused = []
    if cfg.trainer.sample_tokens and not language_model(cfg):
        unused.append("trainer.sample_tokens (a sample of generated tokens: token data with loss=next_token only)")
    return unused


def check_compile(cfg: DictConfig) -> None:
    compile_setting(cfg.trainer.compile)


def check_run_length(cfg: DictConfig) -> None:
    if cfg.trainer.max_steps is None and cfg.trainer.max_epochs is None:
        raise ConfigError("trainer.max_steps", None, "set trainer.max_steps and/or trainer.max_epochs")


def check_objective_at(cfg: DictConfig) -> None:
    if str(cfg.trainer.objective_at) == "best" and cfg.checkpoint.monitor is None:
        raise ConfigError("trainer.objective_at", "best", "needs checkpoint.monitor (and checkpoint.mode) to tell "
                          "which evaluation is best; allowed without it: last")


def check_ema(cfg: DictConfig) -> None:
    ema = cfg.trainer.ema
    if ema.decay is not None and not (math.isfinite(ema.decay) and 0 < ema.decay < 1):
        raise ConfigError("trainer.ema.decay", ema.decay, "must be in (0, 1), e.g. 0.999 (null: no EMA)")
    if ema.warmup_steps < 0:
        raise ConfigError("trainer.ema.warmup_steps", ema.warmup_steps, "must be >= 0 (steps)")


def check_early_stopping(cfg: DictConfig) -> None:
    stop = cfg.trainer.early_stopping
    if stop.patience < 1:
        raise ConfigError("trainer.early_stopping.patience", stop.patience, "must be >= 1 (evaluations)")
    if not math.isfinite(stop.min_delta) or stop.min_delta < 0:
        raise ConfigError("trainer.early_stopping.min_delta", stop.min_delta, "must be finite and >= 0")
    if stop.monitor is not None and not cfg.trainer.eval_every_n_steps:
        raise ConfigError("trainer.early_stopping.monitor", stop.monitor, "needs evaluations during training: set "
                          "trainer.eval_every_n_steps > 0")


def check_profile(cfg: DictConfig) -> None:
    """``trainer.profile.steps``: two steps ``[first, last]``, ``1 <= first <= last <= trainer.max_steps``
    (:mod:`hydratrain.train.profiler`), and no callback of one's own under the profiler's name."""
    steps = cfg.trainer.profile.steps
    if steps is None:
        return
    steps, max_steps = list(steps), cfg.trainer.max_steps
    if len(steps) != 2 or not 1 <= steps[0] <= steps[1] or (max_steps is not None and steps[1] > max_steps):
        raise ConfigError("trainer.profile.steps", steps, "must be [first, last] optimizer steps with 1 <= first <= "
                          f"last <= trainer.max_steps={max_steps}, e.g. [10, 12] (null: no trace)")
    if "profiler" in (cfg.get("callbacks") or {}):
        raise ConfigError("callbacks.profiler._target_", cfg.callbacks.profiler.get("_target_"), "callbacks.profiler "
                          "is the name of trainer.profile's own callback (trainer.profile.steps is set): give yours "
                          "another name")
