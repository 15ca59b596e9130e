"""The launch this process belongs to: the command that started it, so the command that resumes it, and the process
that launched it, whose death stops this rank.

- :func:`note_launcher` records this process's parent (its pid and command line) as early as the process can
  (``train.py``, then :func:`hydratrain.run.main`), before that parent can be gone.
- :func:`launch_command`: the command line as typed: ``torchrun [options] train.py ARGS`` in a torchrun rank (its
  agent's command line), ``python train.py ARGS`` otherwise.
- :func:`resume_command`: that command with ``hydra.run.dir=<this run's dir>`` (a sweep: ``hydra.sweep.dir=``) in
  place of any given: the command that resumes this run, which the same command without it would not (a default,
  time-stamped run dir is a new one at every launch). Every line that tells the user how to resume prints it.
- :func:`launcher_gone`: whether the torch elastic agent that started this rank has died (``kill -9`` of
  ``torchrun``, the OOM killer, a dying shell): it passes no signal on then, and a rank that trained on would write
  and prune checkpoints and hold the run dir against the relaunch.
- :func:`end_within`: a deadline no hung thread can hold off, for a rank that is ending for its launcher.

Importing this module imports neither torch nor Hydra.
"""
from __future__ import annotations

import logging
import os
import re
import shlex
import sys
import time
from pathlib import Path
from typing import Any, List, Optional

from hydratrain.errors import EXIT_PEER_FAILED, HydratrainError, write_refusal
from hydratrain.paths import resolve_path

log = logging.getLogger(__name__)

_LAUNCHER: dict = {}  # this process's parent when first noted: {"pid": int, "cmdline": list of str, or None}
_COMPOSING = {"on": False}  # Hydra raises, rather than prints, its errors until the config is composed
_DEADLINE: dict = {}  # end_within's: {"at": time.monotonic() of the end, "file": where the stacks go}


class LauncherGoneError(HydratrainError):
    """The torch elastic agent that started this rank died without stopping it (it passes no signal on when it is
    SIGKILLed). The rank stops at its next step or write (:func:`stop_if_launcher_gone`), with exit status 5: nothing
    waits for it any more, and its peers, whose launcher died too, stop alike."""

    label = "stopped"
    exit_status = EXIT_PEER_FAILED
    own_failure = True  # each rank sees its own parent gone
    same_on_every_rank = True  # every rank of the node stops for it: its first rank says it
    resume_hint = "to resume from the latest checkpoint"


def note_launcher() -> None:
    """Record this process's parent pid and, where ``/proc`` shows it, its command line; once per process (later
    calls keep the first record). Call as early as possible: a parent that dies first is not seen to die."""
    if not _LAUNCHER:
        pid = os.getppid()
        _LAUNCHER.update(pid=pid, cmdline=_cmdline(pid))


def _cmdline(pid: int) -> Optional[List[str]]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:  # not Linux, or hidden
        return None
    return [os.fsdecode(part) for part in raw.split(b"\0")[:-1]] or None


def under_elastic_agent() -> bool:
    """Whether torch's elastic agent (``torchrun``, or hydratrain's ``launcher=torchrun``) started this process."""
    return bool(os.environ.get("TORCHELASTIC_RUN_ID"))


def launcher_gone() -> Optional[str]:
    """Who launched this rank, e.g. ``torchrun (pid 4242)``, when that process has died since :func:`note_launcher`
    (the rank has another parent now); else None. Only for ranks of torch's elastic agent, whose ranks are its own
    children and which stops them itself while it lives; elsewhere (one process, SLURM tasks, Ray workers) None.
    Costs one ``getppid`` call: cheap enough for every step. Raises nothing."""
    if not _LAUNCHER or not under_elastic_agent():
        return None
    pid = _LAUNCHER["pid"]
    if pid <= 1 or os.getppid() == pid:
        return None
    return f"{_launcher_name()} (pid {pid})"


def stop_if_launcher_gone(where: str) -> None:
    """Raise :class:`LauncherGoneError` when this rank's launcher has died (:func:`launcher_gone`); ``where`` says
    what the rank stopped before (``before step 21``, ``before saving step 20``). Called where a rank is about to
    train a step or write or prune a checkpoint or the run's outputs, so that nothing is written after its launcher
    died, and the run dir is released at once for the relaunch."""
    err = launcher_gone_error(where)
    if err is not None:
        raise err


