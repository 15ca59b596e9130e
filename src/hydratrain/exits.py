"""How a launch ends: one line and one exit status (``hydratrain.errors``), whatever stopped it.

:func:`end` turns what ended ``hydratrain.run.main`` (an error of ours, any other exception, Ctrl-C, a preemption
signal that came first) into the line and the status; :func:`leave` undoes what the launch set up for its end
(signal handlers, the run-dir lock) on every path. In a Hydra multirun an error is re-raised instead, so Hydra records
the job as failed and the sweep goes on, while a preemption or Ctrl-C ends the whole sweep. :func:`composing` and
:func:`end_composition` do the same for an error Hydra finds while it composes the config (an unknown key or
option, a wrong type): one line, ``hydratrain: config error: ...``, and exit status 2, printed once per node under
torchrun. Under torch's elastic agent the line also goes to the rank's error file (``TORCHELASTIC_ERROR_FILE``),
so that torchrun's failure summary shows it as the root cause's traceback.

A sweep ends here too: the one line and status of one run that the torchrun launcher made a sweep of one job
(:func:`end_one_run`), the report and closing line after its last job (:func:`end_of_sweep`) or, whatever launcher
ran the jobs, at the exit of the sweeping process (:func:`await_the_end`), and the record of a job that stopped the
whole sweep (:func:`record_stopped_job`). The sweep's Hydra callback (``hydratrain.sweep``) calls them.
"""
from __future__ import annotations

import atexit
import logging
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Optional

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from hydratrain.checkpoint.preemption import (
    early_guard,
    end_guard,
    recorded_preemption,
    release_sigterm,
    take_early_signal,
)
from hydratrain.dist.env import env_rank
from hydratrain.dist.launch import _COMPOSING, LauncherGoneError, composing, launcher_gone_error, resume_command  # noqa: F401 (run.py calls exits.composing)
from hydratrain.dist.process_group import PeerFailedError
from hydratrain.dist.run_dir import (
    MULTIRUN_MARK,
    _read_json,
    _sweep_dir,
    discard_if_unused,
    in_multirun,
    resume_hint,
    run_dir_of,
)
from hydratrain.errors import (
    EXIT_CONFIG,
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    HydratrainError,
    PreemptedError,
    root_cause,
    say,
)
from hydratrain.sweep_report import (
    LEFT_BY_A_REFUSED_JOB,
    _job_dir,
    closing_line,
    log_report,
    write_job_status,
    write_sweep_report,
)

log = logging.getLogger("hydratrain")


def end(err: BaseException, env) -> None:
    """End the launch for ``err`` (raised in ``main``; ``env``: the rank's ``DistInfo``, None before it is known):
    print one line (once per node when every rank has the same one), log it, and raise ``SystemExit`` with its status,
    or re-raise ``err`` inside a multirun (Hydra records the job as failed). A rank that received a preemption signal
    ends as preempted and one that received Ctrl-C as interrupted, whatever error followed."""
    end_guard()  # a torchrun worker lingering below is stopped by its agent's SIGTERM, not preempted
    if isinstance(err, PeerFailedError) or not isinstance(err, (HydratrainError, SystemExit)):
        # after its launcher died: the peers stopping alike, or the parent-death SIGINT that torch's spawn asks for
        # (launcher=torchrun's workers)
        err = launcher_gone_error(f"when it died ({type(err).__name__} followed)") or err
    if isinstance(err, HydratrainError):
        _end_with_error(err, env)
    if isinstance(err, SystemExit):
        raise
    if recorded_preemption() is not None:  # the error came after this rank's preemption signal
        log.info("after the preemption signal: %s: %s", type(err).__name__, str(err).splitlines()[:1])
        end_preempted(recorded_preemption(), env)
    if not (isinstance(err, Exception) or _interrupted(err)):
        raise
    if _interrupted(err):  # this rank's Ctrl-C, or a peer's end that it caused in a collective here
        _stop_interrupted(env)
    log.exception("rank %d failed", env.rank if env else 0)
    release_sigterm()
    if in_multirun():
        raise
    first = (str(err).strip().splitlines() or [""])[0]
    tell_the_agent(f"{type(err).__name__}: {first}" if first else type(err).__name__)
    raise SystemExit(EXIT_ERROR) from None


