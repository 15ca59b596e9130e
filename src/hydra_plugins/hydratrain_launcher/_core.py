"""The work behind :class:`TorchrunLauncher` (a module starting with ``_``: Hydra's plugin scan skips it).

Per job, in the launcher process: compose the job's config, read its ``hydra.launcher`` settings, run the app's
``job_check`` on it, then pickle (cloudpickle) the Hydra context, the config and the task function and hand them to
``elastic_launch``; each worker unpickles them and calls Hydra's ``run_job``, as Hydra's joblib and submitit launchers
do in their workers. Rendezvous: torch's ``c10d`` backend; with one node and no ``rdzv_endpoint`` the agent's store
binds port 0, i.e. the OS hands it a free port at bind time, so concurrent sweeps cannot collide.

A job that fails without its workers finishing ``run_job`` (a failed check, a port that cannot be had, a dead or
failing worker) is reported to Hydra's callbacks here: ``on_job_end`` runs in the launcher process (on node 0) with
the FAILED :class:`JobReturn`, after the workers are gone.
"""
from __future__ import annotations

import contextlib
import copy
import logging
import os
import signal
import socket
from pathlib import Path
from typing import Any, Callable, Iterator, List, Optional, Sequence

from hydra.core.hydra_config import HydraConfig
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, configure_log, filter_overrides, run_job, setup_globals
from hydra.errors import CompactHydraException
from omegaconf import DictConfig, OmegaConf, open_dict, read_write
from torch.distributed.elastic.multiprocessing.errors import record

from ._checks import LauncherConfigError, check_settings
from .config import TorchrunLauncherConf

log = logging.getLogger(__name__)


class LaunchError(CompactHydraException, RuntimeError):
    """A job's workers could not be started or did not finish (rendezvous failure, a worker that failed). Compact:
    when the sweeper raises it at the end of a sweep, Hydra prints its one line, not a traceback.

    ``ends_the_sweep``: True for the job that a signal to the launcher's process stopped (``_stop_the_sweep``),
    which ends the whole sweep with the launcher's own line and status; callbacks that say how a sweep ended (the
    app's sweep report) read it from the failed job's ``return_value`` in ``on_job_end``."""

    ends_the_sweep = False
    #: a worker that failed: its exit code (negative: the signal that ended it), and whether it recorded its error
    #: (its one line or traceback is then on the console already); None / False for a failure before any worker
    exitcode: Optional[int] = None
    said_by_worker = False


