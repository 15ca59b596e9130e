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
from typing import Any, Optional

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from hydratrain import auto_batch, components, exits, timing
from hydratrain.checkpoint.layout import (
    find_resume,
    recover_unfinished_saves,
    with_previous,
)
from hydratrain.checkpoint.manager import CheckpointManager
from hydratrain.checkpoint.preemption import Preemption, guard
from hydratrain.checkpoint.stateful import ModelState, OptimizerState, RNGState, SchedulerState, scheduler_state
from hydratrain.cli import check, select_value
from hydratrain.components import model_settings
from hydratrain.config.settings import DataSettings, LoraSettings
from hydratrain.data.build import build_data, data_vocabulary
from hydratrain.data.tokenizer import TextTokenizer
from hydratrain.dist.collectives import max_over_ranks
from hydratrain.dist.env import DistInfo, dist_info, quiet_console, under_submitit
from hydratrain.dist.launch import note_launcher, resume_command, stop_if_launcher_gone
from hydratrain.dist.process_group import device_type, process_group
from hydratrain.dist.run_dir import (
    refuse_a_path_that_is_not_utf8,
    refuse_another_jobs_dir,
    refuse_another_trial,
    run_dir_key,
    run_dir_of,
    trial_record,
)
from hydratrain.dist.run_lock import hold_run_dir, shared_config
from hydratrain.errors import (
    EXIT_PREEMPTED,
    RESERVED_EXIT_CODES,
    ConfigError,
    DamagedCheckpointError,
    say,
)
from hydratrain.exits import in_multirun
from hydratrain.flops import model_flops
from hydratrain.metrics import peak_flops, peak_memory_bytes, reset_peak_memory
from hydratrain.optim import build_optimizer, build_scheduler, optimizer_name, state_bytes, total_steps, warn_run_length
from hydratrain.parallel.init import seed_training_rng
from hydratrain.parallel.precision import Precision
from hydratrain.parallel.strategy import Strategy, build_model, build_strategy
from hydratrain.paths import Paths, launch_dir, resolve_path
from hydratrain.plan import OutOfMemoryGuard, plan_run
from hydratrain.train import extras
from hydratrain.train.evaluate import Evaluator
from hydratrain.train.outputs import model_files, model_record, unwritable_as_output_error, write_outputs
from hydratrain.train.step_logger import StepLogger
from hydratrain.train.testing import evaluate_only, tester
from hydratrain.train.trackers import start_trackers
from hydratrain.train.trainer import Trainer, TrainProgress

log = logging.getLogger("hydratrain")


def main(cfg: DictConfig, run_dir: Optional[Path] = None):
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
              _exit_code(select_value(cfg, "checkpoint.preempt_exit_code", None)), _under_submitit())


        timing.mark("imports")
        quiet_console()
        OmegaConf.set_readonly(cfg, True)  # for the run; given back at the end, so a caller may change cfg and rerun
        env = dist_info()
        launch = launch_dir()
        check(cfg, env.world_size, launch, env.local_world_size)
        run_dir = Path(run_dir) if run_dir is not None else run_dir_of()
        refuse_a_path_that_is_not_utf8(run_dir)
        if in_multirun():
            refuse_another_jobs_dir(run_dir)
        lock = hold_run_dir(run_dir, env, *run_dir_key(run_dir),
                            prepare=lambda: recover_unfinished_saves(run_dir / "checkpoints"),
                            config=shared_config(cfg) if env.world_size > 1 else None)
        resume = find_resume(cfg.checkpoint, run_dir, launch, prefer_best=str(cfg.mode) == "eval")
        if resume is not None and in_multirun() and resume.parent == run_dir / "checkpoints":
            refuse_another_trial(cfg, resume, run_dir)
        elif resume is None and in_multirun() and (run_dir / "results.json").is_file():
            finished = trial_record(run_dir, cfg.checkpoint.auto_resume)
            if finished is not None:
                refuse_another_trial(cfg, finished, run_dir)
        strategy = build_strategy(cfg, env.world_size, device_type(str(cfg.device)))
        dcfg = cfg.distributed
        timing.mark("checks")
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
    if result.preempted:  # (Preemption.stopping logged the checkpoint and the command that resumes)
        if in_multirun():
            exits.end_the_sweep(cfg.checkpoint.preempt_exit_code, "preempted: stopped by a preemption signal after "
                                f"saving a checkpoint; to resume: {resume_command()}")
        raise SystemExit(cfg.checkpoint.preempt_exit_code)
    return result


