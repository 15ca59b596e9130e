"""``main(cfg)``, the composition root: check -> build (Strategy, process group, Precision, data, model, optimizer,
checkpoints) -> fit -> outputs. It only composes; each decision lives in the module that builds the piece.

``train.py`` is a thin ``@hydra.main`` wrapper around :func:`main`; tests call :func:`main` with a composed config.
The config is never written to: it is made read-only here, and values such as ``precision=auto`` resolve into new
objects (:class:`~hydratrain.parallel.precision.Precision`).
"""
from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from hydratrain import auto_batch, components, exits, timing
from hydratrain.checkpoint.layout import with_previous
from hydratrain.checkpoint.manager import CheckpointManager
from hydratrain.checkpoint.preemption import Preemption, guard
from hydratrain.checkpoint.stateful import ModelState, OptimizerState, RNGState, scheduler_state
from hydratrain.cli import check, select_value
from hydratrain.components import model_settings
from hydratrain.config.settings import DataSettings, LoraSettings
from hydratrain.data.build import build_data, data_vocabulary
from hydratrain.data.streams import EvalBatches, ShardedBatches
from hydratrain.data.tokenizer import TextTokenizer, run_tokenizer_dir
from hydratrain.dist.collectives import max_over_ranks
from hydratrain.dist.env import DistInfo, dist_info, quiet_console, under_submitit
from hydratrain.dist.launch import note_launcher, stop_if_launcher_gone
from hydratrain.dist.process_group import device_type, process_group
from hydratrain.dist.run_dir import claim, run_dir_of
from hydratrain.errors import EXIT_PREEMPTED, RESERVED_EXIT_CODES, ConfigError, DamagedCheckpointError, say
from hydratrain.flops import model_flops
from hydratrain.metrics import peak_flops, peak_memory_bytes, reset_peak_memory
from hydratrain.optim import build_optimizer, build_scheduler, optimizer_name, state_bytes, total_steps, warn_run_length
from hydratrain.parallel.build import build_model, build_strategy
from hydratrain.parallel.float8 import precompute_scales_after_each_step
from hydratrain.parallel.init import seed_training_rng
from hydratrain.parallel.precision import Precision
from hydratrain.parallel.strategy import Strategy
from hydratrain.paths import Paths, launch_dir, resolve_path
from hydratrain.plan import OutOfMemoryGuard, plan_run
from hydratrain.train import extras
from hydratrain.train.evaluate import Evaluator
from hydratrain.train.outputs import model_files, model_record, unwritable_as_output_error, write_outputs
from hydratrain.train.progress import FitResult, TrainProgress
from hydratrain.train.step_logger import StepLogger
from hydratrain.train.testing import evaluate_only, tester
from hydratrain.train.trackers import start_trackers
from hydratrain.train.trainer import Trainer

log = logging.getLogger("hydratrain")


