"""The sweep's Hydra callback: it checks a multirun before its first job, records each job's status in the sweep
report (``hydratrain.sweep_report``) and ends the sweep through ``hydratrain.exits``. Registered in
``conf/train.yaml`` as ``hydra.callbacks.sweep_report`` (``_target_: hydratrain.sweep.SweepReportCallback``).
"""
from __future__ import annotations

import logging
import math
import os
import sys
import time
from typing import Any, Optional

from hydra._internal.utils import get_args_parser
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig

from hydratrain.checkpoint.preemption import take_early_signal
from hydratrain.config.launcher import validate_launcher
from hydratrain.dist.env import env_rank
from hydratrain.dist.launch import composing, launch_command, note_launcher
from hydratrain.dist.run_dir import (
    MULTIRUN_MARK,
    _read_json,
    _sweep_dir,
    discard_reserved_unused,
    refuse_a_full_run_dir,
    refuse_an_unwritable_run_dir,
)
from hydratrain.errors import EXIT_CONFIG, ConfigError, say
from hydratrain.exits import (
    await_the_end,
    end_of_sweep,
    end_one_run,
    end_one_run_by_signal,
    keep_early_sigterm,
    sweep_ended,
)
from hydratrain.sweep.checks import (
    _check_before_submitting,
    _hopeless,
    refuse_a_run_dir,
    refuse_a_stored_study_over_its_job_dirs,
    refuse_swept_executor_keys,
    sampled_keys,
)
from hydratrain.sweep_report import (
    LEFT_BY_A_REFUSED_JOB,
    _job_dir,
    _refused_by_its_rank0,
    mark_multirun,
    refused_the_dir,
    sweep_rows,
    write_job_status,
    write_sweep_report,
)

log = logging.getLogger("hydratrain.sweep")


def _is_rank0() -> bool:
    return env_rank() == 0