def launch(launcher, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> List[JobReturn]:
    """Run the jobs one after another; returns one :class:`JobReturn` per job run (fewer when ``stop_on_failure``
    ends the sweep at a failed job, whose exception the sweeper then raises)."""
    setup_globals()
    config = launcher.config
    configure_log(config.hydra.hydra_logging, config.hydra.verbose)
    sweep_dir = launch_path(config, config.hydra.sweep.dir)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    log.info("TorchrunLauncher: %d job(s) one after another, sweep dir %s", len(job_overrides), sweep_dir)
    return run_sequentially(launcher, job_overrides, initial_job_idx, lambda cfg, num: run_one(launcher, cfg, num))


def launch_path(config: DictConfig, value: Any) -> Path:
    """A path of the Hydra config (``hydra.sweep.dir``, a launcher setting) with ``~`` expanded and, when relative,
    resolved against the launch dir (``hydra.runtime.cwd``), as the jobs resolve it whatever ``hydra.job.chdir``."""
    path = Path(str(value)).expanduser()
    return path if path.is_absolute() else Path(str(config.hydra.runtime.cwd)) / path


def run_sequentially(launcher, job_overrides: Sequence[Sequence[str]], initial_job_idx: int,
                     run_one: Callable[[DictConfig, int], JobReturn]) -> List[JobReturn]:
    """Compose each job's config (numbered from ``initial_job_idx``) and hand it to ``run_one(config, num)``, one
    job after another, as Hydra's basic launcher numbers them; a FAILED job is logged in one line and, with
    ``launcher.stop_on_failure``, ends the loop. Returns the jobs' :class:`JobReturn` in order."""
    config = launcher.config
    runs: List[JobReturn] = []
    for offset, overrides in enumerate(job_overrides):
        num = initial_job_idx + offset
        log.info("\t#%d : %s", num, " ".join(filter_overrides(overrides)))
        sweep_config = launcher.hydra_context.config_loader.load_sweep_config(config, list(overrides))
        with open_dict(sweep_config):
            sweep_config.hydra.job.id = f"{sweep_config.hydra.job.name}_{num}"
            sweep_config.hydra.job.num = num
        ret = run_one(sweep_config, num)
        runs.append(ret)
        configure_log(config.hydra.hydra_logging, config.hydra.verbose)
        if ret.status == JobStatus.FAILED:
            log.error("job #%d failed: %s", num, _one_line(ret._return_value))
            if launcher.stop_on_failure:
                break
    return runs


def job_settings(sweep_config: DictConfig) -> TorchrunLauncherConf:
    """This job's ``hydra.launcher`` node, resolved against the job's config and checked.

    Raises :class:`LauncherConfigError` (a bad value) or OmegaConf's errors (an interpolation that does not resolve).
    """
    values = OmegaConf.to_container(sweep_config.hydra.launcher, resolve=True)
    conf = TorchrunLauncherConf(**values)
    check_settings(conf)
    return conf


def run_one(launcher, sweep_config: DictConfig, num: int) -> JobReturn:
    """Check this job, start its workers, wait for them; returns the :class:`JobReturn` of the lowest global rank
    on this node (rank 0's on the node that hosts it).

    Failures (bad settings, the app's check raising, a port that cannot be had, a rendezvous that timed out or
    failed, a worker that failed after ``max_restarts``) come back as a FAILED JobReturn whose ``return_value``
    raises: the check's own exception, :class:`LauncherConfigError`, or :class:`LaunchError` with a one-line reason
    (for a rendezvous, :func:`rendezvous_failure`'s). Ctrl-C / SIGTERM to this process (torch's ``SignalException``)
    ends the sweep: once the agent has passed the signal on to the workers and they are gone, the job is reported
    FAILED to the callbacks and this process exits with one line and ``preempt_exit_code`` (SIGTERM), 130 (SIGINT)
    or 128 + the signal.
    """
    import cloudpickle
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    job_dir = launch_path(sweep_config, sweep_config.hydra.sweep.dir) / str(sweep_config.hydra.sweep.subdir)
    with read_write(sweep_config.hydra.runtime), open_dict(sweep_config.hydra.runtime):
        sweep_config.hydra.runtime.output_dir = os.path.normpath(job_dir)
    conf: Optional[TorchrunLauncherConf] = None
    try:
        conf = job_settings(sweep_config)
        if conf.job_check:
            _run_job_check(conf.job_check, sweep_config)
        endpoint = _check_endpoint(conf)
        payload = cloudpickle.dumps((launcher.hydra_context, sweep_config, launcher.task_function,
                                     Singleton.get_state()))
        launch_cfg = LaunchConfig(
            min_nodes=conf.nnodes, max_nodes=conf.nnodes, nproc_per_node=conf.nproc_per_node,
            run_id=str(sweep_config.hydra.job.id),  # the same on every node (same sweep), new for every job
            rdzv_backend="c10d", rdzv_endpoint=endpoint,
            rdzv_configs={"is_host": conf.node_rank == 0, "timeout": conf.rdzv_timeout,
                          "join_timeout": conf.rdzv_timeout,
                          "read_timeout": conf.rdzv_timeout},  # also bounds a node waiting for node 0's store
            max_restarts=conf.max_restarts, monitor_interval=conf.monitor_interval, start_method=conf.start_method)
        with _signals_end_the_launch(), _quiet_child_tracebacks():
            values = elastic_launch(launch_cfg, _worker)(payload)
        return min(cloudpickle.loads(v) for v in values.values())[1]  # the lowest global rank's JobReturn
    except ChildFailedError as err:
        rank, failure = root_failure(err, conf.secondary_exit_codes)
        recorded = _recorded(failure)
        why = f"exit code {failure.exitcode}" + (f" ({failure.signal_name()})" if failure.exitcode < 0 else "")
        message = failure.message
        if isinstance(message, dict):  # the error file's {"message": ..., "extraInfo": ...}
            message = message.get("message", "")
        if recorded and str(message).strip():  # the worker's exception, written by @record
            why = str(message).strip().splitlines()[0] + (f" (exit status {failure.exitcode})"
                                                          if failure.exitcode > 1 else "")
        error: BaseException = LaunchError(f"job #{num}: rank {rank} failed (after {conf.max_restarts} restart(s) "
                                           f"allowed): {why}")
        error.exitcode, error.said_by_worker = failure.exitcode, recorded
    except SignalException as err:
        _stop_the_sweep(launcher, sweep_config, num, conf, err.sigval, before_workers=_BEFORE_WORKERS["signal"])
    except KeyboardInterrupt:  # Ctrl-C while this job was composed and checked, before the agent: no worker yet
        _stop_the_sweep(launcher, sweep_config, num, conf, signal.SIGINT, before_workers=True)
    except Exception as err:  # the check's own error, bad settings, a port, a rendezvous error: report, don't hang
        error = err
        if conf is not None and _is_rendezvous_error(err):
            error = LaunchError(rendezvous_failure(num, conf, err))
    ret = _failed_return(sweep_config, error)
    if conf is None or conf.node_rank == 0:
        _job_end_callbacks(launcher, sweep_config, ret)
    return ret


def _recorded(failure) -> bool:
    """Whether the worker recorded its error (its error file): torch gives one that did not a placeholder's data,
    ``{"message": "<NONE>"}``, and the message "To enable traceback see: ..."."""
    data = failure.error_file_data
    return isinstance(data, dict) and data.get("message") not in (None, "<NONE>")


def root_failure(err, secondary: Sequence[int] = ()) -> tuple:
    """``(global rank, ProcessFailure)`` of the failure that ended a job: torch's first failure (the earliest error
    file, its time stamped to the whole second; ties go to the lowest rank), except that a worker whose exit status
    is one of ``secondary`` (an app's "another rank failed first") is passed over for any worker that failed
    otherwise: the rank that failed and the peer that stopped because of it record in the same second, and the
    peer's status would stand for the failure."""
    rank, failure = err.get_first_failure()
    if failure.exitcode not in secondary:
        return rank, failure
    own = [(f.timestamp, r, f) for r, f in err.failures.items() if f.exitcode not in secondary]
    if not own:
        return rank, failure
    _, rank, failure = min(own, key=lambda t: (t[0], t[1]))
    return rank, failure


@contextlib.contextmanager
def _quiet_child_tracebacks() -> Iterator[None]:
    """torch's elastic process context logs, at ERROR, the traceback of its own wait (``ProcessExitedException``)
    when a worker exits non-zero: seven lines that say nothing of the worker's error, which the job's FAILED
    reason and the closing line give (with the exit code or signal). That logger is silenced for the launch."""
    logger = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


_BEFORE_WORKERS = {"signal": False}  # whether the signal that stopped the launch came before its workers started


@contextlib.contextmanager
def _signals_end_the_launch() -> Iterator[None]:
    """From here until the agent installs its own handlers (which do the same, once the workers exist), SIGTERM
    raises torch's ``SignalException`` instead of killing this process with 143 and nothing said: the job's
    composition, its check and the rendezvous take seconds. A SIGTERM recorded since the sweep's start
    (:func:`hydratrain.exits.keep_early_sigterm`) is raised at once. The handler in place before is restored after
    (between jobs, the record-only one)."""
    import signal

    from torch.distributed.elastic.multiprocessing.api import SignalException

    try:  # (hydratrain's early SIGTERM record, when the app is hydratrain: the plugin runs any app)
        from hydratrain.checkpoint.preemption import take_early_signal
    except ImportError:
        def take_early_signal():
            return None

    def raise_it(signum, frame):
        _BEFORE_WORKERS["signal"] = True
        raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))

    _BEFORE_WORKERS["signal"] = False
    early = take_early_signal()
    try:
        previous = signal.signal(signal.SIGTERM, raise_it)
        interrupt = signal.getsignal(signal.SIGINT)
        if interrupt is signal.default_int_handler:  # (Ctrl-C: as SIGTERM, unless the app has its own handler)
            signal.signal(signal.SIGINT, raise_it)
    except ValueError:  # not the main thread
        yield
        return
    try:
        if early is not None:
            raise_it(early, None)
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, interrupt)