def main(cfg: DictConfig, run_dir: Optional[Path] = None) -> FitResult:
    """Train per ``cfg`` (a composed ``TrainConfig``). Returns the ``FitResult``.

    Errors end the run with one line and their exit status (``hydratrain.errors``): a bad config prints
    ``hydratrain: config error: <key>=<value>: <why>`` and exits 2 before any process group exists. Inside a Hydra
    multirun the error is raised instead, so Hydra records the job as failed and the sweep goes on. The task never
    returns a non-finite eval loss (divergence raises). A preemption signal outside training (start-up, final
    outputs: :func:`hydratrain.checkpoint.preemption.guard`) ends the launch with ``checkpoint.preempt_exit_code``
    and Ctrl-C with :data:`~hydratrain.errors.EXIT_INTERRUPTED`, each with one line; in a multirun either ends the
    whole sweep (:mod:`hydratrain.exits`).
    """
    timing.begin()
    exits.composing(False)  # composed: Hydra's own error report again (its callbacks said so first)
    note_launcher()  # (train.py noted it first thing; kept from then)
    env = lock = None
    readonly = cfg._get_node_flag("readonly")
    exits.watch_interrupts()
    try:
        # from here to the first step a preemption signal ends the launch at once (the values are validated below)
        guard(bool(select_value(cfg, "checkpoint.save_on_sigterm", True)),
              _exit_code(select_value(cfg, "checkpoint.preempt_exit_code", None)), under_submitit())
        timing.mark("imports")
        quiet_console()
        OmegaConf.set_readonly(cfg, True)  # for the run; given back at the end, so a caller may change cfg and rerun
        env, launch = dist_info(), launch_dir()
        check(cfg, env.world_size, launch, env.local_world_size)
        run_dir = Path(run_dir) if run_dir is not None else run_dir_of()
        lock, resume = claim(cfg, run_dir, env, launch)
        strategy = build_strategy(cfg, env.world_size, device_type(str(cfg.device)))
        timing.mark("checks")
        dcfg = cfg.distributed
        with process_group(str(cfg.device), strategy.backend, strategy.needs_process_group, strategy.cpu_offload,
                           dcfg.failure_timeout_s, dcfg.collective_timeout_s) as info, OutOfMemoryGuard() as oom, \
                unwritable_as_output_error(run_dir, resume, Paths.resolve(cfg, launch).cache):
            timing.mark("device + distributed setup")
            result = _fit(cfg, strategy, info, run_dir, launch, resume, oom)
    except BaseException as err:
        exits.end(err, env)
    finally:
        exits.leave(bool(select_value(cfg, "checkpoint.save_on_sigterm", True)), lock)
        OmegaConf.set_readonly(cfg, readonly)  # a second run from Python with the same cfg works
    if result.preempted:
        exits.after_preemption(cfg.checkpoint.preempt_exit_code)
    return result


def _exit_code(value: Any) -> int:
    """``checkpoint.preempt_exit_code`` for the start-up guard, before the config check: 75 when it is not a
    usable status (the check then names it)."""
    return value if isinstance(value, int) and 0 < value < 256 and value not in RESERVED_EXIT_CODES else EXIT_PREEMPTED


@dataclass
class Job:
    """Everything one training job is made of, built by :func:`build` (tests build one to drive it directly)."""

    cfg: DictConfig  # as the job runs it (data.batch_size=auto resolved)
    info: DistInfo  # with its device
    strategy: Strategy
    precision: Precision
    model: nn.Module  # as the strategy wrapped it (DDP, FSDP, compiled)
    raw: nn.Module  # the plain model under any wrapper
    trainer: Trainer
    checkpoints: CheckpointManager
    step_logger: StepLogger
    tokenizer: Optional[TextTokenizer] = None  # of subword data, else None
    vocab_size: Optional[int] = None  # the data's vocabulary the model was built for (token data), else None
    test_batches: Optional[EvalBatches] = None  # the data's test split (every sample), or None


@dataclass(frozen=True)
class _Data:
    """The data of a job: this rank's train micro-batches, the eval and test sets, the tokenizer and vocabulary."""

    train: ShardedBatches
    eval: EvalBatches
    test: Optional[EvalBatches]
    tokenizer: Optional[TextTokenizer]
    vocab_size: Optional[int]


