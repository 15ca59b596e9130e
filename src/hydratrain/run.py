"""``main(cfg)``, the composition root: check -> build (Strategy, process group, Precision, data, model, optimizer,
checkpoints) -> fit -> outputs. It only composes; each decision lives in the module that builds the piece.

``train.py`` is a thin ``@hydra.main`` wrapper around :func:`main`; tests call :func:`main` with a composed config.
The config is never written to: it is made read-only here, and values such as ``precision=auto`` resolve into new
objects (:class:`~hydratrain.parallel.precision.Precision`).
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from hydratrain import components, exits, timing
from hydratrain.checkpoint.layout import (
    find_resume,
    list_checkpoints,
    other_trial,
    recover_unfinished_saves,
    with_previous,
)
from hydratrain.checkpoint.preemption import Preemption, guard
from hydratrain.components import model_settings
from hydratrain.config.launcher import launched_processes
from hydratrain.config.settings import DataSettings, plus_as_force
from hydratrain.dist.env import dist_info, quiet_console, under_submitit
from hydratrain.dist.launch import note_launcher, resume_command, stop_if_launcher_gone, unwritable_message
from hydratrain.dist.process_group import device_type, process_group
from hydratrain.dist.run_dir import other_job_of_this_multirun, run_dir_of, trial_record
from hydratrain.dist.run_lock import hold_run_dir, shared_config
from hydratrain.errors import (
    EXIT_PREEMPTED,
    RESERVED_EXIT_CODES,
    ConfigError,
    DamagedCheckpointError,
    HydratrainError,
    OutputError,
    say,
    unwritable_cause,
)
from hydratrain.exits import in_multirun
from hydratrain.paths import Paths, launch_dir, resolve_path
from hydratrain.protocols import has_flops_per_token

if TYPE_CHECKING:  # Job's fields: these modules import torch, which this module loads only when a run builds
    from torch import nn

    from hydratrain.checkpoint.manager import CheckpointManager
    from hydratrain.data.tokenizer import TextTokenizer
    from hydratrain.dist.env import DistInfo
    from hydratrain.parallel.precision import Precision
    from hydratrain.parallel.strategy import Strategy
    from hydratrain.train.step_logger import StepLogger
    from hydratrain.train.trainer import Trainer

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
        guard(bool(_select(cfg, "checkpoint.save_on_sigterm", True)),
              _exit_code(_select(cfg, "checkpoint.preempt_exit_code", None)), _under_submitit())
        import torch  # noqa: F401  (imported here so that the start-up timeline charges it to "imports")

        from hydratrain.parallel.strategy import build_strategy  # (start-up: torch ~2 s)
        from hydratrain.plan import OutOfMemoryGuard  # (start-up: torch ~2 s)

        timing.mark("imports")
        quiet_console()
        OmegaConf.set_readonly(cfg, True)  # for the run; given back at the end, so a caller may change cfg and rerun
        env = dist_info()
        launch = launch_dir()
        check(cfg, env.world_size, launch, env.local_world_size)
        run_dir = Path(run_dir) if run_dir is not None else run_dir_of()
        _refuse_a_path_that_is_not_utf8(run_dir)
        if in_multirun():
            _refuse_another_jobs_dir(run_dir)
        lock = hold_run_dir(run_dir, env, *_run_dir_key(run_dir),
                            prepare=lambda: recover_unfinished_saves(run_dir / "checkpoints"),
                            config=shared_config(cfg) if env.world_size > 1 else None)
        resume = find_resume(cfg.checkpoint, run_dir, launch, prefer_best=str(cfg.mode) == "eval")
        if resume is not None and in_multirun() and resume.parent == run_dir / "checkpoints":
            _refuse_another_trial(cfg, resume, run_dir)
        elif resume is None and in_multirun() and (run_dir / "results.json").is_file():
            finished = trial_record(run_dir, cfg.checkpoint.auto_resume)
            if finished is not None:
                _refuse_another_trial(cfg, finished, run_dir)
        strategy = build_strategy(cfg, env.world_size, device_type(str(cfg.device)))
        dcfg = cfg.distributed
        timing.mark("checks")
        with process_group(str(cfg.device), strategy.backend, strategy.needs_process_group, strategy.cpu_offload,
                           dcfg.failure_timeout_s, dcfg.collective_timeout_s) as info, OutOfMemoryGuard() as oom, \
                _unwritable_as_output_error(run_dir, resume, Paths.resolve(cfg, launch).cache):
            timing.mark("device + distributed setup")
            result = _fit(cfg, strategy, info, run_dir, launch, resume, oom)
    except BaseException as err:
        exits.end(err, env)
    finally:
        exits.leave(bool(_select(cfg, "checkpoint.save_on_sigterm", True)), lock)
        OmegaConf.set_readonly(cfg, readonly)  # a second run from Python with the same cfg works
    if result.preempted:  # (Preemption.stopping logged the checkpoint and the command that resumes)
        if in_multirun():
            exits.end_the_sweep(cfg.checkpoint.preempt_exit_code, "preempted: stopped by a preemption signal after "
                                f"saving a checkpoint; to resume: {resume_command()}")
        raise SystemExit(cfg.checkpoint.preempt_exit_code)
    return result


def check(cfg: DictConfig, world_size: int, launch: Path, local_world_size: Optional[int] = None) -> None:
    """The config checks a run makes before it starts, and before any process group exists: the cross-field rules
    (:func:`hydratrain.config.validate.validate`) and those of this machine and launch
    (:func:`~hydratrain.config.validate.check_environment`: device, backend, world size, input paths;
    ``world_size`` and ``local_world_size`` ranks, relative paths against the launch dir ``launch``). :func:`main`
    runs them, and so does ``train.py --cfg job`` (:func:`with_config_checks`). Raises
    :class:`~hydratrain.errors.ConfigError` on the first bad key."""
    from hydratrain.config.validate import check_environment, validate  # (start-up: torch ~2 s)

    validate(cfg)
    check_environment(cfg, world_size, launch, local_world_size)


def with_config_checks(entry):
    """``train.py``'s entry: Hydra's ``@hydra.main`` function ``entry``, with the config errors a run ends with.

    - An error Hydra finds while it composes the config (an unknown key or option, a wrong type) ends the launch as
      any config error does: one line, ``hydratrain: config error: ...``, exit status 2, printed once per node under
      torchrun (:func:`hydratrain.exits.end_composition`), not Hydra's few lines on every rank.
    - When the command line printed the composed config instead of running (``--cfg job`` or ``--cfg all``: Hydra
      prints it and never calls the task), :func:`check` runs on that same config, as a run of that command line
      would, on the ranks the config's launcher starts (else this launch's). A failed check ends the command as it
      ends the run: the run's one line (``hydratrain: config error: <key>=<value>: <why>``) and exit status 2, after
      the printed config. When the printed config cannot be had, one line says it was not checked. Checks that need
      the built data, model or process group (a token id beyond the vocabulary, the device mesh) run only in a run.
    """
    import functools

    @functools.wraps(entry)
    def run_or_print(*args, **kwargs):
        if args or kwargs:  # a config passed in: Hydra only calls the task
            return entry(*args, **kwargs)
        exits.composing()
        sys.argv[1:] = plus_as_force(sys.argv[1:])  # +model.init_device=meta, from before every node had the key
        try:
            result = entry()
        except Exception as err:
            exits.end_composition(err)  # (raises SystemExit for a composition error)
            raise
        except KeyboardInterrupt:  # Ctrl-C outside a run's own handling: Hydra composing, a launcher between jobs
            exits.end_interrupted_launch()
        finally:
            exits.composing(False)
        _check_printed_config()
        return result

    return run_or_print


def _check_printed_config() -> None:
    """:func:`with_config_checks`' part after Hydra's ``--cfg``: raises ``SystemExit`` with the failed check's
    status."""
    from hydra._internal.utils import get_args_parser

    try:
        args = get_args_parser().parse_args(sys.argv[1:])
    except SystemExit:
        return
    if args.cfg not in ("job", "all"):
        return
    cfg = _printed_config()
    if cfg is None:
        say("hydratrain: the printed config was not checked (this Hydra keeps no composed config after --cfg): "
            "a run of it checks it before it starts")
        return

    env = dist_info()
    world, local = env.world_size, env.local_world_size
    if _select(cfg, "launcher.name", "local") not in (None, "local"):  # the launcher's workers run it
        world = launched_processes(cfg.launcher)
        local = next((cfg.launcher[k] for k in ("nproc_per_node", "tasks_per_node") if k in cfg.launcher), world)
    readonly = cfg._get_node_flag("readonly")
    OmegaConf.set_readonly(cfg, True)
    try:
        check(cfg, world, launch_dir(), local)
    except HydratrainError as err:
        say(f"hydratrain: {err.label}: {err}")
        raise SystemExit(err.exit_status) from None
    finally:
        OmegaConf.set_readonly(cfg, readonly)


def _printed_config() -> Optional[DictConfig]:
    """The task config Hydra composed for ``--cfg`` (``hydra`` removed): Hydra's ``show_cfg`` keeps the whole
    composed config as the parent of the ``hydra`` node it hands to ``HydraConfig``; None when it is not there."""
    try:
        whole = HydraConfig.instance().cfg.hydra._get_parent()  # type: ignore[union-attr]  # (a DictConfig)
    except Exception:  # noqa: BLE001 (another Hydra: said so by the caller)
        return None
    if not isinstance(whole, DictConfig) or "trainer" not in whole:
        return None
    if "hydra" in whole:  # --cfg all: the task's part, as a run gets it (a deep copy keeps the schema's types)
        import copy

        from omegaconf import open_dict, read_write

        whole = copy.deepcopy(whole)
        with read_write(whole), open_dict(whole):
            del whole["hydra"]
    return whole


def _refuse_a_path_that_is_not_utf8(run_dir: Path) -> None:
    """A run dir whose path holds bytes that are not UTF-8 (a dir name in a legacy encoding, which Python keeps as
    surrogates): every log line naming it was a ``--- Logging error ---`` and TensorBoard's writer then failed with a
    ``UnicodeEncodeError`` traceback. Raises :class:`~hydratrain.errors.ConfigError` on
    ``hydra.run.dir`` (``hydra.sweep.dir`` in a sweep)."""
    try:
        str(run_dir).encode("utf-8")
    except UnicodeEncodeError as err:
        bad = os.fsencode(str(run_dir)[err.start:err.end])
        refused = ConfigError("hydra.sweep.dir" if in_multirun() else "hydra.run.dir", str(run_dir),
                              f"holds bytes that are not UTF-8 ({bad!r}: a dir name in another encoding?), which the "
                              "logs and TensorBoard cannot write; launch from, or give, a dir whose path is UTF-8")
        refused.discard_run_dir = True  # this launch made it for nothing (hydratrain.exits)
        raise refused from None


@contextlib.contextmanager
def _unwritable_as_output_error(run_dir: Path, resume: Optional[Path], cache_dir: Path):
    """A write that a full, over-quota or read-only filesystem, or the permissions of a dir under ``run_dir`` or
    ``cache_dir``, refused anywhere in the run (TensorBoard's events, the weights, results.json, a data cache under
    ``cache_dir``; :func:`hydratrain.errors.unwritable_cause`) ends it as an :class:`~hydratrain.errors.OutputError`:
    one line naming what was written where, the cause and its remedy and the checkpoint to resume from, exit status 3,
    as a failed checkpoint save does, instead of the library's traceback. A permission error on another path (an
    input that cannot be read) is raised as it was."""
    try:
        yield
    except HydratrainError:
        raise
    except Exception as err:
        compile_cache = _compile_cache_dir()
        cause = unwritable_cause(err, writes=(run_dir, cache_dir) + ((compile_cache,) if compile_cache else ()))
        if cause is None:
            raise
        import traceback


        done = list_checkpoints(run_dir / "checkpoints")
        frames = [f.filename.replace(os.sep, "/") for f in traceback.extract_tb(err.__traceback__)]
        room = None
        # which output, from the code that wrote it (write() errors name no file; an open() error names a lock's)
        if any("/torch/_inductor/" in f for f in frames):  # (not "the run's outputs under <run dir>")
            what, where = "writing torch.compile's cache (trainer.compile=true)", compile_cache or "its cache dir"
            room = "set TORCHINDUCTOR_CACHE_DIR to a dir this process can write (or trainer.compile=false)"
        elif any("/hydratrain/data/" in f for f in frames):
            what, where = "writing the data cache (paths.cache_dir, or data.cache_dir, chooses where)", cache_dir
        elif any("/tensorboard/" in f for f in frames):
            what, where = "writing TensorBoard events", run_dir / "tensorboard"
        elif any("/safetensors/" in f or f.endswith("/hydratrain/checkpoint/export.py") for f in frames):
            what, where = "writing the weights", run_dir
        elif cause.filename:
            what, where = f"writing {Path(cause.filename).name}", Path(cause.filename).parent
        else:
            what, where = "writing the run's outputs", run_dir
        raise OutputError(unwritable_message(what, where, OSError(cause.errno, cause.strerror),
                                             done[-1][1] if done else resume, room=room,
                                             stopped="the run stopped", run_dir=run_dir)) from err


def _compile_cache_dir() -> Optional[Path]:
    """torch.compile's cache dir (``TORCHINDUCTOR_CACHE_DIR``, else inductor's default under the temp dir) when
    inductor has been imported (``trainer.compile=true``), else None."""

    utils = sys.modules.get("torch._inductor.runtime.cache_dir_utils")
    try:
        return Path(utils.cache_dir()) if utils is not None else None
    except Exception:  # noqa: BLE001 (only a name for the message)
        return None


def _select(cfg: DictConfig, key: str, default: Any) -> Any:
    """``cfg``'s value at ``key``, or ``default`` when it is missing or does not resolve (the config check names
    it)."""
    try:
        return OmegaConf.select(cfg, key, default=default)
    except Exception:
        return default


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
    from hydratrain.checkpoint.stateful import SchedulerState  # (start-up: torch ~2 s)
    from hydratrain.optim import total_steps  # (start-up: torch ~2 s)

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


def _refuse_another_trial(cfg: DictConfig, resume: Path, run_dir: Path) -> None:
    """A sweep job about to auto-resume from its own run dir's checkpoint: when its overrides give another trial
    than the one that wrote it (a sweep re-run into the same ``hydra.sweep.dir`` with other values: job N would
    continue, or only evaluate, job N of the old sweep, and report its figures under the new values), raise
    :class:`~hydratrain.errors.ConfigError` naming the keys. A relaunch of the same trial (preempted, or with a
    longer ``trainer.max_steps``) resumes."""

    hydra_cfg = HydraConfig.get()
    # (a DictConfig's container: a dict): why the ignore below
    differs = other_trial(resume, OmegaConf.to_container(cfg, resolve=True, enum_to_str=True),  # type: ignore[arg-type]
                          list(hydra_cfg.overrides.task))
    if differs:
        what = (f"a checkpoint of another trial ({resume.name}" if resume.name != ".hydra" else
                "the results of another trial, finished without a checkpoint (its .hydra/config.yaml")
        raise ConfigError("hydra.sweep.dir", hydra_cfg.sweep.dir,
                          f"job {hydra_cfg.job.num}'s run dir {run_dir} holds {what}; {', '.join(differs)}): sweep "
                          "into a new hydra.sweep.dir" + (", or add checkpoint.auto_resume=false to start every "
                                                          "trial over" if resume.name != ".hydra" else ""))


def _refuse_another_jobs_dir(run_dir: Path) -> None:
    """A sweep job whose run dir another job of the same multirun has already used (two jobs' ``hydra.sweep.subdir``
    resolve to one dir, e.g. ``${hydra.job.override_dirname}`` without a swept key): raise
    :class:`~hydratrain.errors.ConfigError` instead of overwriting that job's results, log and TensorBoard curves."""

    hc = HydraConfig.get()
    other = other_job_of_this_multirun(run_dir, hc)
    if other is not None:
        raise ConfigError("hydra.sweep.subdir", hc.sweep.subdir,
                          f"job {hc.job.num}'s run dir {run_dir} is job {other}'s of this sweep: give every job a dir "
                          "of its own (the default ${hydra.job.num}; an override_dirname must keep every swept key)")