def _stop_the_sweep(launcher, sweep_config: DictConfig, num: int, conf: Optional[TorchrunLauncherConf],
                    signum: int, before_workers: bool = False) -> None:
    """A signal to this process stopped job ``num`` (the agent passed it on to the workers, which are gone now; or,
    ``before_workers``, it came before any worker started): report the job FAILED to the callbacks (node 0), print
    one line and exit (SystemExit) with ``conf.preempt_exit_code`` for SIGTERM, 130 for SIGINT, else 128 +
    ``signum``."""
    import signal
    import sys

    name = signal.Signals(signum).name
    status = ((conf.preempt_exit_code if conf is not None else 75) if signum == signal.SIGTERM else 128 + signum)
    how = ("before its workers started" if before_workers else "which the agent passed on to the job's workers")
    sweep_dir = launch_path(sweep_config, sweep_config.hydra.sweep.dir)
    resume = resume_command(sweep_dir, Path(str(sweep_config.hydra.runtime.cwd)))
    error = LaunchError(f"job #{num}: stopped by {name}, {how}; to resume the sweep (each job continues from its own "
                        f"run dir): {resume}")
    error.ends_the_sweep = True
    # for a callback that ends the launch itself (one line of its own, as SystemExit): what the line would say
    error.exitcode, error.said_by_worker, error.signal_name, error.resume = status, not before_workers, name, resume
    if conf is None or conf.node_rank == 0:
        _job_end_callbacks(launcher, sweep_config, _failed_return(sweep_config, error))
    sys.stderr.write(f"TorchrunLauncher: sweep stopped: {error} (exit status {status})\n")  # one write: one line
    sys.stderr.flush()  # in a log other processes share
    raise SystemExit(status) from None