def build(cfg: DictConfig, strategy: Strategy, info: DistInfo, run_dir: Path, launch: Path,
          oom_guard: Optional[OutOfMemoryGuard] = None, resuming: bool = False) -> Job:
    """Resolve the precision, seed, and build data, model, optimizer, schedule, scaler, logger, checkpoint manager,
    preemption and trainer for this rank (every rank calls; collectives inside). The memory plan is made before the
    model exists and handed to ``oom_guard``, if given. ``resuming``: a checkpoint is loaded next, so the run
    length's warnings wait for its data position. ``data.batch_size=auto`` resolves here
    (:func:`hydratrain.auto_batch.resolve`): the job's ``cfg`` holds the number, its checkpoints the config as
    composed (so a relaunch of the same trial is the same trial)."""
    timing.mark("imports")
    device = _device(info)
    precision = _precision(cfg, info, device, run_dir)
    paths = Paths.resolve(cfg, launch)
    composed, (cfg, data) = cfg, _data(cfg, strategy, info, precision, paths)
    _plan_memory(cfg, strategy, info, precision, data, oom_guard)
    model, raw = _model(cfg, strategy, precision, info, device, data.vocab_size)
    # what check() built to check it (validate's check_components) is taken over here, not built again
    loss_fn = components.build_loss(cfg, device, checked=True)
    metrics = components.build_metrics(cfg, checked=True)
    optimizer, optimizer_state, scheduler, max_steps = _update(cfg, model, data.train, resuming)
    precompute_scales_after_each_step(optimizer, model, strategy.float8)  # (precision=fp8, FSDP float8 all-gather)
    scaler, progress = precision.grad_scaler(device), TrainProgress()
    step_logger = _step_logger(cfg, run_dir, info, device, precision, paths, raw, data, loss_fn, max_steps, progress,
                               resuming)
    checkpoints = CheckpointManager(
        run_dir / "checkpoints",
        components={"model": ModelState(model, trainable_only=LoraSettings.of(cfg) is not None),  # (LoRA: adapters)
                    "optim": optimizer_state, "scheduler": scheduler_state(scheduler),
                    "scaler": scaler, "progress": progress, "data": data.train},
        rank_components={"rng": RNGState(device), "step_logger": step_logger},
        config=OmegaConf.to_container(composed, resolve=True, enum_to_str=True),  # type: ignore[arg-type]  # (a dict)
        keep_last=cfg.checkpoint.keep_last, device=device,
        attachments=model_files(cfg, data.vocab_size, data.tokenizer,
                                run_tokenizer_dir(cfg, paths.data, paths.launch)),
        async_save=cfg.checkpoint.async_save)
    callbacks = extras.build_callbacks(cfg, checkpoints, device, scheduler, model=raw, vocab_size=data.vocab_size)
    if callbacks:  # (their states ride in the checkpoints; a run without callbacks saves none)
        checkpoints.components["callbacks"] = callbacks
    preemption = Preemption(cfg.checkpoint.save_on_sigterm, cfg.checkpoint.preempt_exit_code, under_submitit())
    trainer = Trainer(tcfg=cfg.trainer, model=model, strategy=strategy, precision=precision, device=device,
                      optimizer=optimizer, scheduler=scheduler, scaler=scaler, train_batches=data.train,
                      evaluator=Evaluator(data.eval, device, loss_fn, metrics), step_logger=step_logger,
                      checkpoints=checkpoints, preemption=preemption,
                      progress=progress, max_steps=max_steps, save_every=cfg.checkpoint.every_n_steps,
                      save_last=cfg.checkpoint.save_last, loss_fn=loss_fn,
                      contract=(cfg.model.get("_target_"), cfg.loss.get("_target_")), callbacks=callbacks)
    extras.bind(callbacks, trainer, raw, info, run_dir)
    timing.mark("logger, checkpoints, trainer")
    return Job(cfg, info, strategy, precision, model, raw, trainer, checkpoints, step_logger, data.tokenizer,
               data.vocab_size, data.test)


def _device(info: DistInfo) -> torch.device:
    """The device :func:`hydratrain.dist.process_group.process_group` chose for this rank."""
    if info.device is None:
        raise ValueError("no device in DistInfo: a job is built inside hydratrain.dist.process_group, which sets it")
    return info.device


def _precision(cfg: DictConfig, info: DistInfo, device: torch.device, run_dir: Path) -> Precision:
    """The run's :class:`Precision` (its backend flags set), after the job's first log line; the global RNGs seeded
    (python's and numpy's too, so every RNG state a checkpoint holds is reproducible) and the peak memory counter
    reset (this job's peak only, not start-up's or an earlier job's of the same process)."""
    precision = Precision.resolve(cfg.precision, device)
    precision.apply_backend_flags()
    log.info("run dir %s; rank %d of %d on %s; torch %s; %s", run_dir, info.rank, info.world_size, device,
             torch.__version__, precision.describe())
    torch.manual_seed(cfg.trainer.seed)
    random.seed(cfg.trainer.seed)
    np.random.seed(cfg.trainer.seed % 2**32)
    reset_peak_memory(device)
    return precision