def _exit_code(value: Any) -> int:
    """``checkpoint.preempt_exit_code`` for the start-up guard, before the config check: 75 when it is not a
    usable status (the check then names it)."""
    return value if isinstance(value, int) and 0 < value < 256 and value not in RESERVED_EXIT_CODES else EXIT_PREEMPTED


def _under_submitit() -> bool:
    return under_submitit()


def _keep_the_epoch_limit(job: "Job") -> None:
    """``trainer.max_epochs`` limits samples, not steps: after a resume on another ``data.batch_size``,
    ``trainer.grad_accum_steps`` or world size, :func:`hydratrain.optim.total_steps` from the restored data position
    differs from the config's own count. Re-targets the trainer, the step logger and the lr schedule (its length, at
    the restored step) when it does."""

    trainer = job.trainer
    steps = total_steps(job.cfg.trainer, trainer.train_batches, done=trainer.progress.step)
    if steps == trainer.max_steps:
        return
    log.warning("trainer.max_epochs=%d from the restored data position (epoch %d) at this run's batch geometry: "
                "%d optimizer steps in all, not the %d the config alone gives; the lr schedule is re-targeted to "
                "%d steps", job.cfg.trainer.max_epochs, trainer.train_batches.position()[0], steps,
                trainer.max_steps, steps)
    trainer.max_steps = job.step_logger.max_steps = steps
    state = job.checkpoints.components["scheduler"]
    if not isinstance(state, SchedulerState):  # (a scheduler of one's own keeps the length it was built with)
        log.warning("scheduler._target_=%s keeps its own length; set its run-length keyword to %d to end with the "
                    "run", job.cfg.scheduler._target_, steps)
        return
    for schedule in trainer.scheduler.lr_lambdas:
        schedule.total_steps = steps
    state.load_state_dict(state.state_dict())  # the groups' lr at the restored step, on the new schedule


@dataclass
class Job:
    """Everything one training job is made of, built by :func:`build` (tests build one to drive it directly)."""

    cfg: DictConfig
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
    test_batches: Any = None  # the data's test split (EvalBatches over every sample), or None


