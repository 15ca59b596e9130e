"""launcher=ray on one local Ray cluster of 2 CPUs, started once for this module (Ray's start-up is slow): a 2-job
sweep whose job dirs look like the torchrun launcher's, a failed worker reported with its rank and message, and a
killed worker restarted by Ray (launcher.max_failures) that resumes from the latest checkpoint in the same run dir."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from helpers import FAULTY, clean_env, log_of, requires, results, run, tb_scalars

pytestmark = requires("ray")

# every job on the shared cluster; the fault variables reach its workers through the launcher's forward_env
RAY = ["launcher=ray", "launcher.num_workers=2", "trainer.eval_every_n_steps=0",
       'hydra.launcher.forward_env=["HYDRATRAIN_*","HT_FAULT*"]']
# a throw-away cluster of this test only: no token (with one, a driver must find the token its cluster generated)
NO_AUTH = {"RAY_AUTH_MODE": "disabled"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """``ray start --head --block`` with 2 CPUs in its own session; its address; stopped (its process group,
    nothing else) at the end."""
    port = _free_port()
    temp = tmp_path_factory.mktemp("ray")
    ray_cli = str(Path(sys.executable).with_name("ray"))
    proc = subprocess.Popen([ray_cli, "start", "--head", f"--port={port}", "--num-cpus=2", "--block",
                             "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp}"],
                            env=clean_env(**NO_AUTH), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    seen = []
    for line in proc.stdout:  # "Ray runtime started." once the head node is up (--block keeps it running)
        seen.append(line)
        if "Ray runtime started" in line:
            break
    else:
        raise AssertionError(f"ray start exited {proc.wait()}: {''.join(seen)[-3000:]}")
    threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep draining its output
    yield f"127.0.0.1:{port}"
    os.killpg(proc.pid, signal.SIGINT)  # ray start --block stops its processes on Ctrl-C
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _report(sweep: Path) -> str:
    return (sweep / "sweep_report.md").read_text()


@pytest.mark.slow
def test_a_two_job_sweep_behaves_as_under_torchrun(tmp_path, cluster):
    sweep = tmp_path / "sweep"
    r = run(["-m", *RAY, f"launcher.address={cluster}", "strategy=ddp,fsdp", f"hydra.sweep.dir={sweep}"],
            env=NO_AUTH, timeout=400).ok()
    report = _report(sweep)
    assert report.count("COMPLETED") == 2, report
    for job in ("0", "1"):
        d = sweep / job
        assert {"train_rank0.log", "train_rank1.log", ".hydra", "tensorboard", "results.json"} <= \
            {p.name for p in d.iterdir()}, list(d.iterdir())
        assert results(d)["steps"] == 10 and sorted(tb_scalars(d)) == list(range(1, 11))
        assert "process group: the launcher's (backend=gloo world_size=2 rank=1" in log_of(d, 1)
    # the same seed trains the same trajectory under either strategy, as under torchrun
    assert tb_scalars(sweep / "0") == pytest.approx(tb_scalars(sweep / "1"), rel=1e-4)
    assert r.output.count("process group: the launcher's") == 2  # rank 0 only prints, one line per job


@pytest.mark.slow
def test_a_failed_worker_is_reported_with_its_rank_and_message(tmp_path, cluster):
    sweep = tmp_path / "sweep"
    r = run(["-m", *RAY, f"launcher.address={cluster}", "strategy=ddp", f"hydra.sweep.dir={sweep}"], script=FAULTY,
            env={**NO_AUTH, "HT_FAULT": "raise", "HT_FAULT_RANK": "1", "HT_FAULT_STEP": "3"}, timeout=400)
    assert r.returncode == 1, r.output[-3000:]
    line = "LaunchError: job #0: rank 1 failed (after 0 restart(s) allowed): RuntimeError: injected fault on rank 1 " \
           "at step 3"
    assert line in _report(sweep) and line in r.output, _report(sweep)


@pytest.mark.slow
def test_a_killed_worker_is_restarted_and_resumes_from_the_latest_checkpoint(tmp_path, cluster):
    sweep = tmp_path / "sweep"
    r = run(["-m", *RAY, f"launcher.address={cluster}", "strategy=fsdp", "launcher.max_failures=1",
             "checkpoint.every_n_steps=2", f"hydra.sweep.dir={sweep}"], script=FAULTY,
            env={**NO_AUTH, "HT_FAULT": "kill", "HT_FAULT_RANK": "1", "HT_FAULT_STEP": "4", "HT_FAULT_AT": "after_step",
                 "HT_FAULT_ONCE": "1"}, timeout=600).ok()
    job = sweep / "0"
    assert (job / "fault_rank1_step4").exists(), r.output[-3000:]
    assert f"resumed from {job / 'checkpoints' / 'step_00000004'}" in log_of(job)
    assert results(job)["steps"] == 10 and sorted(tb_scalars(job)) == list(range(1, 11))
    assert "COMPLETED" in _report(sweep)