def _data(cfg: DictConfig, strategy: Strategy, info: DistInfo, precision: Precision,
          paths: Paths) -> tuple[DictConfig, _Data]:
    """The job's config with ``data.batch_size=auto`` resolved, and its :class:`_Data`."""
    tokenizer, vocab_size = data_vocabulary(cfg, info, paths.data, cfg.trainer.progress_bar, cache_dir=paths.cache)
    cfg = auto_batch.resolve(cfg, strategy, info, precision, vocab_size)
    train, eval_, test = build_data(cfg, info, paths.data, cfg.trainer.progress_bar, vocab_size,
                                    cache_dir=paths.cache, with_test=True)
    if cfg.trainer.test_after_fit and test is None and str(cfg.mode) != "eval":  # (known now, not after training)
        raise ConfigError("trainer.test_after_fit", True, "the data has no test split (a data function returns "
                          "{'train', 'val', 'test'}: docs/research-loop.md#a-test-split); or set it to false")
    timing.mark("data")
    return cfg, _Data(train, eval_, test, tokenizer, vocab_size)


def _plan_memory(cfg: DictConfig, strategy: Strategy, info: DistInfo, precision: Precision, data: _Data,
                 oom_guard: Optional[OutOfMemoryGuard]) -> None:
    """The memory plan, before the model (nothing allocated yet; a model the planner simulates runs on the data's
    example shapes), handed to ``oom_guard``."""
    memory_plan = plan_run(cfg, strategy, info, precision, data.vocab_size, example=data.train.example)
    if oom_guard is not None:
        oom_guard.run_plan = memory_plan
    timing.mark("memory plan")


def _model(cfg: DictConfig, strategy: Strategy, precision: Precision, info: DistInfo, device: torch.device,
           vocab_size: Optional[int]) -> tuple[nn.Module, nn.Module]:
    """(the model to train, the plain module under any wrapper), seeded per rank for training after its build.
    Raises :class:`ConfigError` when every parameter is frozen."""
    model, raw, n_params, summary = build_model(cfg, strategy, precision, device, vocab_size)
    timing.mark("model")
    seed_training_rng(cfg.trainer.seed, info.rank)
    log.info("model %s: %s, this rank holds %.2f MB of them; %s", components.model_name(cfg), n_params,
             strategy.local_param_bytes(model) / 1e6, summary)
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError("model._target_", str(select_value(cfg, "model._target_", "")), "every parameter of the "
                          "model is frozen (requires_grad=False), so there is nothing to train: leave the ones to "
                          "train trainable")
    return model, raw


def _update(cfg: DictConfig, model: nn.Module, train: ShardedBatches,
            resuming: bool) -> tuple[torch.optim.Optimizer, OptimizerState, LRScheduler, int]:
    """(the optimizer, its Stateful, its lr schedule, the optimizer steps the run takes). Raises
    :class:`ConfigError` when ``trainer.max_epochs`` gives no step. The run length's warnings wait for a resume's
    data position."""
    optimizer = build_optimizer(model, cfg.optim)
    optimizer_state = OptimizerState(model, optimizer)  # the configured hyper-parameters, before the scheduler
    timing.mark("optimizer")
    max_steps = total_steps(cfg.trainer, train)
    if max_steps == 0:
        raise ConfigError("trainer.max_epochs", cfg.trainer.max_epochs,
                          f"gives 0 optimizer steps: an epoch has {train.batches_per_epoch} micro-batches per "
                          f"rank, fewer than trainer.grad_accum_steps={cfg.trainer.grad_accum_steps}")
    if not resuming:  # else from the restored data position, after the load (_restore)
        warn_run_length(cfg.trainer, cfg.scheduler, train, max_steps)
    return optimizer, optimizer_state, build_scheduler(optimizer, cfg.scheduler, max_steps), max_steps


