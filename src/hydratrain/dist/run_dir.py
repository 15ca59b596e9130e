"""One run dir for all ranks, and the launch dir every user-given path is relative to.

- :func:`run_stamp`: the ``YYYY-MM-DD/HH-MM-SS`` stamp all ranks of a launch agree on (Hydra resolver
  ``${hydratrain.stamp:}``), and :func:`unique_dir`, the default ``hydra.run.dir`` / ``hydra.sweep.dir`` built on
  it, which no other launch shares (``${hydratrain.unique_dir:BASE,KIND}`` in ``conf/train.yaml``).
- :func:`launch_dir` / :func:`resolve_path`: the directory the command was started from (Hydra's
  ``hydra.runtime.cwd``), whatever ``hydra.job.chdir``, the launcher or the sweep; every path key (``data.paths``,
  ``model.init_from``, ``checkpoint.resume_from``, ``data.cache_dir``) resolves against it.
- :func:`run_dir_of`: this job's output dir; :func:`claim`: this job takes it and finds the checkpoint it starts from.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Optional, Union

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from hydratrain.checkpoint.layout import (
    find_resume,
    latest_checkpoint,
    list_checkpoints,
    other_trial,
    recover_unfinished_saves,
)
from hydratrain.config.values import unresolvable
from hydratrain.dist.env import DistInfo, dist_info, env_rank
from hydratrain.dist.launch import resume_command, unwritable_message
from hydratrain.dist.run_lock import RunDirLock, held_by_another, hold_run_dir, shared_config
from hydratrain.dist.store import base_store, store_get
from hydratrain.errors import EXIT_CONFIG, ConfigError, OutputError, say, unwritable_cause
from hydratrain.paths import join, resolve_path

#: in the sweep dir: the multirun that writes it now ({"id", "started", "sampled": the keys it varies, or null,
#: "command": the command line that launched it, or null}; :func:`hydratrain.sweep_report.mark_multirun`)
MULTIRUN_MARK = ".hydratrain_multirun.json"
_FAILED = "\0failed"  # rank 0's answer in the store when it could not create the run dir

STAMP_ENV = "HYDRATRAIN_STAMP"  # a launcher's stamp, inherited by the processes it starts
_STAMP: Optional[str] = None
_INHERITED = False  # the stamp came from $HYDRATRAIN_STAMP (a launcher's), not from this process's clock


def run_stamp() -> str:
    """A ``YYYY-MM-DD/HH-MM-SS`` stamp that every rank of one launch agrees on.

    Hydra's ``${now:}`` resolves per process, so ranks started a second apart would write to two run dirs.

    * With several ranks (torchrun, the ``launcher=torchrun`` plugin, submitit tasks), every rank proposes a stamp
      to the TCPStore at ``MASTER_ADDR``/``MASTER_PORT`` with ``compare_set``; the first proposal wins and all ranks,
      on all nodes, read it back. The proposal is the launching process's stamp (``$HYDRATRAIN_STAMP``, inherited
      from a launcher) if there is one, else the local time. The key is per launch (elastic run id / SLURM job id),
      so ranks restarted by the agent (``max_restarts``) keep the same run dir and can resume from it.
    * Else ``$HYDRATRAIN_STAMP`` if set, else the local time.

    The stamp is exported as ``$HYDRATRAIN_STAMP`` so processes this one starts (launcher workers) agree with it.
    """
    global _STAMP, _INHERITED
    if _STAMP is None:
        _INHERITED = bool(os.environ.get(STAMP_ENV))
        mine = os.environ.get(STAMP_ENV) or time.strftime("%Y-%m-%d/%H-%M-%S")
        if dist_info().world_size > 1 and "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
            store = base_store()
            key = "hydratrain/run_stamp/" + _launch_key()
            _STAMP = store.compare_set(key, "", mine).decode()
            if _STAMP == "":  # very old stores return the expected value when they set the key
                _STAMP = store.get(key).decode()
        else:
            _STAMP = mine
        os.environ[STAMP_ENV] = _STAMP
    return _STAMP


_UNIQUE_DIRS: dict = {}  # (base, kind, stamp) -> the dir this launch uses


def unique_dir(base: str, kind: str) -> str:
    """``<base>/<kind>/<stamp>`` (:func:`run_stamp`), or ``<stamp>-1``, ``-2``, ... when a launch that started in the
    same second already has that dir: the Hydra resolver ``${hydratrain.unique_dir:BASE,KIND}`` behind the default
    ``hydra.run.dir`` (``KIND=outputs``) and ``hydra.sweep.dir`` (``multirun``).

    The launch's first process reserves the dir by creating it (``mkdir`` fails when it exists, so two launches
    cannot both get one) and exports the stamp with its suffix (``$HYDRATRAIN_STAMP``): the processes it starts
    inherit the stamp and reserve nothing. With several ranks and no inherited stamp (torchrun, SLURM tasks), rank 0
    reserves and the others read its choice from the launch's store; ranks that torchrun's agent restarts read it
    back, so they keep their run dir.
    """
    global _STAMP
    stamp = run_stamp()
    key = (base, kind, stamp)
    if key not in _UNIQUE_DIRS:
        if _INHERITED or _only_prints():
            chosen = stamp
        elif dist_world_size() > 1 and os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
            store = base_store()
            store_key = f"hydratrain/unique_dir/{_launch_key()}/{kind}"
            if env_rank() == 0 and not store.check([store_key]):
                try:
                    store.set(store_key, _reserve(base, join(base, kind), stamp))
                except SystemExit:
                    store.set(store_key, _FAILED)  # the other ranks leave too, without a second message
                    raise
            chosen = store_get(store, store_key).decode()  # polled: a SIGTERM handler runs meanwhile
            if chosen == _FAILED:
                raise SystemExit(EXIT_CONFIG)
        else:
            chosen = _reserve(base, join(base, kind), stamp)
        _STAMP = chosen
        os.environ[STAMP_ENV] = chosen
        _UNIQUE_DIRS[key] = _UNIQUE_DIRS[(base, kind, chosen)] = join(base, f"{kind}/{chosen}")
        if not _INHERITED and not _only_prints():
            _RESERVED.add(os.path.abspath(_UNIQUE_DIRS[key]))
    return _UNIQUE_DIRS[key]


_RESERVED: set = set()  # run dirs this launch created for itself (absolute paths)
_LEFT_BY_A_REFUSED_START = (".hydra", "hydratrain.lock")  # and train_rank<R>.log


def discard_if_unused(run_dir: Path, left: tuple = ()) -> bool:
    """Remove ``run_dir`` when this launch created it (:func:`unique_dir`) and it holds only what Hydra and the
    start wrote before a config error stopped the run (``.hydra/``, ``train_rank<R>.log``, the lock; also the names
    in ``left``, and sub-dirs holding only these: a sweep's records of its refused job): a typo on the command line
    should not leave a run dir behind. Returns whether it was removed; anything else in it keeps it."""
    import shutil

    path = Path(run_dir)
    if os.path.abspath(path) not in _RESERVED or not path.is_dir():
        return False

    def unused(folder: Path, depth: int) -> bool:
        return all(p.name in _LEFT_BY_A_REFUSED_START or p.name in left or re.fullmatch(r"train_rank\d+\.log", p.name)
                   or (left and depth < 2 and p.is_dir() and not p.is_symlink() and unused(p, depth + 1))
                   for p in folder.iterdir())

    if not unused(path, 0):
        return False
    shutil.rmtree(path, ignore_errors=True)
    _RESERVED.discard(os.path.abspath(path))
    for parent in (path.parent, path.parent.parent):  # <date>/ and outputs/, when nothing else is there
        try:
            parent.rmdir()
        except OSError:
            break
    return True


def discard_reserved_unused(left: tuple = ()) -> None:
    """:func:`discard_if_unused` for every dir this launch reserved (a sweep dir, and a run dir Hydra resolved on the
    way: ``hydra.run={dir: ...}`` composes the default one first), for a launch a config error ends before any
    job."""
    for path in sorted(_RESERVED):
        discard_if_unused(Path(path), left)


def _only_prints() -> bool:
    """Whether Hydra's command line asks to print (``--cfg all --resolve``, ``--info``, ``--help``), not to run:
    then no run dir is reserved (created)."""
    return any(a in ("--cfg", "-c", "--info", "-i", "--help", "-h", "--hydra-help")
               or a.startswith(("--cfg=", "--info=")) for a in sys.argv[1:])


def _reserve(base: str, parent: str, stamp: str) -> str:
    """The first of ``stamp``, ``stamp-1``, ``stamp-2``, ... whose dir under ``parent`` this call creates. When it
    cannot create one (a read-only or missing ``base``, ``paths.output_dir``), prints the one-line config error and
    raises SystemExit(2)."""
    for n in range(10_000):
        candidate = stamp if n == 0 else f"{stamp}-{n}"
        try:
            os.makedirs(os.path.join(parent, candidate), exist_ok=False)
            return candidate
        except FileExistsError:
            continue
        except OSError as err:  # SystemExit, not an exception: OmegaConf would wrap one into a traceback
            problem = ConfigError("paths.output_dir", base,
                                  f"cannot create the run dir {os.path.join(parent, candidate)}: {err.strerror}; "
                                  "give a writable paths.output_dir (or hydra.run.dir / hydra.sweep.dir)")
            say(f"hydratrain: {problem.label}: {problem}")
            raise SystemExit(EXIT_CONFIG) from None
    raise FileExistsError(f"{parent}/{stamp}-N: 10000 dirs of this second exist")


def dist_world_size() -> int:
    raw = os.environ.get("WORLD_SIZE", "")
    return int(raw) if raw.isdigit() else 1


def _launch_key() -> str:
    return next((os.environ[k] for k in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SUBMITIT_LOCAL_JOB_ID")
                 if k in os.environ), "none")


def output_base(*, _root_: Any = None) -> str:
    """``paths.output_dir`` for the default ``hydra.run.dir`` / ``hydra.sweep.dir`` (``${hydratrain.output_base:}``;
    ``<paths.output_dir>`` when the key is gone). Resolved here, not by an interpolation in Hydra's own node, so a
    value that cannot be resolved (``${oc.env:SCRATCH}/runs`` with SCRATCH unset) is the one-line config error, exit
    status 2, as in every other key, not Hydra's 190-line traceback of its run dir. ``_root_``: the whole
    config (OmegaConf passes it)."""
    try:
        base = OmegaConf.select(_root_, "paths.output_dir", default=None)
        if base is not None or "trainer" not in _root_:  # (Hydra's own node alone: --cfg hydra)
            return str(base if base is not None else "<paths.output_dir>")
        problem = ConfigError("paths.output_dir", "<missing>", "the run dir is built on it: choose a paths option "
                              "with paths=NAME (conf/paths/), not ~paths")  # a config error, not a dir of that name
    except OmegaConfBaseException as err:
        problem = unresolvable("paths.output_dir", _root_.paths._get_node("output_dir")._value(), err)
    say(f"hydratrain: {problem.label}: {problem}")
    raise SystemExit(EXIT_CONFIG) from None  # (an exception would come out as Hydra's traceback)


def output_subdir(*, _root_: Any = None) -> Optional[str]:
    """``.hydra`` on rank 0 and ``None`` (Hydra then writes no config copy) on the other ranks, and on rank 0 too
    when the job will stop before training (exit status 2) and the run dir's ``.hydra/`` belongs to another run:
    another live job holds the run dir (:mod:`hydratrain.dist.run_lock`), another job of this multirun ran there,
    or, in a sweep run again into its ``hydra.sweep.dir``, the job's run dir holds a checkpoint of another trial
    (:func:`hydratrain.checkpoint.manager.other_trial`). ``_root_``: the whole config (OmegaConf passes it)."""
    if env_rank() != 0:
        return None


    try:
        output_dir = HydraConfig.get().runtime.output_dir
        if output_dir and (held_by_another(Path(output_dir)) or _of_another_trial(Path(output_dir), _root_)
                           or _of_another_job(Path(output_dir))):
            return None
    except Exception:  # resolved before Hydra set up the job (--cfg hydra, a launcher's process), a bad $WORLD_SIZE
        output_dir = None  # (the job's own checks name it)
    if output_dir:
        refuse_a_full_run_dir(Path(output_dir))
    return ".hydra"


def refuse_a_full_run_dir(run_dir: Path, probe_bytes: int = 65536, sweep: bool = False) -> None:
    """Make ``run_dir`` (with the dirs above it) and write and remove ``probe_bytes`` there: a dir that takes no
    writes (a full, over-quota or read-only filesystem, a file-size limit below ``probe_bytes``, permissions that
    refuse this process: :func:`hydratrain.errors.unwritable_cause`) ends the launch with one ``hydratrain: output
    error:`` line, the cause and its remedy, and exit status 3 (``SystemExit``: an exception would come out as
    Hydra's or OmegaConf's traceback). Other errors are left to what writes next.

    Called before Hydra makes a single run's dir and opens its log file there (:func:`refuse_an_unwritable_run_dir`,
    every rank), before Hydra writes a job's ``.hydra/`` (:func:`output_subdir`, rank 0), and for the sweep dir
    (``sweep``) before Hydra's ``multirun.yaml`` (``hydratrain.sweep``). Under torchrun each node's first rank says the
    line, and the other ranks leave after rank 0 (the agent's root cause)."""
    probe = run_dir / f".hydratrain-write-probe-{os.getpid()}"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as fh:
            fh.write(bytes(probe_bytes))
    except OSError as err:
        cause = unwritable_cause(err, writes=(run_dir,))
        if cause is None:
            return

        last = ... if sweep else (latest_checkpoint(run_dir / "checkpoints") if (run_dir / "checkpoints").is_dir()
                                  else None)
        message = unwritable_message(f"writing the {'sweep' if sweep else 'run'} dir", run_dir, cause, last,
                                     stopped=f"the {'sweep' if sweep else 'run'} did not start", run_dir=run_dir)
        if os.environ.get("LOCAL_RANK", "0") == "0":
            say(f"hydratrain: {OutputError.label}: {message}")
        with contextlib.suppress(OSError):
            probe.unlink()
        discard_if_unused(run_dir)  # the default run dir this launch made for nothing
        if env_rank() != 0 and "TORCHELASTIC_RUN_ID" in os.environ:
            time.sleep(10.0)  # rank 0, which says it, leaves first (as for a config error: hydratrain.exits)
        raise SystemExit(OutputError.exit_status) from None
    with contextlib.suppress(OSError):
        probe.unlink()


def refuse_an_unwritable_run_dir(config: Any) -> None:
    """Hydra's ``on_run_start`` (``hydratrain.sweep.SweepReportCallback``), on every rank of a single run: the
    earliest point before Hydra makes ``hydra.run.dir`` and opens ``train_rank<R>.log`` in it, whose errors are
    Hydra's traceback. Probes the run dir (:func:`refuse_a_full_run_dir`: one line and ``SystemExit(3)`` when it takes
    no writes). A ``hydra.run.dir`` that does not resolve is left to Hydra (its resolvers say why)."""
    try:
        value = OmegaConf.select(config, "hydra.run.dir")
    except OmegaConfBaseException:
        return
    if value:
        refuse_a_full_run_dir(Path(str(value)))


def _of_another_job(run_dir: Path) -> bool:
    """Whether another job of this multirun already ran in this sweep job's ``run_dir`` (the job then stops:
    ``hydratrain.run``)."""

    hydra_cfg = HydraConfig.get()
    return hydra_cfg.mode == RunMode.MULTIRUN and other_job_of_this_multirun(run_dir, hydra_cfg) is not None


def _of_another_trial(run_dir: Path, root: Any) -> bool:
    """Whether this sweep job's ``run_dir`` holds a latest checkpoint that another trial wrote (the job then stops:
    ``hydratrain.run``), judged on ``root``, the job's whole config."""
    hydra_cfg = HydraConfig.get()
    if root is None or hydra_cfg.mode != RunMode.MULTIRUN:
        return False
    record = trial_record(run_dir, OmegaConf.select(root, "checkpoint.auto_resume", default=True))
    if record is None:
        return False

    task = OmegaConf.masked_copy(root, [k for k in root if k != "hydra"])
    # (a DictConfig's container: a dict): why the ignore below
    return bool(other_trial(record, OmegaConf.to_container(task, resolve=True, enum_to_str=True),  # type: ignore[arg-type]
                            list(hydra_cfg.overrides.task)))


def trial_record(run_dir: Path, auto_resume: bool) -> Optional[Path]:
    """The dir whose ``config.yaml`` says which trial a sweep job's ``run_dir`` holds: its latest checkpoint (which
    the job would resume; with ``checkpoint.auto_resume``), else, for a trial that finished without one (a short
    run, no ``save_last``: its ``results.json`` is there), its ``.hydra/``, so that a sweep re-run with other
    values cannot replace such a trial's results, ``.hydra/`` and curves without a word. None when the dir holds
    neither."""
    own = list_checkpoints(run_dir / "checkpoints") if (run_dir / "checkpoints").is_dir() else []
    if own:
        return own[-1][1] if auto_resume else None
    if (run_dir / "results.json").is_file() and (run_dir / ".hydra" / "config.yaml").is_file():
        return run_dir / ".hydra"
    return None


def register_resolvers() -> None:
    """Register ``${hydratrain.stamp:}``, ``${hydratrain.unique_dir:BASE,KIND}``, ``${hydratrain.output_base:}``,
    ``${hydratrain.output_subdir:}``, ``${hydratrain.rank:}`` and ``${hydratrain.path:BASE,REST}``
    (:func:`hydratrain.paths.join`) (idempotent)."""
    for name, fn in (("hydratrain.stamp", run_stamp), ("hydratrain.unique_dir", unique_dir),
                     ("hydratrain.output_base", output_base),
                     ("hydratrain.output_subdir", output_subdir),
                     ("hydratrain.rank", env_rank), ("hydratrain.path", join)):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn, use_cache=False)


