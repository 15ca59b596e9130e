"""One job per run dir (hydratrain.dist.run_lock): a second job finds the lock held and stops with exit status 2
before it touches the run dir's checkpoints; a lock left by a dead job, or by an earlier attempt of this launch, is
taken over."""
from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from hydratrain.dist import run_lock
from hydratrain.dist.run_lock import LOCK_NAME, RunDirBusy, RunDirLock, launch_identity, left_behind


def _dead_pid() -> int:
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout)


def _write_lock(run_dir, age_s: float = 0.0, **holder):
    path = run_dir / LOCK_NAME
    path.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getppid(), "launch": "pid:elsewhere:1",
                                "started": time.time() - age_s, **holder}))
    os.utime(path, (time.time() - age_s, time.time() - age_s))
    return path


def test_a_held_run_dir_refuses_a_second_job_until_the_first_releases_it(tmp_path, monkeypatch):
    first = RunDirLock(tmp_path).acquire()
    monkeypatch.setenv("SLURM_JOB_ID", "77")  # another launch, on this host, while the holder (this pid) lives
    second = RunDirLock(tmp_path)
    with pytest.raises(RunDirBusy, match=f"in use by another job .*pid {os.getpid()}, launch pid:"):
        second.acquire()
    first.release()
    assert not (tmp_path / LOCK_NAME).exists()
    second.acquire()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["launch"] == "slurm:77.batch"
    first.release()  # not its lock any more: left alone
    assert (tmp_path / LOCK_NAME).exists()
    second.release()


def test_which_locks_are_left_behind():
    me = {"host": "n1", "pid": 10, "launch": "torchelastic:abc@n1:29500"}
    alive, dead = (lambda pid: True), (lambda pid: False)
    assert left_behind({"host": "n2", "pid": 5, "launch": "x"}, me, 3.0, alive) is None
    assert left_behind({"host": "n1", "pid": 5, "launch": "x"}, me, 3.0, alive) is None
    assert "not running" in left_behind({"host": "n1", "pid": 5, "launch": "x"}, me, 3.0, dead)
    assert left_behind({"host": "n2", "pid": 5, "launch": "x"}, me, 3.0, dead) is None  # another host's pid
    assert "has not refreshed it for 121 s" in left_behind({"host": "n2", "pid": 5, "launch": "x"}, me, 121.0, alive)
    assert "this launch's own" in left_behind({"host": "n2", "pid": 5, "launch": me["launch"]}, me, 0.0, alive)
    assert "is not running" in left_behind({"host": "n1", "pid": 5, "launch": me["launch"]}, me, 0.0, dead)
    # two processes of one SLURM allocation (one launch identity) on one host: the live one holds it
    assert left_behind({"host": "n1", "pid": 5, "launch": me["launch"]}, me, 3.0, alive) is None
    assert "has not refreshed" in left_behind({"host": "n1", "pid": 5, "launch": "x"}, me, 121.0, alive)  # pid reused


