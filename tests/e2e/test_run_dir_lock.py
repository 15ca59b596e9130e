"""Two jobs in one run dir: while a run goes on, a second launch into its run dir (2 ranks) stops on every rank with
exit status 2 and leaves the first run's checkpoints alone; once the first run is killed (SIGKILL: no clean-up), the
next launch takes its lock over and trains."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time

import pytest

from helpers import command, finish, free_port, log_of, run, spawn

pytestmark = pytest.mark.slow


def test_a_second_launch_into_a_running_jobs_run_dir_stops_and_a_killed_jobs_lock_is_taken_over(tmp_path):
    lock = tmp_path / "hydratrain.lock"
    first = spawn(command(["strategy=single", "trainer.max_steps=100000", "checkpoint.every_n_steps=5",
                           f"hydra.run.dir={tmp_path}"]))
    try:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob("checkpoints/step_*")) and time.monotonic() < deadline:
            assert first.poll() is None, first.communicate()[0][-3000:]
            time.sleep(0.5)
        assert lock.exists()
        port = free_port()
        second = [spawn(command(["strategy=ddp", "trainer.max_steps=2", f"hydra.run.dir={tmp_path}"]),
                        env={"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}) for r in range(2)]
        r0, r1 = finish(second[0], timeout=120), finish(second[1], timeout=60)
        assert (r0.returncode, r1.returncode) == (2, 2), (r0.output[-3000:], r1.output[-3000:])
        assert f"in use by another job (host {os.uname().nodename}, pid {first.pid}" in r0.output, r0.output[-3000:]
        assert "config error" not in r1.output  # one line, from rank 0
        assert first.poll() is None  # the first run goes on, its checkpoints where it left them
        assert "superseded" not in log_of(tmp_path, 0)
        assert "max_steps: 100000" in (tmp_path / ".hydra" / "config.yaml").read_text()  # still the first's
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.communicate()
    assert lock.exists()  # SIGKILL: left behind
    third = run(["strategy=single", "trainer.max_steps=2", "checkpoint.auto_resume=false",
                 "trainer.eval_every_n_steps=0"], tmp_path, timeout=120)
    assert third.returncode == 0, third.output[-3000:]
    assert f"its holder, pid {first.pid} on this host, is not running" in third.output
    assert not lock.exists()


def _new_pid_namespaces() -> bool:
    """Whether ``unshare -pf --mount-proc`` works here (root, or user namespaces allowed)."""
    return bool(shutil.which("unshare")) and subprocess.run(["unshare", "-pf", "--mount-proc", "true"],
                                                             capture_output=True).returncode == 0


@pytest.mark.skipif(not _new_pid_namespaces(), reason="cannot make a PID namespace (unshare -pf --mount-proc)")
def test_a_container_killed_and_restarted_takes_its_lock_at_once(tmp_path):
    """A container restart after a SIGKILL (docker restart, a pod after OOMKilled): the same torchrun command in a
    fresh PID namespace, on the same host, whose processes get the pids the killed ones had. The lock's pid is then
    alive (the relaunch's own rank 0's): its start time tells it apart, and the relaunch resumes at once; it was
    refused for 120 s as "in use by another job (host vm, pid 6, ...)"."""
    lock = tmp_path / "hydratrain.lock"
    cmd = ["unshare", "-pf", "--mount-proc",
           *command(["strategy=single", "trainer.max_steps=16", "checkpoint.every_n_steps=2",
                     "trainer.eval_every_n_steps=0", f"hydra.run.dir={tmp_path}"],
                    torchrun=["--standalone", "--nproc_per_node=1"])]
    first = spawn(cmd)
    try:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob("checkpoints/step_*")) and time.monotonic() < deadline:
            assert first.poll() is None, first.communicate()[0][-3000:]
            time.sleep(0.1)
        init = int(open(f"/proc/{first.pid}/task/{first.pid}/children").read().split()[0])  # the namespace's pid 1
        os.kill(init, signal.SIGKILL)  # the kernel kills every process of the namespace: the container is gone
    finally:
        out = finish(first, timeout=60).output
    holder = json.loads(lock.read_text())  # SIGKILL: left behind
    second = finish(spawn(cmd), timeout=180)
    assert second.returncode == 0, (out[-2000:], second.output[-3000:])
    assert (f"its holder, pid {holder['pid']} on this host, is not running (that pid is now another process)"
            in second.output), second.output[-3000:]
    assert "in use by another job" not in second.output and not lock.exists()


def test_launches_started_together_without_a_run_dir_each_get_their_own(tmp_path):
    """A shell loop of ``python train.py ... &`` (or a SLURM job array): started in the same second, in the same
    place, each launch gets its own default run dir (``<time>``, ``<time>-1``, ...) and trains."""
    procs = [spawn(command(["strategy=single", "trainer.max_steps=2", "trainer.eval_every_n_steps=0",
                            f"trainer.seed={seed}", f"paths.output_dir={tmp_path}"])) for seed in range(3)]
    for proc in procs:
        assert finish(proc, timeout=180).returncode == 0
    dirs = sorted(p.parent for p in tmp_path.glob("outputs/*/*/results.json"))
    assert len(dirs) == 3, list(tmp_path.rglob("*"))
    seeds = {(d / ".hydra" / "config.yaml").read_text().split("seed: ")[1].split()[0] for d in dirs}
    assert seeds == {"0", "1", "2"}


def test_ranks_that_resolve_different_run_dirs_stop_before_training(tmp_path):
    """``hydra.run.dir`` built from a per-process value (``${now:%f}``; here the rank, to be deterministic): each rank
    would write its shards into its own dir and exit 0 with no whole checkpoint. Every rank stops with status 2."""
    port = free_port()
    ranks = [spawn(command(["strategy=ddp", "trainer.max_steps=3", "checkpoint.every_n_steps=3",
                            f"hydra.run.dir={tmp_path}/r${{hydratrain.rank:}}"]),
                   env={"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}) for r in range(2)]
    r0, r1 = finish(ranks[0], timeout=120), finish(ranks[1], timeout=60)
    assert (r0.returncode, r1.returncode) == (2, 2), (r0.output[-3000:], r1.output[-3000:])
    assert f"the ranks resolved different run dirs (rank 0: {tmp_path}/r0; rank 1: {tmp_path}/r1)" in r0.output
    assert not list(tmp_path.glob("r*/checkpoints"))