def _end_with_error(err: HydratrainError, env) -> None:
    """:func:`end` for one of our errors: its one line (``hydratrain: <label>: <message>``) and its exit status."""
    if _SIGINT["received"] and not isinstance(err, LauncherGoneError):  # e.g. a peer's end, which the same Ctrl-C
        _stop_interrupted(env)  # caused
    if recorded_preemption() is not None:  # its own PreemptedError (rebuilt: OmegaConf may have added context
        end_preempted(recorded_preemption(), env)  # to it), or what followed the signal (a peer left first)
    if env is None or env.local_rank == 0 or not (  # the same on every rank: each node's first rank says it
            err.exit_status == EXIT_CONFIG or getattr(err, "same_on_every_rank", False)):
        say(f"hydratrain: {err.label}: {err}" + (resume_hint(err.resume_hint) if _says_how_to_resume(err, env) else ""))
    log.error("hydratrain: %s: %s", err.label, err, extra={"file_only": True})
    release_sigterm()
    if in_multirun():
        # a peer's stop waits for the rank that failed to leave first here too (the torchrun launcher, like torchrun,
        # takes the first worker to exit for the job's failure)
        time.sleep(getattr(err, "linger_s", 0.0))
        raise  # Hydra records the job as failed and the sweep goes on
    tell_the_agent(f"hydratrain: {err.label}: {err}")
    if err.exit_status == EXIT_CONFIG and (env is None or env.world_size == 1) and not _refused_by_lock(err):
        # a default run dir this launch made for a run that never started (one process: with several, the others
        # may still be writing their logs there)
        discard_if_unused(run_dir_of())
    # a PeerFailedError: the rank that failed first leaves first; a config error (alike on every rank): under
    # torchrun, rank 0, which printed it, leaves first, so that the agent reports it as the root cause (status 2);
    # the agent ends this rank as soon as rank 0 has left, so the wait only bounds a rank 0 that is slow to exit
    # (on a loaded 2-core machine 2 s was not enough)
    shared = (err.exit_status == EXIT_CONFIG and env is not None and env.rank != 0
              and "TORCHELASTIC_RUN_ID" in os.environ)
    time.sleep(getattr(err, "linger_s", 0.0) or (10.0 if shared else 0.0))
    raise SystemExit(err.exit_status) from None


def tell_the_agent(line: str) -> None:
    """Under torch's elastic agent (torchrun), write ``line`` as this rank's failure into the error file the agent
    gave it (``TORCHELASTIC_ERROR_FILE``): the agent's failure summary then shows it as the traceback of the root
    cause (else: "To enable traceback see: ..."). Nothing elsewhere, or in a sweep (the launcher records the job's
    error itself). Raises nothing."""
    import json

    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or in_multirun():
        return
    try:
        with open(path, "w") as f:  # the layout of torch's own ErrorHandler.record_exception, which it expects
            json.dump({"message": {"message": line, "extraInfo": {"py_callstack": line,
                                                                  "timestamp": str(int(time.time()))}}}, f)
    except OSError:
        pass


def end_composition(err: BaseException, job: str = "") -> None:
    """End the launch for ``err``, raised while Hydra composed the config (:func:`composing`), when it is Hydra's or
    OmegaConf's composition error: ``hydratrain: config error: <Hydra's reason in one line>`` (each node's first rank
    prints it: every rank composes the same config), exit status 2; under torchrun the other ranks leave after rank 0,
    which the agent then names as the root cause. Returns (raising nothing) for any other error, or when the config
    was composed already. ``job``: what the line says after ``hydratrain: `` (a sweep's ``job N: ``)."""
    if not _COMPOSING["on"] or not (type(err).__module__.startswith(("hydra.", "omegaconf.")) or _raised_by_hydra(err)):
        return
    composing(False)
    line = f"hydratrain: {job}config error: {composition_error_line(err)}"
    if os.environ.get("LOCAL_RANK", "0") in ("", "0"):
        say(line)
    tell_the_agent(line)
    if os.environ.get("RANK", "0") not in ("", "0") and "TORCHELASTIC_RUN_ID" in os.environ:
        time.sleep(10.0)  # rank 0, which says it, leaves first: the agent's root cause (it stops this rank then)
    raise SystemExit(EXIT_CONFIG) from None