def test_a_pid_that_is_now_another_process_is_not_running():
    """A container restarted after a SIGKILL (docker restart, a pod after OOMKilled) has a fresh PID namespace and the
    same hostname: its processes get the pids the killed ones had, possibly the relaunch's own rank 0's. The start
    time recorded with the pid tells them apart (not refused for 120 s as "in use by another job")."""
    me = {"host": "n1", "pid": 6, "launch": "torchelastic:new@localhost:2", "pid_start": 9000, "boot": "b1"}
    alive, dead = (lambda pid: True), (lambda pid: False)
    started = {7: 100}.get  # pid 7 runs since tick 100; other pids' start times cannot be read

    def why(age_s=3.0, pid_alive=alive, me=me, **holder):
        holder = {"host": "n1", "pid": 7, "launch": "torchelastic:old@localhost:1", "pid_start": 100, "boot": "b1",
                  **holder}
        return left_behind(holder, me, age_s, pid_alive, started)

    assert why() is None  # pid 7 is the process that wrote the lock
    assert why(pid_start=50) == "its holder, pid 7 on this host, is not running (that pid is now another process)"
    assert why(pid=6) == "its holder, pid 6 on this host, is not running (that pid is now another process)"  # me
    assert "is not running" in why(pid=6, launch=me["launch"])
    assert why(pid=6, pid_start=9000) is None  # this very process holds it (for another launch): running
    assert "this launch's own" in why(pid=6, pid_start=9000, launch=me["launch"])
    assert why(pid_start=50, pid_alive=dead) == "its holder, pid 7 on this host, is not running"
    assert why(pid=8) is None  # alive, its start time hidden (/proc mounted with hidepid): the pid alone
    # the very process that wrote it, stopped (Ctrl-Z, scontrol suspend) for longer than the heartbeat: still its
    # (taken over, it would carry on after SIGCONT into the same run dir); unproven, the heartbeat rules
    assert why(500.0) is None
    assert "has not refreshed it for 500 s" in why(500.0, pid=8)
    # another boot id: a machine of the same name, or this one rebooted: start times say nothing; the heartbeat does
    assert why(boot="b0", pid_start=50, pid_alive=dead) is None
    assert "has not refreshed it for 121 s" in why(121.0, boot="b0", pid_start=50, pid_alive=dead)
    # a lock of the previous version (no start time): the pid alone; but this process, which records its start
    # time, did not write one without it
    assert why(pid_start=None, boot=None) is None
    assert "is not running" in why(pid_start=None, boot=None, pid_alive=dead)
    assert why(pid=6, pid_start=None, boot=None) == ("its holder, pid 6 on this host, is not running (that pid is now "
                                                     "another process)")
    # no /proc here (not Linux): the previous rules
    old_me = {**me, "pid_start": None, "boot": None}
    assert why(pid=6, me=old_me) is None and why(pid_start=50, me=old_me) is None
    assert "is not running" in why(pid_start=50, me=old_me, pid_alive=dead)


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="no /proc (not Linux)")
def test_a_lock_of_a_pid_reused_by_a_restarted_container_is_taken_over_at_once(tmp_path, caplog):
    """The lock names this very process's pid (and its parent's, alive), each with another start time: both are
    left behind by processes that had those pids before, and taken over at once. With the right start time the
    parent holds it."""
    boot = open("/proc/sys/kernel/random/boot_id").read().strip()
    for pid in (os.getpid(), os.getppid()):
        _write_lock(tmp_path, pid=pid, launch="torchelastic:killed@localhost:43075", pid_start=1, boot=boot)
        with caplog.at_level(logging.WARNING, logger="hydratrain.dist.run_lock"):
            lock = RunDirLock(tmp_path).acquire()
        assert f"pid {pid} on this host, is not running (that pid is now another process)" in caplog.text
        assert json.loads(lock.path.read_text())["pid_start"] == int(open("/proc/self/stat").read().split(")")[-1]
                                                                     .split()[19])
        lock.release()
        caplog.clear()
    parent_start = int(open(f"/proc/{os.getppid()}/stat").read().rpartition(")")[2].split()[19])
    _write_lock(tmp_path, pid=os.getppid(), pid_start=parent_start, boot=boot)
    with pytest.raises(RunDirBusy, match=f"in use by another job .*pid {os.getppid()}"):
        RunDirLock(tmp_path).acquire()


@pytest.mark.parametrize("holder, age_s, why", [
    ({"pid": "dead"}, 0.0, "is not running"),  # killed with SIGKILL on this host
    ({"host": "other-node"}, 300.0, "has not refreshed it for 300 s"),  # died on another host
    ({"host": "other-node", "launch": "same"}, 0.0, "this launch's own"),  # torchrun restarted this launch's ranks
])
def test_a_lock_left_behind_is_taken_over_with_a_warning(tmp_path, caplog, holder, age_s, why):
    holder = {**holder, **({"pid": _dead_pid()} if holder.get("pid") == "dead" else {})}
    if holder.get("launch") == "same":
        holder["launch"] = launch_identity()
    _write_lock(tmp_path, age_s, **holder)
    with caplog.at_level(logging.WARNING, logger="hydratrain.dist.run_lock"):
        lock = RunDirLock(tmp_path).acquire()
    assert why in caplog.text and json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert [p.name for p in tmp_path.iterdir()] == [LOCK_NAME]
    lock.release()


def test_the_holder_keeps_its_lock_fresh(tmp_path, monkeypatch):
    monkeypatch.setattr(run_lock, "HEARTBEAT_S", 0.05)
    lock = RunDirLock(tmp_path).acquire()
    os.utime(lock.path, (time.time() - 500, time.time() - 500))
    time.sleep(0.3)
    assert time.time() - lock.path.stat().st_mtime < 5
    lock.release()


