"""One job per run dir: rank 0 holds ``<run dir>/hydratrain.lock`` while its job runs.

Two jobs writing one run dir at once (a resume command started while the run still goes, a script that reuses
``hydra.run.dir``) would set aside and prune each other's checkpoints and mix their TensorBoard files and logs. So
the second job stops with exit status 2 before it reads or writes a checkpoint, naming the holder::

    hydratrain: config error: hydra.run.dir='runs/a': in use by another job (host n1, pid 4242, launch
    torchelastic:..., started 2026-12-01 06:10:03, alive 3 s ago); wait for it to end, or use another hydra.run.dir

The lock file holds its holder as JSON (host, pid, launch, started; on Linux also the pid's start time, in clock
ticks since boot, and the boot id, which tell a reused pid apart); the holder refreshes its mtime every
:data:`HEARTBEAT_S` seconds. A lock found in place is the job's own or left behind, and taken over with a warning,
when

- its holder ran on this host and that pid is gone (a job killed with SIGKILL), or is now another process: one
  started at another time than the holder, such as a process of a restarted container (a fresh PID namespace hands
  out the same pids again, and the hostname stays), possibly this very process;
- it carries this launch's identity (:func:`launch_identity`) and no live process of this host holds it: ranks that
  torchrun's agent restarted (``--max-restarts``), a requeued SLURM job;
- its heartbeat is older than :data:`STALE_S` seconds (a holder on another host that died; also one of this host
  name with another boot id: another machine of the same name, or this one before a reboot).

Hydra opens its log files in the run dir before the job starts: the refused job's lines are appended to the running
job's logs. Its config copy (``.hydra/``) is not written (:func:`hydratrain.dist.run_dir.output_subdir`).

The same exchange through the launch's store, before any process group, checks that every rank resolved rank 0's run
dir and composed rank 0's config (:func:`hold_run_dir`, :func:`shared_config`).
"""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

from omegaconf import OmegaConf

from hydratrain.config import flat_keys
from hydratrain.dist.store import base_store, store_get
from hydratrain.errors import ConfigError

log = logging.getLogger(__name__)
_HELD: list = []  # the RunDirLocks this process holds now

LOCK_NAME = "hydratrain.lock"
HEARTBEAT_S = 10.0  # the holder touches the lock this often (seconds)
STALE_S = 120.0  # a lock untouched this long (seconds) has no live holder, wherever it ran


def launch_identity() -> str:
    """What all processes of one launch, and only they, share, including processes a launcher restarts:
    ``slurm:<job id>.<step id>``, ``torchelastic:<run id>@<MASTER_ADDR>:<MASTER_PORT>``, ``submitit-local:<job
    id>``, ``<MASTER_ADDR>:<MASTER_PORT>`` (other multi-rank launches), else ``pid:<host>:<pid>``."""
    env = os.environ
    if env.get("SLURM_JOB_ID"):
        return f"slurm:{env['SLURM_JOB_ID']}.{env.get('SLURM_STEP_ID', 'batch')}"
    master = f"{env.get('MASTER_ADDR', '')}:{env.get('MASTER_PORT', '')}"
    if env.get("TORCHELASTIC_RUN_ID"):
        return f"torchelastic:{env['TORCHELASTIC_RUN_ID']}@{master}"
    if env.get("SUBMITIT_LOCAL_JOB_ID"):
        return f"submitit-local:{env['SUBMITIT_LOCAL_JOB_ID']}"
    if env.get("WORLD_SIZE", "").isdigit() and int(env["WORLD_SIZE"]) > 1 and master != ":":
        return master
    return f"pid:{socket.gethostname()}:{os.getpid()}"


def _stat_fields(pid: int) -> Optional[list]:
    """The fields of ``/proc/<pid>/stat`` from the third (state) on; None where it cannot be read (no such process,
    no /proc: not Linux, or a /proc that hides other users' processes)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None


def _pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs on this host; a zombie (killed, not yet reaped by its parent) does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    fields = _stat_fields(pid)
    return not fields or fields[0] != "Z"  # no /proc (not Linux): alive


def _pid_start(pid: int) -> Optional[int]:
    """When ``pid`` started, in clock ticks since boot (field 22 of ``/proc/<pid>/stat``): with the pid, it names one
    process of one boot. None where it cannot be read."""
    fields = _stat_fields(pid)
    try:
        return int(fields[19]) if fields else None
    except (IndexError, ValueError):
        return None


def _boot_id() -> Optional[str]:
    """This boot's id (``/proc/sys/kernel/random/boot_id``, the same in every container of the machine); None
    without it (not Linux)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def _holder_running(holder: dict, me: dict, pid_alive: Callable[[int], bool],
                    pid_start: Callable[[int], Optional[int]]) -> Optional[bool]:
    """Whether the process that wrote ``holder`` runs now, as far as this process (``me``) can tell: None when it
    cannot (another host, another boot id: another machine of the same name, or this one rebooted; no pid), True
    for ``me``'s own pid when nothing tells the two apart (a lock without start times, as the previous version
    wrote them, while ``me`` has none either)."""
    pid = holder.get("pid")
    if holder.get("host") != me["host"] or not isinstance(pid, int) or isinstance(pid, bool):
        return None
    recorded, mine = holder.get("pid_start"), me.get("pid_start")
    if isinstance(recorded, int) and mine is not None:  # start times on both sides (Linux)
        if holder.get("boot") != me.get("boot"):
            return None  # start times of another boot: not comparable here
        if pid == me["pid"]:
            return recorded == mine
        if not pid_alive(pid):
            return False
        now = pid_start(pid)
        return now is None or now == recorded  # unreadable (hidden): the pid alone
    if pid == me["pid"]:  # the holder recorded no start time; this process, which records one, did not write it
        return mine is None
    return pid_alive(pid)