def build(cfg: DictConfig, strategy, info, run_dir: Path, launch: Path, oom_guard=None,
          resuming: bool = False) -> Job:
    """Resolve the precision, seed, and build data, model, optimizer, schedule, scaler, logger, checkpoint manager,
    preemption and trainer for this rank (every rank calls; collectives inside). The memory plan is made before the
    model exists and handed to ``oom_guard`` (a :class:`hydratrain.plan.OutOfMemoryGuard`), if given. ``resuming``:
    a checkpoint is loaded next, so the run length's warnings wait for its data position. ``data.batch_size=auto``
    resolves here (:func:`hydratrain.auto_batch.resolve`): the job's ``cfg`` holds the number, its checkpoints the
    config as composed (so a relaunch of the same trial is the same trial)."""
    timing.mark("imports")
    device = info.device
    precision = Precision.resolve(cfg.precision, device)
    precision.apply_backend_flags()
    log.info("run dir %s; rank %d of %d on %s; torch %s; %s", run_dir, info.rank, info.world_size, device,
             torch.__version__, precision.describe())
    torch.manual_seed(cfg.trainer.seed)
    # python's and numpy's global RNGs too, so every RNG state a checkpoint holds is reproducible
    random.seed(cfg.trainer.seed)
    np.random.seed(cfg.trainer.seed % 2**32)

    reset_peak_memory(device)  # this job's peak only, not start-up's or an earlier job's of the same process
    paths = Paths.resolve(cfg, launch)
    tokenizer, vocab_size = data_vocabulary(cfg, info, paths.data, cfg.trainer.progress_bar, cache_dir=paths.cache)
    composed, cfg = cfg, auto_batch.resolve(cfg, strategy, info, precision, vocab_size)  # data.batch_size=auto
    train_batches, eval_batches, test_batches = build_data(cfg, info, paths.data, cfg.trainer.progress_bar,
                                                           vocab_size, cache_dir=paths.cache, with_test=True)
    timing.mark("data")
    # before the model: nothing allocated yet; a model the planner simulates runs on the data's example shapes
    memory_plan = plan_run(cfg, strategy, info, precision, vocab_size, example=train_batches.example)
    if oom_guard is not None:
        oom_guard.run_plan = memory_plan
    timing.mark("memory plan")
    model, raw, n_params, summary = build_model(cfg, strategy, precision, device, vocab_size)
    timing.mark("model")
    seed_training_rng(cfg.trainer.seed, info.rank)
    log.info("model %s: %.2fM parameters, this rank holds %.2f MB of them; %s", components.model_name(cfg),
             n_params / 1e6, strategy.local_param_bytes(model) / 1e6, summary)
    # what check() built to check it (validate's check_components) is taken over here, not built again
    loss_fn, metrics = components.build_loss(cfg, device, checked=True), components.build_metrics(cfg, checked=True)
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError("model._target_", str(select_value(cfg, "model._target_", "")), "every parameter of the "
                          "model is frozen (requires_grad=False), so there is nothing to train: leave the ones to "
                          "train trainable")
    optimizer = build_optimizer(model, cfg.optim)
    optimizer_state = OptimizerState(model, optimizer)  # the configured hyper-parameters, before the scheduler
    timing.mark("optimizer")
    max_steps = total_steps(cfg.trainer, train_batches)
    if max_steps == 0:
        raise ConfigError("trainer.max_epochs", cfg.trainer.max_epochs,
                          f"gives 0 optimizer steps: an epoch has {train_batches.batches_per_epoch} micro-batches per "
                          f"rank, fewer than trainer.grad_accum_steps={cfg.trainer.grad_accum_steps}")
    if not resuming:  # else from the restored data position, after the load (_fit)
        warn_run_length(cfg.trainer, cfg.scheduler, train_batches, max_steps)
    scheduler = build_scheduler(optimizer, cfg.scheduler, max_steps)
    scaler = precision.grad_scaler(device)
    progress = TrainProgress()
    data = DataSettings.of(cfg.data)  # (batch_size resolved by auto_batch above)
    seq_len = data.seq_len  # token data; a dataset's samples are counted as samples
    per_sample = seq_len or 1
    items_per_step = cfg.trainer.grad_accum_steps * int(data.batch_size) * per_sample * info.world_size
    timing.mark("optimizer")
    slow = precision.slow_path(device, cache_dir=paths.cache)
    if slow:
        log.warning(slow)
    peak = peak_flops(device, precision.compute_dtype, cfg.logger.peak_flops, tf32=precision.tf32,
                      cache_dir=paths.cache, local_world_size=info.local_world_size)
    timing.mark("peak FLOP/s")
    flops_per_item = model_flops(cfg, raw, train_batches, loss_fn, vocab_size, seq_len)
    components.forget_checked()  # (a checked meta model no build took: the run trains one built with storage)
    timing.mark("model FLOPs")
    # rank 0's MLflow / W&B / CSV (one that fails to start: a ConfigError naming it, before training)
    trackers = start_trackers(cfg, run_dir, paths.output, resuming) if info.is_main else []
    step_logger = StepLogger(run_dir, device, items_per_step, flops_per_item,
                             peak * info.world_size, cfg.trainer.log_every_n_steps, max_steps, info.is_main,
                             cfg.logger.tensorboard, cfg.trainer.progress_bar, progress=progress,
                             unit="tokens" if seq_len else "samples", tokens_per_sample=per_sample, trackers=trackers)
    checkpoints = CheckpointManager(
        run_dir / "checkpoints",
        components={"model": ModelState(model, trainable_only=LoraSettings.of(cfg) is not None),  # (LoRA: adapters)
                    "optim": optimizer_state, "scheduler": scheduler_state(scheduler),
                    "scaler": scaler, "progress": progress, "data": train_batches},
        rank_components={"rng": RNGState(device), "step_logger": step_logger},
        config=OmegaConf.to_container(composed, resolve=True, enum_to_str=True),  # type: ignore[arg-type]  # (a dict)
        keep_last=cfg.checkpoint.keep_last, device=device, attachments=model_files(cfg, vocab_size, tokenizer))
    callbacks = extras.build_callbacks(cfg, checkpoints, device, scheduler, model=raw, vocab_size=vocab_size)
    if callbacks:  # (their states ride in the checkpoints; a run without callbacks saves none)
        checkpoints.components["callbacks"] = callbacks
    preemption = Preemption(cfg.checkpoint.save_on_sigterm, cfg.checkpoint.preempt_exit_code, under_submitit())
    trainer = Trainer(tcfg=cfg.trainer, model=model, strategy=strategy, precision=precision, device=device,
                      optimizer=optimizer, scheduler=scheduler, scaler=scaler, train_batches=train_batches,
                      evaluator=Evaluator(eval_batches, device, loss_fn, metrics), step_logger=step_logger,
                      checkpoints=checkpoints, preemption=preemption, progress=progress, max_steps=max_steps,
                      save_every=cfg.checkpoint.every_n_steps, save_last=cfg.checkpoint.save_last, loss_fn=loss_fn,
                      contract=(cfg.model.get("_target_"), cfg.loss.get("_target_")), callbacks=callbacks)
    extras.bind(callbacks, trainer, raw, info, run_dir)
    timing.mark("logger, checkpoints, trainer")
    return Job(cfg, info, strategy, precision, model, raw, trainer, checkpoints, step_logger, tokenizer, vocab_size,
               test_batches)


