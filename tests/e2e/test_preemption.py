"""Preemption under SLURM through submitit: the time-limit signal is SIGUSR2 to rank 0; every rank saves, then
submitit's own handler requeues the job (rank 0), and every rank exits with checkpoint.preempt_exit_code."""
from __future__ import annotations

import os
import re
import signal
import time

from helpers import FAULTY, finish, log_of, start
from hydratrain.checkpoint.manager import latest_checkpoint


def _worker_pids(launcher_pid: int) -> dict[int, int]:
    """{RANK: pid} of the workers torchrun ``launcher_pid`` started."""
    from pathlib import Path

    out = {}
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == launcher_pid:
                env = dict(x.split("=", 1) for x in (d / "environ").read_text().split("\0") if "=" in x)
                out[int(env["RANK"])] = int(d.name)
        except (OSError, ValueError, KeyError, IndexError):
            continue
    return out


def test_sigusr2_under_submitit_saves_on_every_rank_then_requeues(tmp_path):
    run_dir, markers = tmp_path / "run", tmp_path / "markers"
    markers.mkdir()
    proc = start(["strategy=ddp", "trainer.max_steps=400", "trainer.eval_every_n_steps=0",
                  "checkpoint.every_n_steps=0"], run_dir, nproc=2, script=FAULTY,
                 env={"SUBMITIT_EXECUTOR": "slurm", "HT_FAKE_SUBMITIT": str(markers)})
    try:
        deadline = time.time() + 180
        while not ((run_dir / "train_rank0.log").exists() and "step 3/400" in log_of(run_dir)):
            assert proc.poll() is None and time.time() < deadline, "the run did not reach step 3"
            time.sleep(0.2)
        os.kill(_worker_pids(proc.pid)[0], signal.SIGUSR2)
        r = finish(proc, timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    codes = [int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", r.output)]
    assert codes and all(c == 75 for c in codes), r.output[-3000:]
    saved = latest_checkpoint(run_dir / "checkpoints")
    step = int(saved.name.split("_")[1])
    for rank in (0, 1):
        assert f"stopping at step {step} after a preemption signal" in log_of(run_dir, rank)
    assert "SIGUSR2 received" in log_of(run_dir, 0)
    assert sorted(p.name for p in markers.iterdir()) == ["requeued_rank0"]  # submitit's handler ran once, rank 0