def _raised_by_hydra(err: BaseException) -> bool:
    """A plain ``ValueError``/``TypeError`` raised inside Hydra or OmegaConf (``data=10``: "Config group override
    must be a string or a list. Got int"): a composition error too."""
    import traceback

    frames = traceback.extract_tb(err.__traceback__)
    return isinstance(err, (ValueError, TypeError)) and bool(frames) and any(
        part in frames[-1].filename for part in (f"{os.sep}hydra{os.sep}", f"{os.sep}omegaconf{os.sep}"))


def composition_error_line(err: BaseException) -> str:
    """A Hydra composition error in one line: its first line, the first line of its cause (OmegaConf's reason,
    ``Key 'bad' not in 'TrainConfig'``, ``Value 'abc' of type 'str' could not be converted to Float``), Hydra's hint
    (``to append to your config use +bad=1``) and a missing option's alternatives."""
    text = str(err)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    line = lines[0] if lines else type(err).__name__
    if err.__cause__ is not None and str(err.__cause__).strip():
        line = f"{line.rstrip('.')}: {str(err.__cause__).strip().splitlines()[0]}"
    hints = [ln for ln in lines[1:] if ln.startswith("To ")]
    if hints:
        line += f" ({hints[0][0].lower()}{hints[0][1:].rstrip('.')})"
    if "Config group override must be a string" in text:
        line += (" (an option name that Hydra's grammar reads as a number, as in data=10 or loss=nan, needs quotes: "
                 "data=\"'10'\")")
    if "Available options in" in text:
        options = [o.strip() for o in text.split("Available options in", 1)[1].split("Config search path")[0]
                   .splitlines()[1:] if o.strip()]
        line += f" (available: {', '.join(options)})"
    if line.endswith("raised while composing config:") and len(lines) > 1:  # its reason is on the next line
        line = f"{line} {lines[1]}"
    return line + _experiment_hint(f"{text}\n{err.__cause__ or ''}")


def _experiment_hint(text: str) -> str:
    """How to write the experiment file behind two of Hydra's composition errors that do not say it: an ``override
    /<group>`` in a file without ``# @package _global_`` on its first line ("Could not override
    'loss@experiment.loss'"), and a ``_target_`` node written over a built-in option's typed node ("Key '_target_'
    not in 'PythonStdlibData'", full_key ``data._target_``): Hydra merges into the option the defaults chose."""
    if re.search(r"Could not override '[\w.]+@experiment\.", text):
        return " (an experiment file must begin with the line '# @package _global_')"
    target = re.search(r"full_key: (\w+)\._target_", text)
    if "Key '_target_' not in" in text and target:
        group = target.group(1)
        return (f" (a {group} node with _target_ replaces the built-in {group} option: add '- override /{group}: "
                f"null' to the experiment's defaults list, or put the node in <config dir>/{group}/NAME.yaml and "
                f"choose it with {group}=NAME)")
    return ""


def _says_how_to_resume(err, env) -> bool:
    """Whether this rank's line carries the resume command: rank 0's, or rank 1's when rank 0 is the rank that failed
    (killed, out of memory: it says nothing more)."""
    if env is None or env.world_size == 1:
        return True
    return env.rank == (1 if getattr(err, "failed_rank", None) == 0 else 0)


def leave(save_on_sigterm: bool, lock) -> None:
    """On every way out of ``main``: restore the signal handlers the launch replaced, re-arm a sweep's early SIGTERM
    record between jobs (:func:`keep_early_sigterm`; ``save_on_sigterm``:
    ``checkpoint.save_on_sigterm``) and release the run-dir ``lock`` (None when not taken)."""
    end_guard()
    release_sigterm()
    watch_interrupts(False)
    if in_multirun():
        keep_early_sigterm(HydraConfig.get(), save_on_sigterm)  # type: ignore[arg-type]  # a DictConfig at run time
    if lock is not None:
        lock.release()


def end_preempted(err: PreemptedError, env) -> None:
    """One line (rank 0's, its rank in the environment before the process group: a preemption is not an error, so
    the other ranks do not repeat it, and a worker that torchrun stops after another failed does not call it a
    preemption) and ``err``'s exit status; in a sweep the whole sweep stops."""
    if (env.rank if env is not None else env_rank()) == 0:
        say(f"hydratrain: {err.label}: {err}")
    log.error("hydratrain: %s: %s", err.label, err, extra={"file_only": True})
    tell_the_agent(f"hydratrain: {err.label}: {err}")
    if in_multirun():
        end_the_sweep(err.exit_status, f"{err.label}: {err}")
    raise SystemExit(err.exit_status) from None