def test_launch_identity_is_shared_by_the_ranks_of_one_launch_and_its_restarts(monkeypatch):
    for key in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "SUBMITIT_LOCAL_JOB_ID", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    assert launch_identity() == f"pid:{socket.gethostname()}:{os.getpid()}"
    monkeypatch.setenv("MASTER_ADDR", "n1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")
    assert launch_identity() == "torchelastic:abc@n1:29500"
    monkeypatch.setenv("SLURM_JOB_ID", "123")
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    assert launch_identity() == "slurm:123.0"


def test_a_run_in_a_run_dir_another_job_holds_stops_with_status_2_and_touches_nothing(cli, tmp_path):
    held = _write_lock(tmp_path)  # the job that started this process: alive, on this host, another launch
    before = held.read_text()
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "config.yaml").write_text("the running job's config\n")
    run = cli(["trainer.max_steps=2"], tmp_path)
    assert run.returncode == 2, run.output
    assert "hydratrain: config error: hydra.run.dir=" in run.err and "in use by another job" in run.err
    assert f"pid {os.getppid()}" in run.err and "use another hydra.run.dir" in run.err
    assert held.read_text() == before
    assert (tmp_path / ".hydra" / "config.yaml").read_text() == "the running job's config\n"
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "tensorboard").exists()