def _step_logger(cfg: DictConfig, run_dir: Path, info: DistInfo, device: torch.device, precision: Precision,
                 paths: Paths, raw: nn.Module, data: _Data, loss_fn: Callable, max_steps: int,
                 progress: TrainProgress, resuming: bool) -> StepLogger:
    """The :class:`StepLogger`, with what tokens/s and MFU count: items per optimizer step (tokens of token data,
    else samples), model FLOPs per item, the peak FLOP/s of all ranks; and the trackers it feeds (rank 0's MLflow /
    W&B / CSV: one that fails to start is a ConfigError naming it, before training)."""
    settings = DataSettings.of(cfg.data)  # (batch_size resolved by auto_batch)
    seq_len = settings.seq_len  # token data; a dataset's samples are counted as samples
    per_sample = seq_len or 1
    items_per_step = cfg.trainer.grad_accum_steps * int(settings.batch_size) * per_sample * info.world_size
    timing.mark("optimizer")
    slow = precision.slow_path(device, cache_dir=paths.cache)
    if slow:
        log.warning(slow)
    peak = peak_flops(device, precision.compute_dtype, cfg.logger.peak_flops, tf32=precision.tf32,
                      cache_dir=paths.cache, local_world_size=info.local_world_size)
    timing.mark("peak FLOP/s")
    flops_per_item = model_flops(cfg, raw, data.train, loss_fn, data.vocab_size, seq_len)
    components.forget_checked()  # (a checked meta model no build took: the run trains one built with storage)
    timing.mark("model FLOPs")
    trackers = start_trackers(cfg, run_dir, paths.output, resuming) if info.is_main else []
    return StepLogger(run_dir, device, items_per_step, flops_per_item, peak * info.world_size,
                      cfg.trainer.log_every_n_steps, max_steps, info.is_main, cfg.logger.tensorboard,
                      cfg.trainer.progress_bar, progress=progress, unit="tokens" if seq_len else "samples",
                      tokens_per_sample=per_sample, trackers=trackers)


def _fit(cfg: DictConfig, strategy: Strategy, info: DistInfo, run_dir: Path, launch: Path, resume: Optional[Path],
         oom_guard: Optional[OutOfMemoryGuard] = None) -> FitResult:
    """Build the job, start it from ``resume`` or ``model.init_from``, fit (``mode=eval``: evaluate only), then
    write the outputs."""
    evaluating = str(cfg.mode) == "eval"  # (mode=eval: no run-length or resume warnings, nothing trained)
    device = _device(info)
    job = build(cfg, strategy, info, run_dir, launch, oom_guard, resuming=resume is not None or evaluating)
    init_from = model_settings(cfg).init_from
    if info.world_size > 1:  # (one rank has no other to compare with)
        from hydratrain.checkpoint.io import check_same_resume  # (start-up: torch.distributed.checkpoint, ~0.3 s)

        check_same_resume(resume)
    if resume is not None:
        _restore(job, resume, run_dir, evaluating)
        if init_from:
            log.info("model.init_from=%s not used: resuming from %s", init_from, resume)
    elif init_from:
        from hydratrain.checkpoint.io import init_from_file  # (start-up: torch.distributed.checkpoint, ~0.3 s)

        init_from_file(job.model, resolve_path(init_from, Paths.resolve(cfg, launch).model),
                       model_record(cfg, job.vocab_size))
    step = job.trainer.progress.step
    if evaluating:  # nothing trained, nothing moved aside
        return evaluate_only(job, run_dir, resume or (Path(init_from) if init_from else None), step, info)
    job.checkpoints.supersede_after(step)
    timing.mark("resume / init_from")
    try:
        return _train(cfg, job, strategy, info, run_dir, device, oom_guard)
    except BaseException as err:  # the trackers' runs end as failed (killed: an exit or Ctrl-C), not as running
        job.step_logger.trackers.close("failed" if isinstance(err, Exception) else "killed")
        raise


