"""The ``checkpoint`` group: saving and resuming (:mod:`hydratrain.checkpoint`), the best checkpoints kept by a
metric, and the checks of their values. No torch import."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from omegaconf import DictConfig

from hydratrain.config.trainer import MonitorMode
from hydratrain.config.values import Ranges
from hydratrain.errors import RESERVED_EXIT_CODES, ConfigError


@dataclass
class CheckpointConfig:
    """Sharded checkpoints under ``<run dir>/checkpoints`` and resuming (see ``hydratrain.checkpoint``)."""

    every_n_steps: int = 100  # save every N optimizer steps; 0 = none (only save_last and SIGTERM saves)
    keep_last: int = 2  # complete checkpoints kept in the run dir (older ones deleted); 0 = keep all
    save_last: bool = False  # also save when training ends (true: a finished run can be extended or exported)
    # stage each save in host memory (pinned on CUDA) and write it in the background while training goes on; a save
    # counts (resume, keep_last, save_top_k) once every rank's write finished; the next save and the end wait for it
    async_save: bool = False
    auto_resume: bool = True  # start from the latest complete checkpoint in this run dir, if there is one
    resume_from: Optional[str] = None  # a step_XXXXXXXX dir, or a checkpoints/run dir (its latest); used when the
    #                                    run dir has no checkpoint of its own; relative to the launch dir
    restore_data_position: bool = True  # false: start the saved epoch over from its first sample
    save_on_sigterm: bool = True  # on SIGTERM (SIGUSR2 under submitit): save, exit with preempt_exit_code
    preempt_exit_code: int = 75  # exit status after a SIGTERM save (EX_TEMPFAIL: relaunch to resume)
    # keep the save_top_k best checkpoints by this metric (eval/loss, eval/<metric>, eval_ema/* with trainer.ema)
    # beside the keep_last latest, and write the best weights as best/model.safetensors; null = by step only
    monitor: Optional[str] = None
    mode: MonitorMode = MonitorMode.min  # min: lower is better; max: higher is better
    save_top_k: int = 1  # best checkpoints kept (with checkpoint.monitor); each evaluation that enters them saves one


RANGES = Ranges(non_negative=("checkpoint.every_n_steps", "checkpoint.keep_last"))


def check_preempt_exit_code(cfg: DictConfig) -> None:
    code = cfg.checkpoint.preempt_exit_code
    if not 0 < code < 126 or code in RESERVED_EXIT_CODES:
        raise ConfigError("checkpoint.preempt_exit_code", code, f"must be in {max(RESERVED_EXIT_CODES) + 1}..125 "
                          f"({', '.join(map(str, RESERVED_EXIT_CODES))} are hydratrain's own exit statuses, 126+ "
                          "the shell's)")


def check_save_top_k(cfg: DictConfig) -> None:
    if cfg.checkpoint.save_top_k < 1:
        raise ConfigError("checkpoint.save_top_k", cfg.checkpoint.save_top_k, "must be >= 1 (checkpoint.monitor=null "
                          "keeps no best checkpoints)")