def resume_command(sweep_dir: Path, launch_dir: Path) -> str:
    """The command line that started this process (as typed: ``sys.orig_argv`` when it ends with ``sys.argv``, else
    ``python`` and ``sys.argv``) with ``hydra.sweep.dir=<sweep_dir>`` (relative to ``launch_dir`` when below it) in
    place of any it gave: the same command alone would sweep into a new, time-stamped dir and start every job over."""
    import re
    import shlex
    import sys

    argv, orig = list(sys.argv), list(getattr(sys, "orig_argv", None) or [])
    command = orig if argv and len(orig) > len(argv) and orig[-len(argv):] == argv else ["python", *argv]
    command = [a for a in command if not re.match(r"^\+{0,2}hydra\.sweep\.dir=", a)]
    try:
        shown = str(sweep_dir.resolve().relative_to(launch_dir.resolve()))
    except (OSError, ValueError):
        shown = str(sweep_dir)
    if not re.fullmatch(r"[A-Za-z0-9_./\-+:@%~]*", shown):  # as Hydra's override grammar reads it back
        shown = "'" + shown.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return shlex.join([*command, f"hydra.sweep.dir={shown}"])


def _run_job_check(path: str, sweep_config: DictConfig) -> None:
    """Call the app's check on a read-only copy of the job's task config (``hydra`` removed, as the task function
    gets it) while Hydra's config is this job's. The target goes through ``hydra.utils.instantiate`` so Hydra's
    target policy applies. Raises whatever the check raises."""
    from hydra.utils import instantiate

    try:
        check: Callable[[DictConfig], Any] = instantiate({"_target_": path, "_partial_": True})
    except Exception as err:
        raise LauncherConfigError("job_check", path, f"cannot be loaded: {_one_line(err)}") from None
    task_cfg = _task_config(sweep_config)
    OmegaConf.set_readonly(task_cfg, True)
    hydra_config = HydraConfig.instance()
    saved = hydra_config.cfg
    hydra_config.set_config(sweep_config)
    try:
        check(task_cfg)
    finally:
        hydra_config.cfg = saved


def _check_endpoint(conf: TorchrunLauncherConf) -> str:
    """This job's rendezvous endpoint; on the hosting node, fail fast if its fixed port cannot be bound."""
    if conf.rdzv_endpoint is None:
        return "127.0.0.1:0"
    endpoint = str(conf.rdzv_endpoint)
    host, _, port = endpoint.rpartition(":")
    host = host.strip("[]")
    if conf.node_rank == 0 and int(port) != 0:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            try:
                s.bind((host, int(port)))
            except OSError as err:
                raise LaunchError(f"hydra.launcher.rdzv_endpoint={endpoint}: node 0 cannot host the rendezvous "
                                  f"store on this port ({err.strerror}); pick a free port, or leave it null on one "
                                  "node") from None
    return endpoint


def _task_config(sweep_config: DictConfig) -> DictConfig:
    task_cfg = copy.deepcopy(sweep_config)
    with read_write(task_cfg), open_dict(task_cfg):
        del task_cfg["hydra"]
    return task_cfg


def _failed_return(sweep_config: DictConfig, error: BaseException) -> JobReturn:
    """A FAILED :class:`JobReturn` shaped like the one ``run_job`` makes (config without ``hydra``, Hydra config)."""
    ret = JobReturn(overrides=list(sweep_config.hydra.overrides.task), cfg=_task_config(sweep_config),
                    hydra_cfg=OmegaConf.masked_copy(sweep_config, "hydra"),
                    working_dir=str(sweep_config.hydra.runtime.output_dir), task_name=sweep_config.hydra.job.name,
                    status=JobStatus.FAILED)
    ret.return_value = error
    return ret


