"""Helpers for the launcher tests: run train.py (or torchrun) in a subprocess with a deadline, tiny configs."""
from __future__ import annotations

import csv
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import List, Optional

ROOT = Path(__file__).resolve().parents[1]
TRAIN = str(ROOT / "train.py")
FAIL_TASK = str(ROOT / "tests" / "_fail_task.py")  # train.py twin whose jobs fail as $HYDRATRAIN_TEST_FAIL says
# seconds-long runs: synthetic data, 2 layers, 10 steps, fp32 (bf16/fp16 are slow on CPU), no matmul benchmark
FAST = ["+debug=fast", "precision=fp32", "device=cpu", "logger.peak_flops=1e11"]


def env_for_tests() -> dict:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", HYDRA_FULL_ERROR="1", PYTHONUNBUFFERED="1")
    env.pop("HYDRATRAIN_STAMP", None)
    for key in [k for k in env if k.startswith(("TORCHELASTIC_", "SUBMITIT_", "SLURM_"))] + \
            ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"]:
        env.pop(key, None)
    return env


def start(args: List[str], cwd: Path, env: Optional[dict] = None) -> subprocess.Popen:
    """Start ``args`` in its own process group (so a timeout can end it and all its workers)."""
    return subprocess.Popen(args, cwd=str(cwd), env=env or env_for_tests(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str]:
    """Wait for ``proc``; on timeout kill its process group and fail. Returns (returncode, combined output)."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"timed out after {timeout} s (a hang?):\n{out[-4000:]}")
    return proc.returncode, out


def run(args: List[str], cwd: Path, timeout: float = 180, env: Optional[dict] = None) -> tuple[int, str]:
    return finish(start(args, cwd, env), timeout)


def train(args: List[str], cwd: Path, timeout: float = 180, script: str = TRAIN, env: Optional[dict] = None,
          fast: List[str] = FAST) -> tuple[int, str]:
    """``python train.py ARGS`` (with ``fast``, default :data:`FAST`, prepended) in ``cwd``; ``env``: extra
    environment variables."""
    flags = [a for a in args if a == "-m"]  # argparse wants -m before the overrides
    return run([sys.executable, script, *flags, *fast, *[a for a in args if a != "-m"]], cwd, timeout,
               env=dict(env_for_tests(), **(env or {})))


def torchrun(torchrun_args: List[str], args: List[str], cwd: Path) -> subprocess.Popen:
    flags = [a for a in args if a == "-m"]
    return start([sys.executable, "-m", "torch.distributed.run", *torchrun_args, TRAIN, *flags, *FAST,
                  *[a for a in args if a != "-m"]], cwd)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def report_rows(sweep_dir: Path) -> List[dict]:
    with (sweep_dir / "sweep_report.csv").open() as f:
        return list(csv.DictReader(f))


def results(job_dir: Path) -> dict:
    return json.loads((job_dir / "results.json").read_text())


def hparams_runs(log_dir: Path) -> dict:
    """{run: hparams session-start bytes} as TensorBoard's hparams plugin reads ``log_dir`` (one row per run)."""
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    mux = EventMultiplexer()
    mux.AddRunsFromDirectory(str(log_dir))
    mux.Reload()
    content = mux.PluginRunToTagToContent("hparams")
    return {run: tags["_hparams_/session_start_info"] for run, tags in content.items()
            if "_hparams_/session_start_info" in tags}