def test_launches_in_the_same_second_get_their_own_default_run_dirs(tmp_path, monkeypatch):
    from hydratrain.dist import run_dir

    for key in ("HYDRATRAIN_STAMP", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(run_dir, "time", SimpleNamespace(strftime=lambda fmt: "2026-12-01/06-00-00"))

    def launch(stamp_from_launcher=None):
        monkeypatch.setattr(run_dir, "_STAMP", None)
        monkeypatch.setattr(run_dir, "_UNIQUE_DIRS", {})
        monkeypatch.delenv("HYDRATRAIN_STAMP", raising=False)
        if stamp_from_launcher:
            monkeypatch.setenv("HYDRATRAIN_STAMP", stamp_from_launcher)
        return run_dir.unique_dir(str(tmp_path), "outputs")

    first, second, third = launch(), launch(), launch()
    base = f"{tmp_path}/outputs/2026-12-01/06-00-00"
    assert (first, second, third) == (base, f"{base}-1", f"{base}-2")
    assert os.environ["HYDRATRAIN_STAMP"] == "2026-12-01/06-00-00-2"  # what the processes it starts inherit
    assert launch("2026-12-01/06-00-00-1") == second  # a process a launcher started: the launcher's dir
    assert sorted(p.name for p in (tmp_path / "outputs" / "2026-12-01").iterdir()) == [
        "06-00-00", "06-00-00-1", "06-00-00-2"]


def test_a_zombie_holder_is_not_running_and_a_lock_of_json_that_is_no_object_is_unreadable(tmp_path):
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while run_lock._pid_alive(zombie.pid) and time.monotonic() < deadline:  # exits; not reaped yet: a zombie
        time.sleep(0.05)
    assert not run_lock._pid_alive(zombie.pid) and run_lock._pid_alive(os.getpid())
    zombie.wait()
    (tmp_path / LOCK_NAME).write_text("[1, 2]")
    os.utime(tmp_path / LOCK_NAME, (time.time() - 300, time.time() - 300))
    RunDirLock(tmp_path).acquire().release()  # an unreadable lock untouched for 300 s: taken over, no traceback


def test_a_rank_that_ends_itself_for_a_failed_peer_leaves_no_lock(tmp_path, monkeypatch):
    """The failure watch ends its rank with os._exit (no finally runs): the lock goes first, so the next launch
    needs no take-over (and, from another host, no 120 s wait)."""
    from hydratrain.dist import process_group

    lock = RunDirLock(tmp_path).acquire()
    exits = []
    monkeypatch.setattr(process_group.os, "_exit", exits.append)
    process_group.FailureWatch._die(SimpleNamespace(rank=0), "rank 1 stopped responding")
    assert exits == [process_group.EXIT_PEER_FAILED]
    assert not (tmp_path / LOCK_NAME).exists()
    assert not run_lock._HELD
    lock.release()  # idempotent


@pytest.mark.parametrize("multirun", [False, True])
def test_a_run_dir_that_cannot_be_created_is_one_config_line(cli, tmp_path, multirun):
    """paths.output_dir under a file (or read-only, or missing on a node): exit status 2 with one line naming the
    key and the dir, not the resolver's traceback."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    run = cli([*(["-m"] if multirun else []), f"paths.output_dir={blocker}", "trainer.max_steps=1"])
    assert run.returncode == 2, run.output
    line = f"hydratrain: config error: paths.output_dir='{blocker}': cannot create the run dir {blocker}/"
    assert line in run.err and "Not a directory" in run.err, run.err
    assert "Traceback" not in run.output and len(run.err.strip().splitlines()) == 1, run.err


@pytest.mark.parametrize("multirun", [False, True])
def test_a_run_dir_under_an_unset_variable_is_one_config_line(cli, multirun, monkeypatch):
    """paths.output_dir=${oc.env:SCRATCH}/runs, the cluster idiom, with SCRATCH unset: the one line every other
    unresolvable key gives, exit status 2. It was Hydra's 190-line traceback of its run dir."""
    monkeypatch.delenv("HT_UNSET_SCRATCH", raising=False)
    run = cli([*(["-m"] if multirun else []), "paths.output_dir=${oc.env:HT_UNSET_SCRATCH}/runs",
               "trainer.max_steps=1"])
    assert run.returncode == 2, run.output[-3000:]
    assert run.err.strip() == ("hydratrain: config error: paths.output_dir='${oc.env:HT_UNSET_SCRATCH}/runs': cannot "
                               "be resolved: KeyError raised while resolving interpolation: \"Environment variable "
                               "'HT_UNSET_SCRATCH' not found\""), run.err[-3000:]


def test_a_run_without_paths_makes_no_placeholder_dir(cli, tmp_path, monkeypatch):
    """``~paths`` made a dir literally named ``<paths.output_dir>`` in the launch dir before the config error."""
    monkeypatch.chdir(tmp_path)
    run = cli(["~paths", "trainer.max_steps=1"])
    assert run.returncode == 2 and run.err.strip().startswith(
        "hydratrain: config error: paths.output_dir='<missing>': the run dir is built on it"), run.output[-3000:]
    assert list(tmp_path.iterdir()) == []


def test_printing_the_resolved_config_reserves_no_run_dir(cli, tmp_path):
    run = cli(["--cfg", "all", "--resolve", f"paths.output_dir={tmp_path}"])
    assert run.returncode == 0, run.output
    assert f"dir: {tmp_path}/outputs/" in run.out and f"dir: {tmp_path}/multirun/" in run.out
    assert list(tmp_path.iterdir()) == []
    # Hydra's own part alone (no paths.* there): it was an InterpolationKeyError traceback
    run = cli(["--cfg", "hydra", "--resolve", f"paths.output_dir={tmp_path}"])
    assert run.returncode == 0 and "Traceback" not in run.output, run.output[-3000:]
    assert "dir: <paths.output_dir>/outputs/" in run.out and list(tmp_path.iterdir()) == []


def test_a_sweep_job_whose_run_dir_is_held_names_the_sweep_dir_and_the_job(cli, tmp_path):
    (tmp_path / "0").mkdir()
    _write_lock(tmp_path / "0")
    run = cli(["-m", "trainer.max_steps=1", f"hydra.sweep.dir={tmp_path}"])
    assert run.returncode != 0
    assert (f"hydratrain: config error: hydra.sweep.dir='{tmp_path}': job 0's run dir {tmp_path}/0: in use by "
            "another job") in run.err, run.output[-3000:]


def test_a_config_error_leaves_no_default_run_dir_behind(cli, tmp_path):
    """A typo on the command line stops the run before it starts: the run dir this launch made for it (only its
    .hydra/ and log in it) goes too. A run dir given by the user stays."""
    run = cli(["optim.lr=-1", f"paths.output_dir={tmp_path}"])
    assert run.returncode == 2 and "hydratrain: config error: optim.lr=-1.0" in run.err, run.output[-3000:]
    assert not (tmp_path / "outputs").exists()
    given = tmp_path / "given"
    assert cli(["optim.lr=-1"], given).returncode == 2
    assert (given / ".hydra").is_dir()


def test_a_lock_that_cannot_be_written_leaves_no_empty_lock_behind(tmp_path, monkeypatch):
    """On a full disk the lock file is created but its holder cannot be written: the empty file used to stay and
    refuse the next launch for two minutes as "an unreadable lock" after the disk had room again."""
    import errno
    import json

    from hydratrain.dist.run_lock import LOCK_NAME, RunDirLock

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(json, "dump", full)
    with pytest.raises(OSError) as err:
        RunDirLock(tmp_path).acquire()
    assert err.value.errno == errno.ENOSPC and err.value.filename == str(tmp_path / LOCK_NAME)
    assert not (tmp_path / LOCK_NAME).exists()
    monkeypatch.undo()
    RunDirLock(tmp_path).acquire().release()  # room again: the next launch takes it at once


def test_a_rank_waiting_for_rank_0s_answer_still_runs_its_signal_handlers():
    """store_get and _all_arrived poll: a blocking TCPStore get (or init_process_group's wait) deferred the
    start-up guard's SIGTERM handler, so a rank whose rank 0 died before answering ignored torchrun's SIGTERM until
    the SIGKILL 30 s later."""
    import signal
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from hydratrain.dist.process_group import _all_arrived
    from hydratrain.dist.store import store_get

    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=30))
    threading.Timer(0.3, lambda: store.set("answer", "42")).start()
    assert store_get(store, "answer", timeout_s=10) == b"42"
    with pytest.raises(TimeoutError, match="no answer in the launch's store after 0 s"):
        store_get(store, "never", timeout_s=0.2)

    class Signalled(Exception):
        pass

    def handler(signum, frame):
        raise Signalled()

    previous = signal.signal(signal.SIGALRM, handler)
    try:
        for wait in (lambda: store_get(store, "never", timeout_s=20),
                     lambda: _all_arrived(store, "job", 2, 20)):  # rank 1 of 2, before init_process_group
            signal.setitimer(signal.ITIMER_REAL, 0.2)
            started = time.monotonic()
            with pytest.raises(Signalled):
                wait()
            assert time.monotonic() - started < 2
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    with pytest.raises(TimeoutError, match="only 2 of 3 ranks reached the process group's creation within"):
        _all_arrived(store, "job", 3, 0.2)  # the second arrival on this prefix