def _job_end_callbacks(launcher, sweep_config: DictConfig, ret: JobReturn) -> None:
    """Hydra callbacks' ``on_job_end`` for a job whose workers did not finish it, in this process, with Hydra's
    config set to the job's and its output dir created (as ``run_job`` does before calling them)."""
    Path(ret.working_dir).mkdir(parents=True, exist_ok=True)
    hydra_config = HydraConfig.instance()
    saved = hydra_config.cfg
    hydra_config.set_config(sweep_config)
    try:
        launcher.hydra_context.callbacks.on_job_end(config=sweep_config, job_return=ret)
    finally:
        hydra_config.cfg = saved


def _causes(err: BaseException) -> List[BaseException]:
    """``err`` and the exceptions behind it: its ``__cause__`` (``raise ... from``), else its ``__context__`` unless
    suppressed (``from None``), and so on."""
    chain: List[BaseException] = []
    while err is not None and not any(err is seen for seen in chain):
        chain.append(err)
        err = err.__cause__ if err.__cause__ is not None else (None if err.__suppress_context__ else err.__context__)
    return chain


def _one_line(err: BaseException) -> str:
    """``Type: message`` of ``err`` and of each exception behind it (first line of each), joined by ``; caused by``:
    torch's "See inner exception for details." shows the inner exception."""
    lines: List[str] = []
    for e in _causes(err):
        first = (str(e).strip().splitlines() or [""])[0].strip()
        if lines and first and first in lines[-1]:  # a wrapper that repeats its cause's message
            continue
        lines.append(f"{type(e).__name__}: {first}" if first else type(e).__name__)
    return "; caused by ".join(lines)


def _is_rendezvous_error(err: BaseException) -> bool:
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    return isinstance(err, RendezvousError) or "Rendezvous" in type(err).__name__


def _timed_out(err: BaseException) -> bool:
    """Whether ``err`` (a rendezvous error) is a wait that ran out: the rendezvous's own timeout, or a store that could
    not be reached in time (torch's "The client socket has timed out after ...")."""
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

    return any(isinstance(e, (RendezvousTimeoutError, TimeoutError)) or "timed out" in str(e).lower()
               for e in _causes(err))


def rendezvous_failure(num: int, conf: TorchrunLauncherConf, err: BaseException) -> str:
    """The one line for job ``num`` whose rendezvous raised ``err``: a wait for other nodes that ran out
    (``no rendezvous with all N node(s) within hydra.launcher.rdzv_timeout=...``, asking after the other nodes when
    there are any) or, for anything else (a store that could not be created: too many open files, an address that
    does not resolve), that the rendezvous failed; either way with the error and the errors behind it."""
    where = f"hydra.launcher.rdzv_endpoint={conf.rdzv_endpoint}"
    if _timed_out(err):
        ask = ""
        if conf.nnodes > 1:
            ask = (" (is node 0 running the same sweep?)" if conf.node_rank != 0 else
                   " (are the other nodes running the same sweep?)")
        return (f"job #{num}: {where}: no rendezvous with all {conf.nnodes} node(s) within "
                f"hydra.launcher.rdzv_timeout={conf.rdzv_timeout} s{ask}: {_one_line(err)}")
    return f"job #{num}: {where}: the rendezvous of {conf.nnodes} node(s) failed: {_one_line(err)}"


@record
def _worker(payload: bytes) -> bytes:
    """Entry point of every worker: run the Hydra job on this rank. A failed task's exception is re-raised, so the
    agent sees the failure (and restarts the workers when ``max_restarts`` allows) and ``@record`` hands it to the
    launcher; an error with an exit status (``hydratrain.errors``: its one line is on the console and in the log
    already) is recorded for the launcher and ends the worker with that status, without torch's multiprocessing
    traceback. Returns ``(global rank, JobReturn)``, cloudpickled (the task's return value may be a closure)."""
    import sys

    import cloudpickle

    hydra_context, sweep_config, task_function, singleton_state = cloudpickle.loads(payload)
    setup_globals()
    Singleton.set_state(singleton_state)
    ret = run_job(hydra_context=hydra_context, task_function=task_function, config=sweep_config,
                  job_dir_key="hydra.sweep.dir", job_subdir_key="hydra.sweep.subdir")
    if ret.status == JobStatus.FAILED:
        err = ret._return_value
        status = getattr(err, "exit_status", None)
        if isinstance(status, int) and status > 0:
            from torch.distributed.elastic.multiprocessing.errors import get_error_handler

            get_error_handler().record_exception(err)  # the launcher's one line names it
            sys.exit(status)
        raise err
    try:
        return cloudpickle.dumps((int(os.environ.get("RANK", "0")), ret))
    except Exception as err:
        raise TypeError(f"the task function's return value ({type(ret._return_value).__name__}) cannot be sent "
                        f"back from the worker: {_one_line(err)}") from None