def _train(cfg: DictConfig, job: Job, strategy: Strategy, info: DistInfo, run_dir: Path, device: torch.device,
           oom_guard: Optional[OutOfMemoryGuard]) -> FitResult:
    """Fit, then write the outputs of a run that was not preempted."""
    result = job.trainer.fit()
    if not result.preempted:  # the final evaluation and outputs: a preemption signal now ends the launch at once
        guard(cfg.checkpoint.save_on_sigterm, cfg.checkpoint.preempt_exit_code, job.trainer.preemption.under_submitit,
              phase="final")
    log.info("optimizer state: %.3f MB on this rank (optim=%s)", state_bytes(job.trainer.optimizer) / 1e6,
             optimizer_name(cfg.optim))
    result.peak_memory_bytes = int(max_over_ranks(peak_memory_bytes(device), device))
    planned = oom_guard.run_plan if oom_guard is not None else None
    result.planned_peak_memory_bytes = int(max_over_ranks(planned.plan.peak if planned else 0, device))
    if result.preempted:
        job.step_logger.trackers.close("killed")  # (preempted: a later launch resumes the runs)
        return result
    stop_if_launcher_gone("before writing the run's outputs")
    write_outputs(job.cfg, result, model=job.model, raw=job.raw, strategy=strategy, precision=job.precision, info=info,
                  run_dir=run_dir, trackers=job.step_logger.trackers, tokenizer=job.tokenizer,
                  vocab_size=job.vocab_size, test=tester(job, run_dir),
                  tokenizer_json=job.checkpoints.attachments.get("tokenizer.json"))
    return result


def _restore(job: Job, resume: Path, run_dir: Path, evaluating: bool) -> None:
    """Load ``resume`` into the job and keep ``trainer.max_epochs`` from its data position; when training, say what
    the resume changes: the lr, nothing left to train, the run length."""
    trainer = job.trainer
    try:
        # (mode=eval: the weights, the step and the callbacks' states such as the EMA's; no optimizer state or data
        # position, which it would allocate or remap for nothing)
        job.checkpoints.load(resume, compare_config=not evaluating,
                             skip=("optim", "scheduler", "scaler", "data") if evaluating else ())
    except DamagedCheckpointError as err:  # found while reading (corrupt bytes), not by find_resume's checks
        raise with_previous(err, resume) if resume.parent == run_dir / "checkpoints" else err from None
    step = trainer.progress.step
    trainer.keep_the_epoch_limit()
    if evaluating:
        return
    stopped = trainer.callbacks.resumed_stop
    if stopped and resume.parent == run_dir / "checkpoints":  # a relaunch of a run that stopped (a requeue): done
        log.warning("resumed at step %d, where this run stopped (%s): nothing to train, evaluating only; to train "
                    "on, resume its checkpoint into a new run dir: checkpoint.resume_from=%s", step, stopped, resume)
        trainer.max_steps = trainer.logger.max_steps = step
        trainer.callbacks.stopped = stopped
        return
    if stopped:
        log.info("%s was saved by a run that stopped (%s): training on from it, as checkpoint.resume_from asks",
                 resume, stopped)
    lr_change = job.checkpoints.components["scheduler"].lr_change(step)
    if lr_change and step < trainer.max_steps:
        log.warning(lr_change)
    if step >= trainer.max_steps:
        log.warning("resumed at step %d, which is already at or past the %d steps this config trains "
                    "(trainer.max_steps / max_epochs): nothing to train, evaluating only", step, trainer.max_steps)
    else:
        warn_run_length(job.cfg.trainer, job.cfg.scheduler, trainer.train_batches, trainer.max_steps, done=step)


if __name__ == "__main__":  # `python -m hydratrain.run` says where to start instead of exiting 0 silently
    say("hydratrain: hydratrain.run is the library's entry (main(cfg)); train with python train.py [OVERRIDES] (or "
        "torchrun ... train.py) from the clone, whose conf/ holds the run config")
    raise SystemExit(2)
