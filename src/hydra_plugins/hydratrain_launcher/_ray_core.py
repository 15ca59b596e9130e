"""The work behind :class:`RayLauncher` (a module starting with ``_``: Hydra's plugin scan skips it).

Once per sweep: connect to the cluster at ``address`` (``ray.init``), or start a local one and shut it down at the
end. Per job, in the launching process: compose the job's config, fix its sweep dir to an absolute path (Ray workers
run in their own working dirs, possibly on other machines, and a restarted attempt must land in the same run dir),
read its ``hydra.launcher`` settings, run the app's ``job_check``, then pickle (cloudpickle) the Hydra context, the
config and the task function into a Ray Train ``TorchTrainer`` whose workers unpickle them and call Hydra's
``run_job``, as the torchrun launcher's workers do.

What Ray Train gives each worker (measured with ray 2.60, Train V2): ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``NODE_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` in the environment, and a default process
group it has already created (``init_method="env://"``: world rank 0 hosts a TCPStore at ``MASTER_PORT``), gloo
without GPUs, nccl with ``use_gpu`` (``backend`` overrides). The task should use that group rather than make a
second one. The worker's working dir is a Ray session dir, not the launch dir.

``max_failures`` maps onto ``FailureConfig(max_failures)``: Ray starts a new worker group and runs the job again in
the same run dir, where the app resumes from its own latest checkpoint. A job that fails is reported to Hydra's
callbacks here (``on_job_end`` in the launching process) as ``LaunchError: job #N: rank R failed (after K
restart(s) allowed): <the worker's error, one line>``.
"""
from __future__ import annotations

import fnmatch
import logging
import os
import uuid
from pathlib import Path
from typing import Any, List, Optional, Sequence

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, configure_log, run_job, setup_globals
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from ._checks import check_ray_settings
from ._core import (
    LaunchError,
    _failed_return,
    _job_end_callbacks,
    _one_line,
    _run_job_check,
    launch_path,
    run_sequentially,
)
from .ray_config import RayLauncherConf

log = logging.getLogger(__name__)