def left_behind(holder: dict, me: dict, age_s: float, pid_alive: Callable[[int], bool] = _pid_alive,
                pid_start: Callable[[int], Optional[int]] = _pid_start) -> Optional[str]:
    """Why the lock of ``holder`` (its JSON; ``{}`` when unreadable) untouched for ``age_s`` seconds is no longer
    held, for the job ``me`` (its JSON); None when a live job holds it. A holder's pid on this host counts as not
    running when it is gone, or when it is now another process (it started at another time than the holder's
    recorded start time: a pid reused, as in a restarted container); a lock without a start time (written by the
    previous version, or where there is no /proc) is judged by the pid alone. A holder proven to be the same
    process (its start time) keeps the lock whatever its age: a stopped job does not refresh it."""
    pid: Any = holder.get("pid")
    if holder.get("host") == me["host"] and isinstance(holder.get("dir_ino"), int) and \
            isinstance(me.get("dir_ino"), int) and holder["dir_ino"] != me["dir_ino"]:
        # a run dir copied with `cp -a` while its run goes on is not held by that run
        return "it was copied here with the run dir: its holder holds the dir it was written in, not this one"
    running = _holder_running(holder, me, pid_alive, pid_start)
    if running is False:
        again = " (that pid is now another process)" if pid_alive(pid) or pid == me["pid"] else ""
        return f"its holder, pid {pid} on this host, is not running{again}"
    if running and pid != me["pid"] and age_s <= STALE_S:
        return None  # a live process here, even of this launch (two jobs of one SLURM allocation)
    if running and pid != me["pid"] and isinstance(holder.get("pid_start"), int) and pid_start(pid) == \
            holder["pid_start"]:
        # the very process that took it, however long since it refreshed: stopped (Ctrl-Z, scontrol suspend,
        # docker pause) or hung; taken over, it would carry on after SIGCONT into the same run dir
        return None
    if holder.get("launch") == me["launch"]:
        return f"it is this launch's own ({me['launch']}), left by an earlier attempt"
    if age_s > STALE_S:
        return f"its holder has not refreshed it for {age_s:.0f} s (> {STALE_S:.0f} s)"
    return None


def _describe(holder: dict, age_s: float) -> str:
    if not holder:
        return f"an unreadable lock, refreshed {age_s:.0f} s ago"
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
    return (f"host {holder.get('host')}, pid {holder.get('pid')}, launch {holder.get('launch')}, started {started}, "
            f"alive {age_s:.0f} s ago")


def _inode(path: Path) -> Optional[int]:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


class RunDirBusy(Exception):
    """The run dir's lock is held by a live job; ``str(err)`` says by whom."""