def run_dir_of() -> Path:
    """Hydra's output dir for this job, absolute (a relative one is below the launch dir); the current dir when
    called without Hydra."""
    if HydraConfig.initialized():
        return resolve_path(HydraConfig.get().runtime.output_dir)
    return Path(os.getcwd())


def other_job_of_this_multirun(job_dir: Path, hc: Any) -> Optional[int]:
    """The number of another job of the running multirun that already ran in ``job_dir`` (its ``status.json``
    says so: two jobs whose ``hydra.sweep.subdir`` resolves to one dir), or None. ``hc``: the job's Hydra config."""
    status = _read_json(job_dir / "status.json")
    mark = _read_json(_sweep_dir(hc) / MULTIRUN_MARK)
    num = status.get("num")
    if mark and status.get("multirun") == mark.get("id") and num is not None and num != hc.job.num:
        return num
    return None


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _sweep_dir(hc: Any) -> Path:
    """``hydra.sweep.dir``, a relative one resolved against the launch dir (``hydra.runtime.cwd``): with
    ``hydra.job.chdir=true`` a job's callbacks run in its own dir."""
    return resolve_path(str(hc.sweep.dir), Path(str(hc.runtime.cwd)))


def resume_hint(how: Optional[str]) -> str:
    """``; <how>: <the command that resumes this run>`` (:func:`hydratrain.dist.launch.resume_command`) when ``how``
    is given, this is a single run (a sweep's failed job leaves the sweep going) and its run dir holds a complete
    checkpoint to resume from; else ''. Raises nothing."""
    if not how or in_multirun():
        return ""
    try:
        run_dir = run_dir_of()
        if latest_checkpoint(run_dir / "checkpoints") is None:
            return ""
        return f"; {how}: {resume_command(run_dir)}"
    except Exception:  # noqa: BLE001 (the line it ends is what matters)
        return ""