def test_run_dirs_that_differ_only_in_the_start_dir_are_blamed_on_the_start_dirs():
    """Nodes started from different directories resolve the default (relative) run dir under each; the refusal
    blamed ${now:...}, which the default does not use."""
    same_tail = run_lock._split("/a/x/outputs/2026-12-01/12-00-00", "rank 1: /b/outputs/2026-12-01/12-00-00",
                                "hydra.run.dir")
    assert "the same outputs/2026-12-01/12-00-00 under /a/x and /b: the nodes were started from different " \
           "directories" in same_tail and "${now" not in same_tail
    stamped = run_lock._split("/a/outputs/12-00-01", "rank 1: /a/outputs/12-00-02", "hydra.run.dir")
    assert "such as ${now:...}, is in hydra.run.dir; build it from ${hydratrain.stamp:}" in stamped


def test_a_lock_copied_with_its_run_dir_is_not_the_original_runs(tmp_path, caplog):
    """``cp -a runs/a runs/b`` while run a goes on (to branch off it): a launch into the copy was refused as "in use
    by another job" -- run a, which holds runs/a, not the copy. The lock records its dir's inode;
    on this host a lock in another dir is taken over at once, and the original stays held."""
    original, copy = tmp_path / "a", tmp_path / "b"
    original.mkdir()
    held = RunDirLock(original).acquire()  # this process: alive, with its start time
    try:
        copy.mkdir()
        (copy / LOCK_NAME).write_text((original / LOCK_NAME).read_text())
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("SLURM_JOB_ID", "78")  # another launch on this host, while the holder lives
            with caplog.at_level(logging.WARNING, logger="hydratrain.dist.run_lock"):
                RunDirLock(copy).acquire().release()
            assert "it was copied here with the run dir" in caplog.text
            with pytest.raises(RunDirBusy, match="in use by another job"):
                RunDirLock(original).acquire()
    finally:
        held.release()