def launch(launcher, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> List[JobReturn]:
    """Connect (or start a local cluster), run the jobs one after another, disconnect. Returns one
    :class:`JobReturn` per job run (fewer when ``stop_on_failure`` ends the sweep at a failed job)."""
    import time

    setup_globals()
    config = launcher.config
    configure_log(config.hydra.hydra_logging, config.hydra.verbose)
    import importlib.util

    if importlib.util.find_spec("ray") is None or importlib.util.find_spec("ray.train") is None:
        raise LaunchError("hydra/launcher=ray needs Ray Train, which is not installed: pip install 'ray[train]' "
                          "(hydratrain: pip install -e '.[ray]')")
    sweep_dir = launch_path(config, config.hydra.sweep.dir)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    started = connect(launcher.settings, _most_cpus(launcher, job_overrides))
    log.info("RayLauncher: %s in %.1f s; %d job(s) one after another, sweep dir %s",
             "started a local Ray cluster" if started else f"connected to {launcher.settings.get('address')}",
             time.monotonic() - t0, len(job_overrides), sweep_dir)
    try:
        return run_sequentially(launcher, job_overrides, initial_job_idx,
                                lambda cfg, num: run_one(launcher, cfg, num, sweep_dir))
    finally:
        if started:
            import ray

            ray.shutdown()


def _cpus(launcher_node) -> float:
    """The CPUs one job's workers ask Ray for: ``num_workers`` x ``resources_per_worker.CPU`` (default 1)."""
    values = launcher_node
    if OmegaConf.is_config(values):
        values = OmegaConf.to_container(values, resolve=True)
    return int(values.get("num_workers", 1)) * float((values.get("resources_per_worker") or {}).get("CPU", 1))


def _most_cpus(launcher, job_overrides: Sequence[Sequence[str]]) -> float:
    """The most CPUs any job of the sweep asks for, each job's own config composed (a swept ``launcher.num_workers``
    is per job; the sweep-level value is the default's); a job whose config does not compose counts as the sweep's
    (its own check fails it later)."""
    most = _cpus(launcher.settings)
    for overrides in job_overrides:
        try:
            job = launcher.hydra_context.config_loader.load_sweep_config(launcher.config, list(overrides))
            most = max(most, _cpus(job.hydra.launcher))
        except Exception:
            continue
    return most


def connect(settings: dict, cpus: Optional[float] = None) -> bool:
    """``ray.init`` for the sweep: the cluster at ``settings["address"]``, or a new local one (``num_cpus`` at
    least ``cpus``, the most one job's workers ask for (:func:`_most_cpus`), so a small machine still fits every
    job; Ray would wait for the CPUs of a bigger one forever). Environment variables named by ``forward_env`` go to
    every worker. Returns whether a local cluster was started (to shut down at the end). Does nothing when Ray is
    already initialised in this process."""
    import ray

    if ray.is_initialized():
        return False
    settings = {k: OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v
                for k, v in settings.items()}  # Hydra hands dict and list fields over as DictConfig / ListConfig
    kwargs = dict(settings.get("init_kwargs") or {})
    env = forwarded_env(settings.get("forward_env") or [], dict(os.environ))
    if env:
        runtime_env = dict(kwargs.pop("runtime_env", None) or {})
        runtime_env["env_vars"] = {**env, **(runtime_env.get("env_vars") or {})}
        kwargs["runtime_env"] = runtime_env
    address = settings.get("address")
    if address:
        ray.init(address=address, **kwargs)
        return False
    need = max(_cpus(settings), cpus or 0)
    kwargs.setdefault("num_cpus", max(os.cpu_count() or 1, int(-(-need // 1))))
    kwargs.setdefault("include_dashboard", False)
    ray.init(**kwargs)
    return True


def forwarded_env(patterns: Sequence[str], environ: dict) -> dict:
    """The variables of ``environ`` whose names match ``patterns`` (exact names, or shell-style globs such as
    ``HYDRATRAIN_*``)."""
    return {k: v for k, v in environ.items() if any(fnmatch.fnmatchcase(k, p) for p in patterns)}


def job_settings(sweep_config: DictConfig) -> RayLauncherConf:
    """This job's ``hydra.launcher`` node, resolved against the job's config and checked. Raises
    :class:`~._checks.LauncherConfigError` or OmegaConf's errors."""
    values = OmegaConf.to_container(sweep_config.hydra.launcher, resolve=True)
    conf = RayLauncherConf(**values)
    check_ray_settings(conf)
    return conf


def run_one(launcher, sweep_config: DictConfig, num: int, sweep_dir: Path) -> JobReturn:
    """Check this job, run it as a ``TorchTrainer``, wait; returns world rank 0's :class:`JobReturn`, or a FAILED
    one whose ``return_value`` raises (the check's exception, a settings error, or :class:`LaunchError` naming the
    failed rank and its error)."""
    import cloudpickle

    with read_write(sweep_config.hydra), open_dict(sweep_config.hydra):
        sweep_config.hydra.sweep.dir = str(sweep_dir)  # resolved here, once: every attempt of every worker agrees
        sweep_config.hydra.runtime.output_dir = str(sweep_dir / str(sweep_config.hydra.sweep.subdir))
    conf: Optional[RayLauncherConf] = None
    try:
        conf = job_settings(sweep_config)
        if conf.job_check:
            _run_job_check(conf.job_check, sweep_config)
        payload = cloudpickle.dumps((launcher.hydra_context, sweep_config, launcher.task_function,
                                     Singleton.get_state(), conf.worker_setup))
        storage = launch_path(sweep_config, conf.storage_path) if conf.storage_path else sweep_dir / ".ray"
        result = _trainer(conf, payload, storage, str(sweep_config.hydra.job.id)).fit()
        return cloudpickle.loads(result.return_value)
    except Exception as err:  # a settings error, the check's own error, or the run's failure: report, don't hang
        error = _launch_error(err, num, conf)
    ret = _failed_return(sweep_config, error)
    _job_end_callbacks(launcher, sweep_config, ret)
    return ret


def _trainer(conf: RayLauncherConf, payload: bytes, storage: Path, job_id: str):
    """The ``TorchTrainer`` of one job, keeping Ray Train's run state in ``storage``."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    return TorchTrainer(
        _worker, train_loop_config={"payload": payload},
        torch_config=TorchConfig(backend=conf.backend) if conf.backend else None,
        scaling_config=ScalingConfig(num_workers=conf.num_workers, use_gpu=conf.use_gpu,
                                     resources_per_worker=dict(conf.resources_per_worker) or None),
        run_config=RunConfig(name=f"{job_id}-{uuid.uuid4().hex[:8]}", storage_path=str(storage),
                             failure_config=FailureConfig(max_failures=conf.max_failures)))


def _launch_error(err: BaseException, num: int, conf: Optional[RayLauncherConf]) -> BaseException:
    """A one-line :class:`LaunchError` for Ray Train's failures (the lowest failed rank and its error); any other
    exception (a settings error, the job check's) as it is."""
    failures = getattr(err, "worker_failures", None)
    restarts = conf.max_failures if conf is not None else 0
    if failures:
        rank = min(failures)
        return LaunchError(f"job #{num}: rank {rank} failed (after {restarts} restart(s) allowed): "
                           f"{worker_error_line(failures[rank])}")
    if type(err).__module__.startswith("ray."):
        return LaunchError(f"job #{num}: {_one_line(err)}")
    return err


def worker_error_line(exc: Any) -> str:
    """One line for a worker's failure: the last ``Type: message`` line of a wrapped traceback (Ray puts the
    remote traceback in the message), else ``Type: message``."""
    text = str(exc).strip()
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    for line in reversed(lines):
        head = line.split(":", 1)[0]
        if ":" in line and head.replace(".", "").isidentifier() and head.split(".")[-1][:1].isupper() \
                and not line.startswith(("File ", "Traceback")):
            return line
    return f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def _worker(config: dict) -> bytes:
    """Entry point of every Ray Train worker: run the Hydra job on this rank (after the app's ``worker_setup``).
    A failed task's exception is re-raised so Ray Train sees the failure (and restarts the group while
    ``max_failures`` allows). Returns the :class:`JobReturn`, cloudpickled; Ray hands world rank 0's to ``fit``."""
    import cloudpickle
    from hydra.utils import get_method

    hydra_context, sweep_config, task_function, singleton_state, worker_setup = cloudpickle.loads(config["payload"])
    setup_globals()
    Singleton.set_state(singleton_state)
    if worker_setup:
        get_method(worker_setup)()
    ret = run_job(hydra_context=hydra_context, task_function=task_function, config=sweep_config,
                  job_dir_key="hydra.sweep.dir", job_subdir_key="hydra.sweep.subdir")
    if ret.status == JobStatus.FAILED:
        raise ret._return_value
    try:
        return cloudpickle.dumps(ret)
    except Exception as err:
        raise TypeError(f"the task function's return value ({type(ret._return_value).__name__}) cannot be sent "
                        f"back from the worker: {_one_line(err)}") from None
