"""The run's callbacks, built from the config: the EMA of the weights first (``trainer.ema.decay``:
:mod:`~hydratrain.train.ema`; its ``eval_ema/*`` values join the metrics every later callback gets), then the user's
``callbacks`` nodes, in order, then hydratrain's own extras that the config turns on (``checkpoint.monitor``:
:mod:`~hydratrain.train.best_checkpoints`; ``trainer.early_stopping.monitor``: :mod:`~hydratrain.train.early_stopping`;
``trainer.profile.steps``: :mod:`~hydratrain.train.profiler`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf import DictConfig

from hydratrain import components
from hydratrain.checkpoint.manager import CheckpointManager
from hydratrain.config.settings import node_dict
from hydratrain.optim import steps_per_evaluation
from hydratrain.train.best_checkpoints import BestCheckpoints
from hydratrain.train.callbacks import Callback, Callbacks, RunView
from hydratrain.train.early_stopping import EarlyStopping
from hydratrain.train.ema import EMA
from hydratrain.train.outputs import model_config_json
from hydratrain.train.profiler import StepProfiler


def user_callbacks(cfg: DictConfig) -> dict[str, Any]:
    """``{name: callback}`` of the ``callbacks`` nodes, built in order. Raises :class:`ConfigError` naming
    ``callbacks.<name>._target_``."""
    built = {}
    for name, node in (cfg.get("callbacks") or {}).items():
        key = f"callbacks.{name}"
        target = components.target_of(node, key)
        components.importable()
        plain = node_dict(node)
        built[str(name)] = components.instantiate_node(plain, f"{key}._target_", target, "raised")
    return built


class PlateauStep(Callback):
    """Steps a ``ReduceLROnPlateau`` (``scheduler._target_``) after each evaluation during training with the
    monitored metric's value (``checkpoint.monitor``, else ``trainer.objective``); its state is the scheduler's,
    checkpointed with it."""

    def __init__(self, scheduler: Any, monitor: str):
        self.scheduler, self.monitor = scheduler, monitor

    def on_eval_end(self, run: RunView, step: int, metrics: dict) -> None:
        if step < run.max_steps and self.monitor in metrics:
            self.scheduler.step(metrics[self.monitor])


def build_callbacks(cfg: DictConfig, checkpoints: CheckpointManager, device: torch.device, scheduler: Any = None,
                    model: Optional[torch.nn.Module] = None, vocab_size: Optional[int] = None) -> Callbacks:
    """Every callback of the run (not yet bound to the run: :func:`bind`), in the order they are called: the EMA
    first (its ``eval_ema/*`` values join the metrics the later ones get), the user's, then hydratrain's own.
    ``model``: the model as the strategy built it, without a DDP wrapper (the EMA's; needed when
    ``trainer.ema.decay`` is set); ``vocab_size``: the data's vocabulary the model was built for (the EMA weights
    file's header)."""
    built: dict[str, Any] = {}
    ema = cfg.trainer.ema
    if ema.decay is not None:
        if model is None:
            raise ValueError("trainer.ema.decay is set: build_callbacks needs the model")
        built["ema"] = EMA(model, ema.decay, ema.warmup_steps, bool(cfg.trainer.save_weights),
                           {"model_config": model_config_json(cfg, vocab_size)})
    built.update(user_callbacks(cfg))
    if scheduler is not None and steps_per_evaluation(scheduler):
        built["lr_on_plateau"] = PlateauStep(scheduler, cfg.checkpoint.monitor or cfg.trainer.objective)
    ccfg, stop = cfg.checkpoint, cfg.trainer.early_stopping
    if ccfg.monitor is not None:
        built["best_checkpoints"] = BestCheckpoints(checkpoints, ccfg.monitor, str(ccfg.mode), ccfg.save_top_k,
                                                    cfg.trainer.objective, str(cfg.trainer.objective_at) == "best")
    if stop.monitor is not None:
        built["early_stopping"] = EarlyStopping(stop.monitor, str(stop.mode), stop.patience, stop.min_delta)
    if cfg.trainer.profile.steps is not None:
        first, last = cfg.trainer.profile.steps
        built["profiler"] = StepProfiler(first, last, device)
    return Callbacks(built, device)


def bind(callbacks: Callbacks, trainer: Any, raw: torch.nn.Module, info: Any, run_dir: Path) -> None:
    """Give the callbacks their view of the run (:class:`~hydratrain.train.callbacks.RunView`)."""
    callbacks.bind(RunView(rank=info.rank, world_size=info.world_size, run_dir=Path(run_dir), model=trainer.model,
                           raw_model=raw, _max_steps=lambda: trainer.max_steps, _step=lambda: trainer.progress.step,
                           _stop=callbacks.request_stop, _checkpoint=callbacks.request_checkpoint,
                           _evaluate=trainer.evaluate,
                           _log_scalars=lambda values, step: trainer.logger.trackers.scalars(values, step)))
