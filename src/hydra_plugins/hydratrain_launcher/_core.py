"""The work behind :class:`TorchrunLauncher` (a module starting with ``_``: Hydra's plugin scan skips it).

Per job: compose the job's config, pickle (cloudpickle) the Hydra context, the config and the task function, and hand
them to ``elastic_launch``; each worker unpickles them and calls Hydra's ``run_job``, like Hydra's joblib and submitit
launchers do in their workers. Rendezvous: torch's ``c10d`` backend. With one node and no ``launcher.rdzv_endpoint``
the agent's store binds port 0, i.e. the OS hands it a free port at bind time, so concurrent sweeps cannot collide.
"""
from __future__ import annotations

import logging
import os
import socket
import time
from pathlib import Path
from typing import List, Sequence

from hydra.core.hydra_config import HydraConfig
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, configure_log, filter_overrides, run_job, setup_globals
from omegaconf import DictConfig, open_dict
from torch.distributed.elastic.multiprocessing.errors import record

log = logging.getLogger(__name__)


class LaunchError(RuntimeError):
    """A job's workers could not be started or did not finish (bad rendezvous endpoint, a worker failed)."""


def launch(launcher, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> List[JobReturn]:
    """Run the jobs one after another; returns one :class:`JobReturn` per job run (fewer when ``stop_on_failure``
    ends the sweep at a failed job, whose exception the sweeper then raises)."""
    from hydratrain.sweep import write_sweep_report

    setup_globals()
    config = launcher.config
    configure_log(config.hydra.hydra_logging, config.hydra.verbose)
    sweep_dir = Path(str(config.hydra.sweep.dir))  # resolves (and exports) the shared stamp in this process
    sweep_dir.mkdir(parents=True, exist_ok=True)
    log.info("torchrun launcher: %d job(s), sweep dir %s", len(job_overrides), sweep_dir)
    runs: List[JobReturn] = []
    for offset, overrides in enumerate(job_overrides):
        num = initial_job_idx + offset
        log.info("\t#%d : %s", num, " ".join(filter_overrides(overrides)))
        sweep_config = launcher.hydra_context.config_loader.load_sweep_config(config, list(overrides))
        with open_dict(sweep_config):
            sweep_config.hydra.job.id = f"{sweep_config.hydra.job.name}_{num}"
            sweep_config.hydra.job.num = num
        ret = run_one(launcher, sweep_config, list(overrides), num)
        runs.append(ret)
        configure_log(config.hydra.hydra_logging, config.hydra.verbose)
        if ret.status == JobStatus.FAILED:
            log.error("job #%d failed: %s", num, ret._return_value)
            if sweep_config.launcher.node_rank == 0:
                write_sweep_report(sweep_dir)
            if launcher.stop_on_failure:
                break
    return runs


def _check_endpoint(launcher_cfg: DictConfig) -> str:
    """The rendezvous endpoint of this job; on the hosting node, fail fast if its port cannot be bound."""
    endpoint = launcher_cfg.rdzv_endpoint
    if endpoint is None:
        return "127.0.0.1:0"
    host, _, port = str(endpoint).rpartition(":")
    if launcher_cfg.node_rank == 0 and int(port) != 0:
        with socket.socket(socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET) as s:
            try:
                s.bind((host.strip("[]"), int(port)))
            except OSError as err:
                raise LaunchError(f"launcher.rdzv_endpoint={endpoint}: node 0 cannot host the rendezvous store on "
                                  f"this port ({err.strerror}); pick a free port or leave it null (1 node)") from None
    return str(endpoint)


def run_one(launcher, sweep_config: DictConfig, overrides: List[str], num: int) -> JobReturn:
    """Start this job's workers, wait for them, and return rank 0's result as a :class:`JobReturn`.

    Failures (a config error, a port that cannot be had, a worker that failed after ``max_restarts``) come back
    as a FAILED JobReturn whose ``return_value`` raises :class:`LaunchError` with a one-line reason.
    """
    import cloudpickle
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from hydratrain.config import ConfigError, validate, validate_launcher
    from hydratrain.sweep import write_job_status

    lc = sweep_config.launcher
    job_dir = Path(str(sweep_config.hydra.sweep.dir)) / str(sweep_config.hydra.sweep.subdir)
    ret = JobReturn(overrides=overrides, cfg=sweep_config, working_dir=str(job_dir),
                    task_name=sweep_config.hydra.job.name)
    started = time.time()
    try:
        validate_launcher(lc)
        validate(sweep_config)  # a bad job config fails here, before any worker or process group exists
        endpoint = _check_endpoint(lc)
        payload = cloudpickle.dumps((launcher.hydra_context, sweep_config, launcher.task_function,
                                     Singleton.get_state()))
        launch_cfg = LaunchConfig(
            min_nodes=lc.nnodes, max_nodes=lc.nnodes, nproc_per_node=lc.nproc_per_node,
            # Same id on every node (they run the same jobs in the same order), new for every job.
            run_id=f"hydratrain-{sweep_config.hydra.job.name}-{num}",
            rdzv_backend="c10d", rdzv_endpoint=endpoint,
            rdzv_configs={"is_host": lc.node_rank == 0, "timeout": lc.rdzv_timeout, "join_timeout": lc.rdzv_timeout,
                          "read_timeout": lc.rdzv_timeout},  # also bounds a node waiting for node 0's store
            max_restarts=lc.max_restarts, monitor_interval=launcher.monitor_interval,
            start_method=launcher.start_method)
        values = elastic_launch(launch_cfg, _worker)(payload)
        ret.status = JobStatus.COMPLETED
        ret.return_value = values[min(values)] if values else None  # rank 0's on node 0
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        why = f"exit code {failure.exitcode}" + (f" ({failure.signal_name()})" if failure.exitcode < 0 else "")
        message = failure.message
        if isinstance(message, dict):  # torch >= 2.x: the error file's {"message": ..., "extraInfo": ...}
            message = message.get("message", "")
        if failure.error_file_data and str(message).strip():  # the worker's exception, via @record
            why = str(message).strip().splitlines()[0]
        ret.status = JobStatus.FAILED
        ret.return_value = LaunchError(f"job #{num}: rank {rank} failed "
                                       f"(after {lc.max_restarts} restart(s) allowed): {why}")
    except (ConfigError, LaunchError) as err:
        ret.status = JobStatus.FAILED
        ret.return_value = err if isinstance(err, LaunchError) else LaunchError(f"config error: {err}")
    except SignalException:  # Ctrl-C / SIGTERM to this process: the agent has stopped the workers; end the sweep
        raise
    except Exception as err:  # rendezvous errors and the like: report, do not hang or take the sweep down
        ret.status = JobStatus.FAILED
        why = f"{type(err).__name__}: {err}".splitlines()[0]
        if "Rendezvous" in type(err).__name__:
            why = (f"launcher.rdzv_endpoint={lc.rdzv_endpoint}: no rendezvous with all {lc.nnodes} node(s) within "
                   f"launcher.rdzv_timeout={lc.rdzv_timeout} s (is node 0 running the same sweep?): {why}")
        ret.return_value = LaunchError(f"job #{num}: {why}")
    if ret.status == JobStatus.FAILED and lc.node_rank == 0:
        job_dir.mkdir(parents=True, exist_ok=True)
        write_job_status(job_dir, num, overrides, "FAILED", str(ret._return_value), time.time() - started)
    return ret


@record
def _worker(payload: bytes):
    """Entry point of every worker: run the Hydra job on this rank; re-raise its exception so the agent sees the
    failure (and restarts the workers when ``max_restarts`` allows). Returns the task function's value."""
    import cloudpickle

    hydra_context, sweep_config, task_function, singleton_state = cloudpickle.loads(payload)
    setup_globals()
    Singleton.set_state(singleton_state)
    HydraConfig.instance().set_config(sweep_config)
    ret = run_job(hydra_context=hydra_context, task_function=task_function, config=sweep_config,
                  job_dir_key="hydra.sweep.dir", job_subdir_key="hydra.sweep.subdir")
    if ret.status == JobStatus.FAILED:
        raise ret._return_value
    return ret.return_value