def _run_dir_key(run_dir: Path) -> Union[tuple[str, str], tuple[str, str, str]]:
    """(config key, its value[, which dir below it]) that place ``run_dir``: ``hydra.run.dir``, or in a sweep
    ``hydra.sweep.dir`` and the job's run dir."""
    if not in_multirun():
        return "hydra.run.dir", str(run_dir)

    hc = HydraConfig.get()
    return "hydra.sweep.dir", str(hc.sweep.dir), f"job {hc.job.num}'s run dir {run_dir}"


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
    import random

    import numpy as np
    import torch

    from hydratrain import auto_batch  # (start-up: torch ~2 s)
    from hydratrain.checkpoint.manager import CheckpointManager  # (start-up: torch ~2 s)
    from hydratrain.checkpoint.stateful import (  # (start-up: torch ~2 s)
        ModelState,
        OptimizerState,
        RNGState,
        scheduler_state,
    )
    from hydratrain.data.build import build_data, data_vocabulary  # (start-up: torch ~2 s)
    from hydratrain.metrics import peak_flops, reset_peak_memory  # (start-up: torch ~2 s)
    from hydratrain.optim import (  # (start-up: torch ~2 s)
        build_optimizer,
        build_scheduler,
        total_steps,
        warn_run_length,
    )
    from hydratrain.parallel.precision import Precision  # (start-up: torch ~2 s)
    from hydratrain.parallel.strategy import build_model  # (start-up: torch ~2 s)
    from hydratrain.plan import plan_run  # (start-up: torch ~2 s)
    from hydratrain.train import extras  # (start-up: torch ~2 s)
    from hydratrain.train.evaluate import Evaluator  # (start-up: torch ~2 s)
    from hydratrain.train.outputs import model_files  # (start-up: torch ~2 s)
    from hydratrain.train.step_logger import StepLogger  # (start-up: torch ~2 s)
    from hydratrain.train.trainer import Trainer, TrainProgress  # (start-up: torch ~2 s)

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
        raise ConfigError("model._target_", str(_select(cfg, "model._target_", "")), "every parameter of the model is "
                          "frozen (requires_grad=False), so there is nothing to train: leave the ones to train "
                          "trainable")
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
    step_logger = StepLogger(run_dir, device, items_per_step, flops_per_item,
                             peak * info.world_size, cfg.trainer.log_every_n_steps, max_steps, info.is_main,
                             cfg.logger.tensorboard, cfg.trainer.progress_bar, progress=progress,
                             unit="tokens" if seq_len else "samples", tokens_per_sample=per_sample)
    checkpoints = CheckpointManager(
        run_dir / "checkpoints",
        components={"model": ModelState(model), "optim": optimizer_state, "scheduler": scheduler_state(scheduler),
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


def seed_training_rng(seed: int, rank: int) -> None:
    """After the model is built (its weights the same on every rank), give each rank its own stream of the global
    RNGs for training: dropout and other randomness in the forward draws independently per rank, as it does per
    sample of one process's batch (with one seed on every rank, rank r's masks were rank 0's, position for
    position: transformers issue #31412). Rank 0 keeps its stream, so a one-process run is as before; rank r > 0
    is seeded by (``seed``, ``r``). Randomness that must agree across ranks (a layer dropped for the whole batch, as
    LayerDrop does) draws from a generator of its own seeded alike."""
    import random
    import zlib

    import numpy as np
    import torch

    if rank == 0:
        return
    derived = zlib.crc32(f"{seed}:rank{rank}".encode())
    torch.manual_seed(derived)
    random.seed(derived)
    np.random.seed(derived)


def model_flops(cfg: DictConfig, raw, train_batches, loss_fn, vocab_size: Optional[int], seq_len: int) -> float:
    """Training FLOPs per item (token for token data, else sample) for MFU: the model's own formula
    (``flops_per_token(seq_len)``) where it has one and the data has tokens, else counted on a meta copy of the
    model (:func:`hydratrain.flops.counted_flops_per_sample`)."""
    from hydratrain.flops import counted_flops_per_sample  # (start-up: torch ~2 s)

    if seq_len and has_flops_per_token(raw):
        return float(raw.flops_per_token(seq_len))
    per_sample = counted_flops_per_sample(lambda: components.build_model(cfg, "meta", vocab_size, checked=True),
                                          train_batches.example(), loss_fn)
    return per_sample / seq_len if seq_len else per_sample


def _fit(cfg: DictConfig, strategy, info, run_dir: Path, launch: Path, resume: Optional[Path], oom_guard=None):
    from hydratrain.checkpoint.io import check_same_resume  # (start-up: torch ~2 s)
    from hydratrain.dist.collectives import max_over_ranks  # (start-up: torch ~2 s)
    from hydratrain.metrics import peak_memory_bytes  # (start-up: torch ~2 s)
    from hydratrain.optim import optimizer_name, state_bytes, warn_run_length  # (start-up: torch ~2 s)
    from hydratrain.train.outputs import write_outputs  # (start-up: torch ~2 s)
    from hydratrain.train.testing import evaluate_only, tester  # (start-up: torch ~2 s)

    job = build(cfg, strategy, info, run_dir, launch, oom_guard, resuming=resume is not None)
    init_from = model_settings(cfg).init_from
    check_same_resume(resume)
    progress = job.trainer.progress
    if resume is not None:
        try:
            job.checkpoints.load(resume)
        except DamagedCheckpointError as err:  # found while reading (corrupt bytes), not by find_resume's checks
            raise with_previous(err, resume) if resume.parent == run_dir / "checkpoints" else err from None
        if cfg.trainer.max_epochs is not None:
            _keep_the_epoch_limit(job)
        lr_change = job.checkpoints.components["scheduler"].lr_change(progress.step)
        if lr_change and progress.step < job.trainer.max_steps:
            log.warning(lr_change)
        if init_from:
            log.info("model.init_from=%s not used: resuming from %s", init_from, resume)
        if progress.step >= job.trainer.max_steps:
            log.warning("resumed at step %d, which is already at or past the %d steps this config trains "
                        "(trainer.max_steps / max_epochs): nothing to train, evaluating only", progress.step,
                        job.trainer.max_steps)
        else:
            warn_run_length(cfg.trainer, cfg.scheduler, job.trainer.train_batches, job.trainer.max_steps,
                            done=progress.step)
    elif init_from:
        from hydratrain.checkpoint.io import init_from_file  # (torch.distributed.checkpoint: only when needed)
        from hydratrain.train.outputs import model_record  # (start-up: torch ~2 s)

        init_from_file(job.model, resolve_path(init_from, Paths.resolve(cfg, launch).model),
                       model_record(cfg, job.vocab_size))
    if str(cfg.mode) == "eval":  # nothing trained, nothing moved aside
        return evaluate_only(job, run_dir, resume or (Path(init_from) if init_from else None), progress.step, info)
    job.checkpoints.supersede_after(progress.step)
    timing.mark("resume / init_from")
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
        job.step_logger.tb.close()
        return result

    stop_if_launcher_gone("before writing the run's outputs")
    write_outputs(job.cfg, result, model=job.model, raw=job.raw, strategy=strategy, precision=job.precision, info=info,
                  run_dir=run_dir, tb=job.step_logger.tb, tokenizer=job.tokenizer, vocab_size=job.vocab_size,
                  test=tester(job, run_dir))
    return result


if __name__ == "__main__":  # `python -m hydratrain.run` says where to start instead of exiting 0 silently
    say("hydratrain: hydratrain.run is the library's entry (main(cfg)); train with python train.py [OVERRIDES] (or "
        "torchrun ... train.py) from the clone, whose conf/ holds the run config")
    raise SystemExit(2)