class RunDirLock:
    """The lock file of one run dir, held by this process (rank 0) from :meth:`acquire` to :meth:`release`."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK_NAME
        self.me = {"host": socket.gethostname(), "pid": os.getpid(), "launch": launch_identity(),
                   "started": time.time(), "pid_start": _pid_start(os.getpid()), "boot": _boot_id(),
                   "dir_ino": _inode(run_dir)}  # which dir it guards: a copy of the lock is not the lock
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @staticmethod
    def release_held() -> None:
        """Release every lock this process holds: for a path that ends it with ``os._exit`` (a rank that saw a
        peer fail), where no ``finally`` runs."""
        for lock in list(_HELD):
            lock.release()

    def acquire(self) -> "RunDirLock":
        """Create the lock (atomically: ``O_CREAT | O_EXCL``), taking over one :func:`left_behind`, and start the
        heartbeat thread. Raises :class:`RunDirBusy` when a live job holds it, OSError when the run dir is not
        writable."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.me["dir_ino"] = _inode(self.path.parent)
        for _ in range(5):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._take_over_or_raise()
                continue
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(self.me, f)
            except OSError as err:  # a full disk: no empty lock may stay behind (it would refuse the next launch)
                self.path.unlink(missing_ok=True)
                raise OSError(err.errno, err.strerror, str(self.path)) from None
            _HELD.append(self)
            self._start_heartbeat()
            return self
        raise RunDirBusy(f"{self.path} changed hands 5 times while this job tried to take it")

    def _take_over_or_raise(self) -> None:
        text, age = self._read()
        if text is None:  # gone meanwhile: try again
            return
        try:
            holder = json.loads(text)
            holder = holder if isinstance(holder, dict) else {}
        except ValueError:
            holder = {}
            if age < 5:  # a holder that has just created it and not written it yet
                raise RunDirBusy(f"in use by another job ({_describe(holder, age)})") from None
        why = left_behind(holder, self.me, age)
        if why is None:
            raise RunDirBusy(f"in use by another job ({_describe(holder, age)})")
        aside = self.path.with_name(f"{LOCK_NAME}.left-{os.getpid()}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:  # another job took it over first
            return
        if aside.read_text() != text:  # not the lock judged above: a job took it over in between; give it back
            os.rename(aside, self.path)
            raise RunDirBusy("in use by another job, which took over a lock left behind at the same time")
        aside.unlink()
        log.warning("taking over %s (%s): %s", self.path, _describe(holder, age), why)

    def _read(self):
        try:
            age = time.time() - self.path.stat().st_mtime
            return self.path.read_text(), max(age, 0.0)
        except FileNotFoundError:
            return None, 0.0

    def _start_heartbeat(self) -> None:
        def beat() -> None:
            while not self._stop.wait(HEARTBEAT_S):
                try:
                    os.utime(self.path)
                except OSError:  # removed by hand: the job goes on without it
                    pass

        self._thread = threading.Thread(target=beat, name="hydratrain-run-dir-lock", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Stop the heartbeat and remove the lock if it is still this job's (idempotent)."""
        self._stop.set()
        if self in _HELD:
            _HELD.remove(self)
        text, _ = self._read()
        if text is not None:
            try:
                ours = json.loads(text) == self.me
            except ValueError:
                ours = False
            if ours:
                self.path.unlink(missing_ok=True)


def held_by_another(run_dir: Path) -> bool:
    """True when a live job other than this launch holds ``run_dir``'s lock (reads it, takes nothing)."""
    lock = RunDirLock(run_dir)
    text, age = lock._read()
    if text is None:
        return False
    try:
        holder = json.loads(text)
    except ValueError:
        return age < 5
    return left_behind(holder if isinstance(holder, dict) else {}, lock.me, age) is None


_HOLDS = 0  # run dirs this process has held (a sweep inside each rank holds one per job, in the same order)


def hold_run_dir(run_dir: Path, info, key: str, value: Optional[str] = None, which: str = "", *,
                 prepare: Optional[Callable[[], None]] = None, config: Optional[dict] = None) -> Optional[RunDirLock]:
    """Rank 0 takes ``run_dir``'s lock; through the launch's store every rank learns the outcome and checks that it
    resolved the same run dir as rank 0, so that all ranks raise the same error. Returns the lock on rank 0, None
    elsewhere. ``prepare``: what rank 0 does to the run dir once it holds it, before the other ranks go on (they
    read the run dir after it). Call before any process group exists.

    Raises :class:`~hydratrain.errors.ConfigError` (``key``, the run dir's config key: ``hydra.run.dir`` or
    ``hydra.sweep.dir``; ``value``, its value, default ``run_dir``; ``which``: the run dir below it, for a sweep's job) on every rank when
    another live job holds the run dir, or when the ranks resolved different run dirs (a per-process value such as ``${now:...}`` in ``hydra.run.dir``: each rank would write its own shards
    into its own dir, and no checkpoint would be whole). ``config``: the flat ``{key: value}`` every rank must
    share (:func:`shared_config`); when a rank's differs from rank 0's (a node launched with another command or
    config file) every rank raises a ConfigError naming the first differing key: the ranks would otherwise train
    different replicas together without a word.
    """
    global _HOLDS

    differs: Any
    lock, problem, differs = None, "", None
    if info.rank == 0:
        try:
            lock = RunDirLock(run_dir).acquire()
            if prepare is not None:
                prepare()
        except RunDirBusy as err:
            problem = f"{err}; wait for it to end, or use another {key}"
        except OSError as err:
            problem = f"cannot create the lock file {err.filename or run_dir / LOCK_NAME}: {err.strerror}"
    if info.world_size > 1 and os.environ.get("MASTER_ADDR"):
        store = base_store()
        store_key = f"hydratrain/run_dir/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/hold{_HOLDS}"
        mine = str(Path(run_dir).resolve())
        if info.rank == 0:
            store.set(store_key, json.dumps({"problem": problem, "run_dir": mine, "config": config or {}}))
            # every rank reports (<= 60 s): rank 0 learns of a rank in another dir, and may host the store
            deadline = time.monotonic() + 60
            while store.add(store_key + "/read", 0) < info.world_size - 1 and time.monotonic() < deadline:
                time.sleep(0.02)
            if not problem and store.add(store_key + "/elsewhere", 0) > 0:
                problem = _split(mine, store.get(store_key + "/elsewhere_example").decode(), key)
            if not problem and store.add(store_key + "/differs", 0) > 0:
                differs = json.loads(store.get(store_key + "/differs_example"))
        else:
            answer = json.loads(store_get(store, store_key))
            problem = answer["problem"]
            if answer["run_dir"] != mine:
                store.set(store_key + "/elsewhere_example", f"rank {info.rank}: {mine}")
                store.add(store_key + "/elsewhere", 1)
                problem = problem or _split(answer["run_dir"], f"rank {info.rank}: {mine}", key)
            keys = sorted(k for k in set(answer["config"]) | set(config or {})
                          if answer["config"].get(k, "<absent>") != (config or {}).get(k, "<absent>"))
            if keys:
                differs = {"rank": info.rank, "keys": keys, "rank0": answer["config"].get(keys[0], "<absent>"),
                           "mine": (config or {}).get(keys[0], "<absent>")}
                store.set(store_key + "/differs_example", json.dumps(differs))
                store.add(store_key + "/differs", 1)
            store.add(store_key + "/read", 1)
    _HOLDS += 1
    if problem or differs:
        if lock is not None:
            lock.release()
        if not problem:
            first = differs["keys"][0]
            more = f" (all that differ: {', '.join(differs['keys'])})" if len(differs["keys"]) > 1 else ""
            raise ConfigError(first, differs["rank0"], f"rank {differs['rank']} has {first}={differs['mine']!r}"
                              f"{more}: every rank, on every node, must be launched with the same command and config "
                              "files (the ranks would train different replicas together)")
        raise ConfigError(key, value if value is not None else str(run_dir), f"{which}: {problem}" if which else problem)
    return lock


#: keys that may differ between ranks: the launcher's (``launcher.node_rank``), node-local paths (a node's own copy
#: of the data or of the weights to start from) and what only rank 0 or this node reads (MFU's peak, the plan)
_PER_NODE = ("launcher.", "paths.", "data.cache_dir", "data.paths", "data.train_path", "data.val_path",
             "model.init_from", "checkpoint.resume_from", "plan.", "logger.")


#: of :data:`_PER_NODE`, the paths to what every rank must read alike: whether each is given at all is compared (a
#: node given none would skip the load and its collectives, and every rank would hang in the next one); what they
#: hold is compared once read (the data's fingerprint, the weights')
_PER_NODE_INPUTS = ("data.paths", "data.train_path", "data.val_path", "model.init_from", "checkpoint.resume_from")


def shared_config(cfg) -> dict:
    """The flat ``{key: value}`` of a run config that every rank of a launch must share (:func:`hold_run_dir`):
    all but :data:`_PER_NODE`, and for :data:`_PER_NODE_INPUTS` whether each is given (``<given>``, or its empty
    value)."""

    tree = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    shared = {}
    for key, value in flat_keys(tree).items():
        if key.startswith(_PER_NODE_INPUTS):
            shared[key] = "<given>" if value not in (None, "", []) else value
        elif key != "hydra" and not key.startswith(_PER_NODE):
            shared[key] = value
    return shared


def _split(rank0_dir: str, other: str, key: str) -> str:
    """Why the ranks resolved different run dirs (``other``: ``rank R: <dir>``): the same path under different start
    dirs (nodes started from different directories, ``key`` relative), or a value that differs between processes
    in ``key`` (``${now:...}``)."""
    what = f"the ranks resolved different run dirs (rank 0: {rank0_dir}; {other})"
    a, b = Path(rank0_dir).parts, Path(other.partition(": ")[2]).parts
    tail = 0
    while tail < min(len(a), len(b)) and a[len(a) - 1 - tail] == b[len(b) - 1 - tail]:
        tail += 1
    if tail and a[:len(a) - tail] != b[:len(b) - tail]:
        return (f"{what}: the same {Path(*a[len(a) - tail:])} under {Path(*a[:len(a) - tail])} and "
                f"{Path(*b[:len(b) - tail])}: the nodes were started from different directories; start each node's "
                f"command in the same directory of a filesystem they share, or give {key} (or paths.output_dir) as "
                "an absolute path")
    return (f"{what}: a value that differs between processes, such as ${{now:...}}, is in {key}; build it from "
            "${hydratrain.stamp:}, which every rank of a launch agrees on, or give a fixed path")