class SweepReportCallback(Callback):
    """Hydra callback: on multirun start, check the ``launcher`` keys (a SLURM GPU/task mismatch, or no ``sbatch`` here,
    fails before anything is submitted); after each job (rank 0, or the launcher process for a job whose workers
    failed), record its status and refresh the report; at multirun end, refresh it, log where it is, and exit with
    status 1 when any job failed (a sweeper that tolerates failed trials, like the Optuna preset, otherwise exits 0). A
    sweep that Hydra's sweeper ends by raising a failed job's error gets the same report and line when the sweeping
    process exits (:func:`hydratrain.exits.await_the_end`). In a single run it only probes the run dir before Hydra
    makes it (:meth:`on_run_start`)."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        """A single run, every rank: a run dir that takes no writes ends the launch with one line and exit status 3
        (``SystemExit``) before Hydra makes it and opens the log file there
        (:func:`hydratrain.dist.run_dir.refuse_an_unwritable_run_dir`)."""
        composing(False)  # composed: Hydra reports its own errors again (hydratrain.exits)
        refuse_an_unwritable_run_dir(config)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        composing(False)  # composed: Hydra reports its own errors again (hydratrain.exits)
        early = take_early_signal()  # a SIGTERM while Hydra composed the sweep: no job has started
        if early is not None and not config.get("checkpoint", {}).get("save_on_sigterm", True):
            os.kill(os.getpid(), early)  # SIGTERM's default, as checkpoint.save_on_sigterm=false asks
        if early is not None:
            code = config.get("checkpoint", {}).get("preempt_exit_code", 75)
            if _is_rank0():  # (a sweep inside each torchrun rank: one line; nothing to resume: no dir to name)
                say("hydratrain: preempted: SIGTERM before the sweep's first job: nothing started; relaunch the "
                    "same command")
            raise SystemExit(code if isinstance(code, int) else 75)
        self._one_run = launched_as_one_run(config.hydra)
        try:
            refuse_a_run_dir(config.hydra)
        except ConfigError as err:
            if _is_rank0():
                say(f"hydratrain: config error: {err}")
                discard_reserved_unused()
            raise SystemExit(EXIT_CONFIG) from None
        if "launcher" in config or config.hydra.get("sweeper", {}).get("storage"):
            try:
                refuse_a_stored_study_over_its_job_dirs(config.hydra)
                if "launcher" in config:
                    validate_launcher(config.launcher, submitting=True)
                    if config.launcher.get("name") in ("slurm", "submitit_local"):
                        _check_before_submitting(config)
                        refuse_swept_executor_keys(config.launcher.name, OverridesParser.create().parse_overrides(
                            [str(line) for line in config.hydra.overrides.task]))
            except ConfigError as err:
                if _is_rank0():
                    say(f"hydratrain: config error: {err}")
                    discard_reserved_unused(LEFT_BY_A_REFUSED_JOB)  # (the dirs this launch made)
                elif os.environ.get("TORCHELASTIC_RUN_ID"):
                    time.sleep(10)  # the same error on every rank: rank 0 says it and leaves first (root cause)
                raise SystemExit(EXIT_CONFIG) from None
        if _is_rank0() and ("launcher" not in config or config.launcher.get("node_rank", 0) == 0):
            refuse_a_full_run_dir(_sweep_dir(config.hydra), sweep=True)

            note_launcher()  # (a sweep inside each torchrun rank: its command is torchrun's)
            mark_multirun(_sweep_dir(config.hydra), sampled_keys(config.hydra), launch_command())
            self._jobs = basic_sweep_jobs(config.hydra), os.getpid()  # (a launcher's workers get a copy of self)
            await_the_end(_sweep_dir(config.hydra))
        keep_early_sigterm(config.hydra, config.get("checkpoint", {}).get("save_on_sigterm", True))

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._job_started = time.time()

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:

        hc = config.hydra if "hydra" in config else HydraConfig.get()
        if hc.mode != RunMode.MULTIRUN or not _is_rank0():
            return
        job_dir = _job_dir(hc)
        job_dir.mkdir(parents=True, exist_ok=True)
        error = ""
        if job_return.status.name == "FAILED":
            error = f"{type(job_return._return_value).__name__}: {job_return._return_value}".splitlines()[0]
        sweep_dir = _sweep_dir(hc)
        results = _read_json(job_dir / "results.json")
        started = getattr(self, "_job_started", None)  # None: the launcher's process, for a job its workers failed
        try:
            current = bool(results) and (job_return.status.name == "COMPLETED" if started is None else
                                         (job_dir / "results.json").stat().st_mtime >= started)
        except OSError:
            current = False
        refused = job_return.status.name == "FAILED" and refused_the_dir(job_return._return_value)
        multirun = _read_json(sweep_dir / MULTIRUN_MARK).get("id")
        if not (started is None and _refused_by_its_rank0(job_dir, hc.job.num, multirun)):
            write_job_status(job_dir, hc.job.num, list(hc.overrides.task), job_return.status.name, error,
                             results.get("seconds", math.nan) if current and not refused else math.nan,
                             multirun, current and not refused, refused)
        write_sweep_report(sweep_dir)
        if job_return.status.name == "FAILED":
            if getattr(job_return._return_value, "ends_the_sweep", False):
                sweep_ended()  # a signal to the torchrun launcher's process: its own line and status end the sweep
                if getattr(self, "_one_run", False) and started is None:
                    end_one_run_by_signal(job_return._return_value)  # ... or, for one run, the run's
                return
            if getattr(self, "_one_run", False):
                if started is None:  # the launcher's process, after the workers (which said their error) are gone
                    sweep_ended()
                    end_one_run(job_return._return_value, sweep_dir)
                return
            if started is not None:  # (the launcher's process: the torchrun and Ray plugins log the failure there)
                log.warning("job #%d failed: %s (the sweep goes on; %s)", hc.job.num, error,
                            sweep_dir / "sweep_report.md")
            why = _hopeless(hc, job_return._return_value, sweep_rows(sweep_dir), launching=started is None,
                            config=config)
            if why:
                sweep_ended()
                write_sweep_report(sweep_dir, chart=True)  # (a search stopped early: its chart as at the end)
                raise SystemExit(f"hydratrain: sweep stopped after job {hc.job.num}: {why} (see "
                                 f"{sweep_dir / 'sweep_report.md'})")
        if (hc.job.num + 1, os.getpid()) == getattr(self, "_jobs", None) and any(r["status"] == "FAILED"
                                                                                  for r in sweep_rows(sweep_dir)):
            # Hydra's basic sweeper raises the first failure after the last job, so on_multirun_end would not run:
            # the report and the closing line come now, and last (not Hydra's hint)

            take_early_signal()  # as on_multirun_end: every job has ended
            end_of_sweep(sweep_dir)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        take_early_signal()  # a SIGTERM after the last job: every job has ended; the report is still written
        if not _is_rank0() or ("launcher" in config and config.launcher.get("node_rank", 0) != 0):
            return
        end_of_sweep(_sweep_dir(config.hydra), chart=not getattr(self, "_one_run", False))  # (one run: no chart)


def launched_as_one_run(hydra_cfg: DictConfig) -> bool:
    """Whether this multirun is one run that the torchrun launcher made a sweep of one job (``launcher=torchrun`` sets
    ``hydra.mode: MULTIRUN``), not a sweep the command line asked for: no ``-m`` / ``--multirun`` and one job. Such a
    run ends as a run does: its error's one line and exit status (:func:`hydratrain.exits.end_one_run`), no sweep report
    on the console. (Ray's and submitit's launchers report a job's failure in their own ways: their runs end as
    sweeps.)"""
    if not str(hydra_cfg.launcher.get("_target_", "")).endswith(".TorchrunLauncher"):
        return False
    try:
        args = get_args_parser().parse_args(sys.argv[1:])
    except SystemExit:
        return False
    return not args.multirun and basic_sweep_jobs(hydra_cfg) == 1


def basic_sweep_jobs(hydra_cfg: DictConfig) -> Optional[int]:
    """How many jobs Hydra's basic sweeper runs for this multirun (the product of the sweep overrides' and
    ``hydra.sweeper.params``' choices, keyed as its ``split_arguments`` keys them, the command line winning), or
    None for another sweeper, batches (``max_batch_size``: it stops at the first batch with a failure) or a sweep it
    cannot count (``glob``). A count below the real one would end the sweep early, so it follows the sweeper's own
    expansion."""
    sweeper = hydra_cfg.get("sweeper") or {}
    if not str(sweeper.get("_target_", "")).endswith("BasicSweeper") or sweeper.get("max_batch_size"):
        return None
    params = [f"{k}={v}" for k, v in (sweeper.get("params") or {}).items()]
    try:
        overrides = OverridesParser.create().parse_overrides([*params, *hydra_cfg.overrides.task])
        counts = {o.get_key_element(): len(list(o.sweep_string_iterator())) if o.is_sweep_override() else 1
                  for o in overrides}
    except Exception:  # (a glob sweep, or anything the parser reads otherwise than the sweeper)
        return None
    return math.prod(counts.values())
