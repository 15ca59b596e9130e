"""Shared fixtures: compose configs like train.py does, run train.py under torchrun, read TensorBoard events."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
# A tiny, fast run: synthetic data, 2 layers, fp32, no progress bar, sample or weights unless a test asks.
FAST = ["+debug=fast", "precision=fp32", "logger.peak_flops=1e11"]


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """One corpus cache for the session (HYDRATRAIN_CACHE), so the stdlib memmap is built once."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def compose(cache_dir, monkeypatch):
    """compose(overrides) -> the DictConfig train.py would get (Hydra global state reset around it)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from hydratrain.config import register_configs
    from hydratrain.dist.run_dir import register_resolvers

    monkeypatch.setenv("HYDRATRAIN_CACHE", str(cache_dir))
    register_configs()
    register_resolvers()

    def _compose(overrides=(), return_hydra_config: bool = False):
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            return hydra_compose("train", overrides=list(overrides), return_hydra_config=return_hydra_config)

    yield _compose
    GlobalHydra.instance().clear()


def run_train(args, run_dir: Path | None, nproc: int = 0, cwd: Path = ROOT, cache: Path | None = None,
              timeout: int = 300, check: bool = True) -> subprocess.CompletedProcess:
    """Run train.py with ``args``: ``nproc`` 0 = plain python, else torchrun --standalone with nproc ranks."""
    cmd = [sys.executable]
    if nproc:
        cmd += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    cmd += [str(ROOT / "train.py"), *args]
    if run_dir is not None:
        cmd.append(f"hydra.run.dir={run_dir}")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    if cache is not None:
        env["HYDRATRAIN_CACHE"] = str(cache)
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n"
                             f"--- stderr\n{proc.stderr[-6000:]}")
    return proc


def read_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} from every TensorBoard event file under ``run_dir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, list[tuple[int, float]]] = {}
    for d in sorted({p.parent for p in Path(run_dir).rglob("events.out.tfevents.*")}):
        acc = EventAccumulator(str(d), size_guidance={"scalars": 0, "tensors": 0})
        acc.Reload()
        for tag in acc.Tags().get("scalars", []):
            out.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    return out