def in_multirun() -> bool:
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def refuse_a_path_that_is_not_utf8(run_dir: Path) -> None:
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



def refuse_another_trial(cfg: DictConfig, resume: Path, run_dir: Path) -> None:
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



def refuse_another_jobs_dir(run_dir: Path) -> None:
    """A sweep job whose run dir another job of the same multirun has already used (two jobs' ``hydra.sweep.subdir``
    resolve to one dir, e.g. ``${hydra.job.override_dirname}`` without a swept key): raise
    :class:`~hydratrain.errors.ConfigError` instead of overwriting that job's results, log and TensorBoard curves."""

    hc = HydraConfig.get()
    other = other_job_of_this_multirun(run_dir, hc)
    if other is not None:
        raise ConfigError("hydra.sweep.subdir", hc.sweep.subdir,
                          f"job {hc.job.num}'s run dir {run_dir} is job {other}'s of this sweep: give every job a dir "
                          "of its own (the default ${hydra.job.num}; an override_dirname must keep every swept key)")



def run_dir_key(run_dir: Path) -> Union[tuple[str, str], tuple[str, str, str]]:
    """(config key, its value[, which dir below it]) that place ``run_dir``: ``hydra.run.dir``, or in a sweep
    ``hydra.sweep.dir`` and the job's run dir."""
    if not in_multirun():
        return "hydra.run.dir", str(run_dir)

    hc = HydraConfig.get()
    return "hydra.sweep.dir", str(hc.sweep.dir), f"job {hc.job.num}'s run dir {run_dir}"