_SIGINT: dict[str, Any] = {"received": False, "previous": None}


def watch_interrupts(on: bool = True) -> None:
    """While a run is on, note a SIGINT before Python raises KeyboardInterrupt for it, so that an error it causes
    first (a collective a peer left because of the same Ctrl-C) still reads as the interruption. Leaves a handler
    other than Python's default alone."""
    import signal

    try:
        if on and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            _SIGINT.update(received=False, previous=signal.signal(signal.SIGINT, _on_sigint))
        elif not on and _SIGINT["previous"] is not None:
            signal.signal(signal.SIGINT, _SIGINT["previous"])
            _SIGINT["previous"] = None
    except ValueError:  # not the main thread
        pass


def _on_sigint(signum, frame) -> None:
    _SIGINT["received"] = True
    raise KeyboardInterrupt


def _interrupted(err: BaseException) -> bool:
    """Ctrl-C ended ``err``'s work: a KeyboardInterrupt, DCP's CheckpointException around one, or any error after
    this rank received SIGINT."""
    if _SIGINT["received"] or isinstance(err, KeyboardInterrupt):
        return True
    if getattr(err, "failures", None) is None:
        return False
    return isinstance(root_cause(err), KeyboardInterrupt)


def _stop_interrupted(env) -> None:
    """One line (rank 0), exit status :data:`EXIT_INTERRUPTED`; in a sweep the whole sweep stops."""
    why = ("interrupted (SIGINT, Ctrl-C): stopped without saving (a checkpoint save it cut short is discarded at the "
           f"next start); to resume from the latest checkpoint: {resume_command()}")
    if env is None or env.rank == 0:
        say(f"hydratrain: {why}")
    log.error("hydratrain: %s", why, extra={"file_only": True})
    tell_the_agent(f"hydratrain: {why}")
    if in_multirun():
        end_the_sweep(EXIT_INTERRUPTED, why)
    raise SystemExit(EXIT_INTERRUPTED) from None


def end_interrupted_launch() -> None:
    """Ctrl-C reached the launching process outside any run's handling of it (Hydra composing the config, a
    launcher starting a sweep's job): one line and :data:`EXIT_INTERRUPTED`, not the ``KeyboardInterrupt``
    traceback; for a sweep, the command that goes on with it. Raises ``SystemExit``."""
    sweep_dir = launched_sweep_dir()
    sweep_ended()  # this line ends it
    if sweep_dir is not None:
        say("hydratrain: interrupted (SIGINT, Ctrl-C) outside the sweep's jobs; to go on with it: "
            f"{resume_command(sweep_dir, sweep=True)}")
    else:
        say("hydratrain: interrupted (SIGINT, Ctrl-C) before the run started: nothing was trained")
    raise SystemExit(EXIT_INTERRUPTED) from None


def end_the_sweep(status: int, why: str) -> None:
    """A job that ends its whole multirun (a preemption signal, Ctrl-C): record it in the sweep report, which Hydra's
    ``on_job_end`` would not do, and exit with ``status`` (SystemExit passes through Hydra; a relaunch of the same
    command runs this job again)."""
    record_stopped_job(why)
    raise SystemExit(status) from None


def after_preemption(status: int) -> None:
    """A run that a preemption signal stopped after saving (``Preemption.stopping`` logged the checkpoint and the
    command that resumes) exits with ``status`` (``checkpoint.preempt_exit_code``); in a multirun that ends the
    whole sweep (:func:`end_the_sweep`)."""
    if in_multirun():
        end_the_sweep(status, f"preempted: stopped by a preemption signal after saving a checkpoint; to resume: "
                      f"{resume_command()}")
    raise SystemExit(status)


def _refused_by_lock(err: HydratrainError) -> bool:
    """A config error about the run dir itself (held by another job): that dir is not this launch's to remove
    (unless the error says it is: ``discard_run_dir``)."""
    return getattr(err, "key", "") in ("hydra.run.dir", "hydra.sweep.dir", "hydra.sweep.subdir") and \
        not getattr(err, "discard_run_dir", False)


# -- the end of a sweep: the one-run launch's line and status, the closing line, the exit hook, a stopped job ----------