def launcher_gone_error(where: str) -> Optional["LauncherGoneError"]:
    """The :class:`LauncherGoneError` of a rank whose launcher has died, stopped ``where``; None while it lives."""
    who = launcher_gone()
    if who is None:
        return None
    return LauncherGoneError(f"{who} is gone: it died without stopping this rank (kill -9, the OOM killer, a closed "
                             f"terminal), so the rank stopped {where}, writing and pruning nothing after that, and "
                             "left its run dir")


def end_within(seconds: float) -> None:
    """End this process within ``seconds`` if it is still running then, whatever its threads are doing:
    ``faulthandler``'s watchdog, a C thread that needs no GIL, writes every thread's stack to this rank's log file
    (``train_rank<R>.log``; stderr without one) and calls ``_exit(1)``. For a rank that is ending for its launcher
    (gone, so nothing waits for the rank any more, or a SIGINT from it): its end can block in C++ with the GIL held,
    where no Python thread (:class:`~hydratrain.dist.process_group.FailureWatch` included) ever runs again: freeing
    the process group (``~ProcessGroupGloo``, as the error's frames are freed) joins gloo's worker threads, one of
    which waits for that GIL to free the tensors of a collective the peer left. A process that ends first is not
    affected; the deadline cannot be lifted, and a later call keeps an earlier one. Raises nothing."""
    import faulthandler

    at = time.monotonic() + seconds
    if _DEADLINE and _DEADLINE["at"] <= at:
        return
    try:
        file = _DEADLINE.get("file") or _log_file()
        faulthandler.dump_traceback_later(max(seconds, 0.01), exit=True, file=file)
    except (AttributeError, OSError, RuntimeError, ValueError):  # no file descriptor to write the stacks to
        return
    if not _DEADLINE:
        log.info("this rank is ending: within %g s, whatever it is doing then (should it still run, its threads' "
                 "stacks follow and it exits with status 1)", seconds, extra={"file_only": True})
    _DEADLINE.update(at=at, file=file)


