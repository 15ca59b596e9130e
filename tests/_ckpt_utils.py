"""Helpers for the checkpoint tests: launch train.py on 1..N gloo ranks, read TensorBoard scalars and weights."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRAIN = str(REPO / "train.py")

# A run of a few seconds: tiny GPT, synthetic data, fp32 (exact on CPU), every step logged.
FAST = ["+debug=fast", "precision=fp32", "strategy=fsdp", "trainer.progress_bar=false", "trainer.sample_tokens=0",
        "trainer.log_every_n_steps=1", "trainer.eval_samples=8", "logger.peak_flops=1e12", "device=cpu"]


FAULTY = str(REPO / "tests" / "scripts" / "faulty_train.py")


def launch(nproc: int, run_dir: Path, *overrides: str, timeout: float = 300, check: bool = True,
           background: bool = False, script: str = TRAIN, env: dict | None = None):
    """Run train.py with FAST + ``overrides`` in ``run_dir`` on ``nproc`` processes (torchrun when > 1).

    Returns the CompletedProcess (or the Popen when ``background``); with ``check`` a non-zero exit fails the test
    and shows the output's tail. ``script``: train.py or a twin (:data:`FAULTY`, which reads ``HT_FAULT*`` from
    ``env``).
    """
    cmd = [sys.executable, script] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", script]
    cmd += FAST + [f"hydra.run.dir={run_dir}", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    if background:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}: {' '.join(cmd)}\n{(proc.stdout + proc.stderr)[-4000:]}")
    return proc


def tb_scalars(run_dir: Path, tag: str = "train/loss") -> dict[int, float]:
    """``{step: value}`` of ``tag`` over every TensorBoard event file of the run (later files win)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.util import tensor_util

    out: dict[int, float] = {}
    for f in sorted((Path(run_dir) / "tensorboard").glob("events.out.tfevents.*"), key=os.path.getmtime):
        for event in EventFileLoader(str(f)).Load():
            for v in event.summary.value:
                if v.tag == tag:
                    out[event.step] = float(tensor_util.make_ndarray(v.tensor)) if v.HasField("tensor") \
                        else v.simple_value
    return out


def load_weights(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


def assert_same_tensors(a: dict, b: dict, what: str) -> None:
    import torch

    assert sorted(a) == sorted(b), f"{what}: keys differ: {sorted(set(a) ^ set(b))[:5]}"
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    assert not bad, f"{what}: {len(bad)} tensors differ, e.g. {bad[:3]}"