#: launchers (``hydra.launcher._target_``) that take a SIGTERM recorded between jobs: Hydra's basic launcher (jobs
#: in this process: the next job's guard raises it) and the torchrun plugin (raised before it starts the workers)
_TAKE_EARLY_SIGTERM = ("BasicLauncher", "hydratrain_launcher.torchrun_launcher.TorchrunLauncher")


def keep_early_sigterm(hydra_cfg: DictConfig, save_on_sigterm: bool) -> None:
    """Between the jobs of a sweep, SIGTERM is recorded, as :func:`hydratrain.checkpoint.preemption.early_guard`
    does before the first composition, instead of killing the sweep with 143 and nothing said while Hydra composes
    the next job (seconds on a loaded machine); the next job then ends the sweep as preempted: its guard when it runs
    in this process (Hydra's basic launcher; Optuna's sweeper uses it too), the torchrun plugin before it starts the
    job's workers. Called at the sweep's start and when each job's ``hydratrain.run.main`` ends; not with
    ``checkpoint.save_on_sigterm=false`` (the default action stays), nor for other launchers (Ray, submitit: their
    own handling)."""
    target = str(hydra_cfg.get("launcher", {}).get("_target_"))
    if save_on_sigterm and any(t in target for t in _TAKE_EARLY_SIGTERM):
        early_guard()