def _fit(cfg: DictConfig, strategy, info, run_dir: Path, launch: Path, resume: Optional[Path], oom_guard=None):
    from hydratrain.checkpoint.io import check_same_resume  # (start-up: torch ~2 s)

    evaluating = str(cfg.mode) == "eval"  # (mode=eval: no run-length or resume warnings, nothing trained)
    job = build(cfg, strategy, info, run_dir, launch, oom_guard, resuming=resume is not None or evaluating)
    init_from = model_settings(cfg).init_from
    check_same_resume(resume)
    progress = job.trainer.progress
    if resume is not None:
        try:
            job.checkpoints.load(resume, compare_config=not evaluating)
        except DamagedCheckpointError as err:  # found while reading (corrupt bytes), not by find_resume's checks
            raise with_previous(err, resume) if resume.parent == run_dir / "checkpoints" else err from None
        if cfg.trainer.max_epochs is not None:
            _keep_the_epoch_limit(job)
        lr_change = job.checkpoints.components["scheduler"].lr_change(progress.step)
        if lr_change and progress.step < job.trainer.max_steps and not evaluating:
            log.warning(lr_change)
        if init_from:
            log.info("model.init_from=%s not used: resuming from %s", init_from, resume)
        if progress.step >= job.trainer.max_steps and not evaluating:
            log.warning("resumed at step %d, which is already at or past the %d steps this config trains "
                        "(trainer.max_steps / max_epochs): nothing to train, evaluating only", progress.step,
                        job.trainer.max_steps)
        elif not evaluating:
            warn_run_length(cfg.trainer, cfg.scheduler, job.trainer.train_batches, job.trainer.max_steps,
                            done=progress.step)
    elif init_from:
        from hydratrain.checkpoint.io import init_from_file  # (torch.distributed.checkpoint: only when needed)

        init_from_file(job.model, resolve_path(init_from, Paths.resolve(cfg, launch).model),
                       model_record(cfg, job.vocab_size))
    if evaluating:  # nothing trained, nothing moved aside
        return evaluate_only(job, run_dir, resume or (Path(init_from) if init_from else None), progress.step, info)
    job.checkpoints.supersede_after(progress.step)
    timing.mark("resume / init_from")
    try:
        return _train(cfg, job, strategy, info, run_dir, oom_guard)
    except BaseException as err:  # the trackers' runs end as failed (killed: an exit or Ctrl-C), not as running
        job.step_logger.trackers.close("failed" if isinstance(err, Exception) else "killed")
        raise


def _train(cfg: DictConfig, job: Job, strategy, info, run_dir: Path, oom_guard) -> Any:
    """Fit, then write the outputs of a run that was not preempted."""
    result = job.trainer.fit()
    if not result.preempted:  # the final evaluation and outputs: a preemption signal now ends the launch at once
        guard(cfg.checkpoint.save_on_sigterm, cfg.checkpoint.preempt_exit_code, job.trainer.preemption.under_submitit,
              phase="final")
    log.info("optimizer state: %.3f MB on this rank (optim=%s)", state_bytes(job.trainer.optimizer) / 1e6,
             optimizer_name(cfg.optim))
    result.peak_memory_bytes = int(max_over_ranks(peak_memory_bytes(info.device), info.device))
    planned = oom_guard.run_plan if oom_guard is not None else None
    result.planned_peak_memory_bytes = int(max_over_ranks(planned.plan.peak if planned else 0, info.device))
    if result.preempted:
        job.step_logger.trackers.close("killed")  # (preempted: a later launch resumes the runs)
        return result

    stop_if_launcher_gone("before writing the run's outputs")
    write_outputs(job.cfg, result, model=job.model, raw=job.raw, strategy=strategy, precision=job.precision, info=info,
                  run_dir=run_dir, trackers=job.step_logger.trackers, tokenizer=job.tokenizer,
                  vocab_size=job.vocab_size, test=tester(job, run_dir))
    return result


if __name__ == "__main__":  # `python -m hydratrain.run` says where to start instead of exiting 0 silently
    say("hydratrain: hydratrain.run is the library's entry (main(cfg)); train with python train.py [OVERRIDES] (or "
        "torchrun ... train.py) from the clone, whose conf/ holds the run config")
    raise SystemExit(2)
