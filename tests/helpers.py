"""The one set of test helpers: the fast-override list, one way to run train.py (or a twin) as a subprocess, and
readers of what a run leaves behind (TensorBoard scalars, results.json, checkpoints)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
TRAIN = str(ROOT / "train.py")
FAULTY = str(ROOT / "tests" / "scripts" / "faulty_train.py")  # reads HT_FAULT* (see its docstring)
# A run of seconds: synthetic data, 2 layers, 10 steps, fp32 (exact on CPU; bf16/fp16 are slow on some CPUs), no
# progress bar, sample or weights, no matmul benchmark for MFU.
FAST = ["+debug=fast", "precision=fp32", "device=cpu", "logger.peak_flops=1e11"]
LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "HYDRATRAIN_STAMP")


def clean_env(**extra: str) -> dict:
    """This process's environment without any launcher's variables, one thread per rank, unbuffered output."""
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCH_VARS and not k.startswith(("TORCHELASTIC_", "SUBMITIT_", "SLURM_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def command(args: Sequence[str], nproc: int = 1, script: str = TRAIN, fast: bool = True) -> list[str]:
    """``python SCRIPT [FAST] ARGS``, under ``torch.distributed.run --standalone`` when ``nproc`` > 1 (``-m`` is put
    first, as Hydra's argparse wants)."""
    flags = [a for a in args if a == "-m"]
    rest = [a for a in args if a != "-m"]
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc > 1 else []
    return [sys.executable, *launcher, script, *flags, *(FAST if fast else []), *rest]


@dataclass
class Run:
    returncode: int
    output: str  # stdout and stderr, interleaved
    seconds: float
    cmd: list

    def ok(self) -> "Run":
        assert self.returncode == 0, f"exit {self.returncode}: {' '.join(self.cmd)}\n{self.output[-5000:]}"
        return self


def start(args: Sequence[str], run_dir: Optional[Path] = None, nproc: int = 1, script: str = TRAIN,
          env: Optional[dict] = None, cwd: Path = ROOT, fast: bool = True) -> subprocess.Popen:
    """Start a run in its own session (so :func:`finish` can kill it and every worker on a timeout)."""
    cmd = command([*args, *([f"hydra.run.dir={run_dir}"] if run_dir is not None else [])], nproc, script, fast)
    proc = subprocess.Popen(cmd, cwd=str(cwd), env=clean_env(**(env or {})), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    proc.cmd, proc.t0 = cmd, time.monotonic()
    return proc


def finish(proc: subprocess.Popen, timeout: float = 300) -> Run:
    """Wait for a :func:`start`-ed run; on timeout kill its whole session and fail the test."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"timed out after {timeout} s (a hang?): {' '.join(proc.cmd)}\n{out[-4000:]}")
    return Run(proc.returncode, out, time.monotonic() - proc.t0, proc.cmd)


def run(args: Sequence[str], run_dir: Optional[Path] = None, nproc: int = 1, script: str = TRAIN,
        env: Optional[dict] = None, cwd: Path = ROOT, timeout: float = 300, fast: bool = True) -> Run:
    """Run train.py (or a twin) with :data:`FAST` + ``args`` to completion; check with ``.ok()``."""
    return finish(start(args, run_dir, nproc, script, env, cwd, fast), timeout)


def tb_scalars(run_dir: Path, tag: str = "train/loss") -> dict[int, float]:
    """``{step: value}`` of ``tag`` over every TensorBoard event file under ``run_dir`` (later files win)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.util import tensor_util

    out: dict[int, float] = {}
    for f in sorted(Path(run_dir).rglob("events.out.tfevents.*"), key=os.path.getmtime):
        for event in EventFileLoader(str(f)).Load():
            for v in event.summary.value:
                if v.tag == tag:
                    out[event.step] = float(tensor_util.make_ndarray(v.tensor)) if v.HasField("tensor") \
                        else v.simple_value
    return out


def results(run_dir: Path) -> dict:
    return json.loads((Path(run_dir) / "results.json").read_text())


def log_of(run_dir: Path, rank: int = 0) -> str:
    return (Path(run_dir) / f"train_rank{rank}.log").read_text()


def ckpt_of(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:08d}"