def _log_file():
    """A file of its own on this process's log file (the root logger's first file handler), so that no handler
    closing its stream takes the watchdog's descriptor away; else stderr."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            try:
                return open(handler.baseFilename, "a")
            except OSError:
                break
    return sys.stderr


def _launcher_name() -> str:
    cmd = _LAUNCHER.get("cmdline") or []
    typed = _as_typed(cmd) if cmd else []
    if typed[:1] == ["torchrun"] or "torch.distributed.run" in typed or "torch.distributed.launch" in typed:
        return "torchrun"
    return "its launcher, " + (os.path.basename(typed[0]) if typed else "the parent process")


def launch_command() -> List[str]:
    """The command line that started this process, as typed: for a rank of torch's elastic agent whose command line
    ends with this process's (``torchrun``, ``python -m torch.distributed.run``, or the process that runs
    ``launcher=torchrun``), the agent's (``torchrun [its options] train.py ARGS``); else the interpreter's
    (``python [options] train.py ARGS``: ``sys.orig_argv``), else ``python`` and ``sys.argv``."""
    argv = [str(a) for a in sys.argv]
    parent = _LAUNCHER.get("cmdline") if under_elastic_agent() else None
    for whole in (parent, list(getattr(sys, "orig_argv", None) or [])):
        if whole and argv and len(whole) > len(argv) and whole[-len(argv):] == argv:
            return _as_typed(whole)
    return ["python", *argv]


def _as_typed(cmd: List[str]) -> List[str]:
    """``cmd`` (a process's argv) as its user typed it: a console script run through its interpreter
    (``/venv/bin/python3 /venv/bin/torchrun ...``) by its own name."""
    if len(cmd) > 1 and os.path.basename(cmd[1]) == "torchrun":
        return ["torchrun", *cmd[2:]]
    if os.path.basename(cmd[0]) == "torchrun":
        return ["torchrun", *cmd[1:]]
    return list(cmd)


#: the overrides that place a run or sweep dir, with Hydra's prefixes
_DIR_OVERRIDE = re.compile(r"^\+{0,2}hydra\.(run|sweep)\.dir=")
_HYDRA_PLAIN = re.compile(r"^[A-Za-z0-9_./\-+:@%~]*$")
_SHELL_PLAIN = re.compile(r"^[A-Za-z0-9_./\-+:@%=,]+$")


def resume_command(run_dir: Optional[Path] = None, sweep: bool = False) -> str:
    """The shell command that resumes this run from its run dir, as one string: :func:`launch_command` (in a sweep:
    the sweep's command, recorded at its start by :func:`hydratrain.sweep_report.mark_multirun`) with
    ``hydra.run.dir=<run dir>`` (a sweep: ``hydra.sweep.dir=<sweep dir>``) in place of any it gave; the dir relative
    to the launch dir when it lies below it (the command runs there). ``run_dir`` names the run dir (with ``sweep``,
    the sweep dir) where Hydra has not set it yet (before its job starts); by default it comes from Hydra's config.
    With several nodes it is each node's own command (its own node rank), which the text says. Raises nothing: when
    the dir cannot be had, the command alone, said to need it."""
    try:
        if sweep and run_dir is not None:
            key, where, launch, command = "hydra.sweep.dir", Path(run_dir), _launch_dir(), None
            command = _sweep_command(where) or launch_command()
        else:
            key, where, launch, command = _what_resumes(run_dir)
    except Exception as err:  # noqa: BLE001 (a line about resuming must never fail the end it reports)
        return f"the same command with hydra.run.dir=<this run's dir> ({type(err).__name__} finding it)"
    command = [a for a in command if not _DIR_OVERRIDE.match(a)]
    if where is None:
        text = _join(command) + f" {key}=<this run's dir>"
    else:
        shown = Path(os.path.relpath(where, launch)) if launch and _below(where, launch) else Path(where)
        text = _join([*command, f"{key}={_hydra_value(str(shown))}"])
    nodes = os.environ.get("GROUP_WORLD_SIZE", "1")
    if nodes.isdigit() and int(nodes) > 1:
        text += " (on every node: each node's own command, with its node rank)"
    return text


def _what_resumes(run_dir: Optional[Path]):
    """(the dir's key, the dir or None, the launch dir or None, the command) of this run."""
    hydra_cfg = _hydra_config()
    if hydra_cfg is None:
        return "hydra.run.dir", (Path(run_dir).absolute() if run_dir else None), Path.cwd(), launch_command()
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    cwd = OmegaConf.select(hydra_cfg, "runtime.cwd", default=None, throw_on_missing=False)
    launch = Path(str(cwd)) if cwd else Path.cwd()
    if hydra_cfg.mode == RunMode.MULTIRUN:
        sweep_dir = resolve_path(str(hydra_cfg.sweep.dir), launch)
        return "hydra.sweep.dir", sweep_dir, launch, _sweep_command(sweep_dir) or launch_command()
    if run_dir is None:  # the job's dir once Hydra set it up, else (before: its on_run_start) the one it will make
        output = OmegaConf.select(hydra_cfg, "runtime.output_dir", default=None, throw_on_missing=False) or \
            OmegaConf.select(hydra_cfg, "run.dir", default=None, throw_on_missing=False)
        run_dir = resolve_path(str(output), launch) if output else None
    return "hydra.run.dir", (Path(run_dir) if run_dir else None), launch, launch_command()


def _launch_dir() -> Path:
    from omegaconf import OmegaConf

    hydra_cfg = _hydra_config()
    cwd = OmegaConf.select(hydra_cfg, "runtime.cwd", default=None, throw_on_missing=False) if hydra_cfg else None
    return Path(str(cwd)) if cwd else Path.cwd()


def _hydra_config():
    """Hydra's config of this job, or None outside Hydra (imports Hydra only when it is loaded already)."""
    if "hydra.core.hydra_config" not in sys.modules:
        return None
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.get() if HydraConfig.initialized() else None


def _sweep_command(sweep_dir: Path) -> Optional[List[str]]:
    import json

    try:
        command = json.loads((sweep_dir / ".hydratrain_multirun.json").read_text()).get("command")
    except (OSError, ValueError):
        return None
    return [str(a) for a in command] if isinstance(command, list) and command else None


def _below(path: Path, base: Path) -> bool:
    try:
        Path(os.path.abspath(path)).relative_to(os.path.abspath(base))
        return True
    except ValueError:
        return False


def _hydra_value(value: str) -> str:
    """``value`` as Hydra's override grammar reads it back unchanged: bare when plain, else quoted (a comma would
    make a sweep of it, a space split it)."""
    if _HYDRA_PLAIN.match(value):
        return value
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _join(args: List[str]) -> str:
    """``args`` as one shell command line: each bare when plain, else in double quotes when that keeps it as it is
    (Hydra's single quotes inside), else ``shlex.quote``."""
    out = []
    for arg in args:
        if _SHELL_PLAIN.match(arg):
            out.append(arg)
        elif not any(c in arg for c in '"$`\\!'):
            out.append(f'"{arg}"')
        else:
            out.append(shlex.quote(arg))
    return " ".join(out)


def unwritable_message(what: str, where: Any, cause: Optional[BaseException], last_checkpoint: Any,
                       room: Optional[str] = None, stopped: str = "training stopped", frees: str = "",
                       run_dir: Any = None) -> str:
    """``<what> under <where> failed (<cause>; <what tells the cause>); <stopped>. The latest complete checkpoint,
    <last>, is intact: <room> and resume from it with: <command>`` (or, without a checkpoint, ``No checkpoint was
    written before: <room> and relaunch: <command>``; with ``last_checkpoint=...`` (Ellipsis: not this call's to
    say, a sweep's), ``<Room> and relaunch: <command>``), where ``<command>`` is the one that resumes this run in
    its run dir (:func:`hydratrain.dist.launch.resume_command`; ``run_dir``: that dir, or with ``...`` the sweep dir,
    where Hydra's config does not tell it yet).

    ``room`` defaults to the remedy for the cause (:func:`hydratrain.errors.write_refusal`): make room (no space; ``frees``, e.g. ``"lower
    checkpoint.keep_last"``, is offered too), free some of the quota (also ``frees``), make it writable (a read-only
    filesystem), fix the permissions of the dir that refused the write, raise the file-size limit (``ulimit -f``).
    A cause without an errno (torch's checkpoint writer raises a ``RuntimeError`` that lost it) is told from
    ``where``: a finite file-size limit, a dir this process may not write, little free space; else the cause is
    said to be unknown. Raises nothing."""
    why = (f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}" if cause is not None
           else "another rank could not write its part")
    told, remedy = write_refusal(cause, where, frees)
    return _tail(f"{what} under {where} failed ({why}{'; ' + told if told else ''}); {stopped}.", room or remedy,
                 last_checkpoint, run_dir)


def _tail(head: str, room: str, last_checkpoint: Any, run_dir: Any = None) -> str:
    command = resume_command(run_dir, sweep=last_checkpoint is ...)
    if last_checkpoint is ...:
        return f"{head} {room[0].upper()}{room[1:]} and relaunch: {command}"
    if last_checkpoint:
        return (f"{head} The latest complete checkpoint, {last_checkpoint}, is intact: {room} and resume from it "
                f"with: {command}")
    return f"{head} No checkpoint was written before: {room} and relaunch: {command}"


def composing(on: bool = True) -> None:
    """From ``train.py``'s start until the config is composed (``on``), Hydra raises its composition errors
    (``HYDRA_FULL_ERROR=1``) instead of printing them on every rank, so :func:`end_composition` can end the launch
    with one line; ``composing(False)`` (its first callback, or the run itself) gives Hydra its own error report back
    for the rest. A user's own ``HYDRA_FULL_ERROR`` is left as it is (they asked for tracebacks)."""
    if on and "HYDRA_FULL_ERROR" not in os.environ:
        os.environ["HYDRA_FULL_ERROR"] = "1"
        _COMPOSING["on"] = True
    elif not on and _COMPOSING["on"]:
        os.environ.pop("HYDRA_FULL_ERROR", None)
        _COMPOSING["on"] = False