def claim(cfg: DictConfig, run_dir: Path, env: DistInfo, launch: Path) -> tuple[Optional[RunDirLock], Optional[Path]]:
    """This job takes ``run_dir`` and finds the checkpoint it starts from (every rank calls, before any process
    group). Refuses (:class:`~hydratrain.errors.ConfigError`) a path that is not UTF-8, another sweep job's dir, and a
    checkpoint or the results of another trial; rank 0 takes the dir's lock and first completes or moves aside the
    saves a killed run left unfinished. Returns (the lock: rank 0's, None elsewhere; the checkpoint to resume from
    (``mode=eval``: the best one when kept), or None). A refusal after the lock releases it."""
    refuse_a_path_that_is_not_utf8(run_dir)
    if in_multirun():
        refuse_another_jobs_dir(run_dir)
    lock = hold_run_dir(run_dir, env, *run_dir_key(run_dir),
                        prepare=lambda: recover_unfinished_saves(run_dir / "checkpoints"),
                        config=shared_config(cfg) if env.world_size > 1 else None)
    try:
        resume = find_resume(cfg.checkpoint, run_dir, launch, prefer_best=str(cfg.mode) == "eval")
        if resume is not None and in_multirun() and resume.parent == run_dir / "checkpoints":
            refuse_another_trial(cfg, resume, run_dir)
        elif resume is None and in_multirun() and (run_dir / "results.json").is_file():
            finished = trial_record(run_dir, cfg.checkpoint.auto_resume)
            if finished is not None:
                refuse_another_trial(cfg, finished, run_dir)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return lock, resume