def end_one_run(err: BaseException, sweep_dir: Path) -> None:
    """End the launch of one run (:func:`hydratrain.sweep.callback.launched_as_one_run`) whose job failed with ``err``,
    in the launcher's process: raise ``SystemExit`` with the status the run would have had under plain ``torchrun`` or
    one process (the failed worker's exit status; 128 + the signal that killed it; a config error found before the
    workers started: 2, :data:`hydratrain.errors.EXIT_CONFIG`), after the error's one line unless a worker has said it.
    A config error leaves no dir behind, as in a run: ``sweep_dir``, when this launch made it and it holds only the
    sweep's records of the refused job, is removed."""
    code = getattr(err, "exitcode", None)
    if isinstance(code, int):
        status = code if code > 0 else 128 - code
        if not getattr(err, "said_by_worker", False):
            say(f"hydratrain: {err}")
    elif isinstance(err, HydratrainError):
        status = err.exit_status
        say(f"hydratrain: {err.label}: {err}")
    elif type(err).__name__ == "LauncherConfigError":  # (the plugin's own: it knows no app)
        status = EXIT_CONFIG
        say(f"hydratrain: config error: {err}")
    else:
        status = EXIT_ERROR
        say(f"hydratrain: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
    if status == EXIT_CONFIG and code is None:
        discard_if_unused(sweep_dir, left=LEFT_BY_A_REFUSED_JOB)
    raise SystemExit(status)


def end_one_run_by_signal(err: BaseException) -> None:
    """End one run (:func:`hydratrain.sweep.callback.launched_as_one_run`) that a signal to the launcher's process
    stopped (``err``: the launcher's error for it): its workers said the run's line (interrupted, preempted: with the
    command that resumes) when they had started, so nothing more is said; before them, one line. Raises ``SystemExit``
    with the signal's status."""
    status = getattr(err, "exitcode", None)
    if not isinstance(status, int):
        return  # (not the torchrun launcher's: its own line)
    if not getattr(err, "said_by_worker", False):
        kind = "preempted" if getattr(err, "signal_name", "") == "SIGTERM" else "interrupted"
        say(f"hydratrain: {kind}: {getattr(err, 'signal_name', 'a signal')} before the run's workers started: "
            f"nothing was trained; to go on: {getattr(err, 'resume', 'the same command')}")
    raise SystemExit(status)


def end_of_sweep(sweep_dir: Path, chart: bool = True) -> None:
    """The end of a sweep (its last job, or ``on_multirun_end``): refresh the report (its chart too, unless not
    ``chart``: one run launched as a sweep of one job) and log it; exit with status 1 and one line when any job
    failed."""
    sweep_ended()
    log_report(sweep_dir, chart)
    line = closing_line(sweep_dir)
    if line:
        raise SystemExit(line)


#: the sweep this process launched and whose end is still to be said: {"pid": ..., "sweep_dir": Path}; "hooked":
#: whether :func:`end_of_process` is registered with ``atexit`` (once per process)
_AWAITED: dict = {}


def await_the_end(sweep_dir: Path) -> None:
    """Make sure that a sweep with a failed job ends with its report and the closing line (:func:`end_of_sweep`)
    whatever launcher ran its jobs. Called once per multirun by the sweeping process (``on_multirun_start``, rank 0 of
    node 0); :func:`sweep_ended` takes it back on every way a sweep ends with a line of ours (the closing line after
    the last job or in ``on_multirun_end``, a search stopped early, a preemption or Ctrl-C that stopped a job), and
    :func:`end_of_process`, an ``atexit`` hook, says the end for a sweep that ended otherwise.

    Why at the exit of this process: with Hydra's basic sweeper, a sweep whose jobs include a failure ends with the
    sweeper raising the first failure once the launcher has returned, so ``on_multirun_end`` never runs; and when
    the jobs run in other processes nothing of ours runs in this one after the last job: the torchrun and Ray
    plugins call ``on_job_end`` here only for a job that failed without its workers reporting it,
    hydra-submitit-launcher never (so no report and no closing line when the last job completed). The
    launchers' return is no place to hook either: hydra-submitit-launcher's is not ours, and the torchrun plugin
    knows no app. The exit of this process is the one point every launcher and sweeper reaches after the last job,
    and after Hydra has printed the failure, so the report and the line come last. An exit hook runs on
    ``sys.exit`` and on an uncaught exception; not when a signal kills the process or on ``os._exit`` (the workers
    that ``multiprocessing`` forks leave that way; the pid check is for such a copy). It cannot change the exit
    status, and need not: a sweeper that returns calls ``on_multirun_end``, which ends the sweep itself, so with a
    failed job this process only gets here through Hydra's error exit, status 1. A sweep ended by Ctrl-C outside any
    job (Python's ``KeyboardInterrupt`` traceback) is left as it is."""
    if not _AWAITED.get("hooked"):
        atexit.register(end_of_process)
        _AWAITED["hooked"] = True
    _AWAITED.update(pid=os.getpid(), sweep_dir=Path(sweep_dir))


def launched_sweep_dir() -> Optional[Path]:
    """The dir of the sweep this process launched and whose end is still to be said, or None."""
    return _AWAITED.get("sweep_dir") if _AWAITED.get("pid") == os.getpid() else None


def sweep_ended() -> None:
    """The sweep this process launched ended with a line of ours (or its own launcher's): nothing to add at exit."""
    _AWAITED.pop("sweep_dir", None)


def end_of_process() -> None:
    """At the exit of the sweeping process (``atexit``; see :func:`await_the_end`): when its sweep ended with no line
    of ours and its report has a FAILED row, log the report and print the closing line. Does nothing in another
    process (a forked copy), after Ctrl-C, or when :func:`sweep_ended` was called. Never raises."""
    sweep_dir = _AWAITED.pop("sweep_dir", None)
    if sweep_dir is None or _AWAITED.get("pid") != os.getpid() or isinstance(getattr(sys, "last_value", None),
                                                                           KeyboardInterrupt):
        return
    try:
        take_early_signal()  # as on_multirun_end: every job has ended
        line = closing_line(sweep_dir)
        if line:
            log_report(sweep_dir)
            say(line)
    except Exception as err:  # noqa: BLE001 (the process is ending with its own status; one line, no traceback)
        say(f"hydratrain: could not write the sweep report in {sweep_dir}: {type(err).__name__}: {err}")


def record_stopped_job(why: str) -> None:
    """Record this multirun job as FAILED with ``why`` in its ``status.json`` and refresh the sweep report and its
    chart (rank 0 of node 0), for a job that ends the whole sweep (a preemption signal, Ctrl-C) before Hydra's
    ``on_job_end`` runs. Its dir's ``results.json``, if any, is an earlier launch's. Does nothing outside a multirun."""
    if env_rank() != 0 or not HydraConfig.initialized():
        return
    hc = HydraConfig.get()
    if hc.mode != RunMode.MULTIRUN:
        return
    sweep_ended()  # the caller's line ends the sweep
    sweep_dir = _sweep_dir(hc)
    job_dir = _job_dir(hc)
    write_job_status(job_dir, hc.job.num, list(hc.overrides.task), "FAILED", why, math.nan,
                     _read_json(sweep_dir / MULTIRUN_MARK).get("id"), results_current=False)
    write_sweep_report(sweep_dir, chart=True)
