"""Correctness under real use on several ranks, end to end: the same model whatever the build and world size, the
same eval set at any world size and batch size, one console and options that take effect under DDP, user paths that
mean the same file under the torchrun launcher. (The checks that need one process only run in this process:
tests/unit/test_single_process.py.)"""
from __future__ import annotations

import json
import re

import pytest

from helpers import ROOT, SHARED_RUNS, log_of, results, run, tb_scalars, write_user_inputs

PROBE = str(ROOT / "tests" / "scripts" / "probe_model.py")


def _probe(nproc: int, *overrides: str) -> dict:
    r = run(list(overrides), nproc=nproc, script=PROBE, fast=False, timeout=240).ok()
    return json.loads(r.output.strip().splitlines()[-1])


# ------------------------------------------------------------------- the model and the eval set, any layout
COMMON = ["trainer.eval_samples=24", "model.tie_embeddings=true"]


@pytest.fixture(scope="module")
def reference_probe() -> dict:
    """The eager single-process build (W=1, B=8) every layout is compared with: probed once, in this process (one
    process, no process group)."""
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("probe_model", PROBE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    threads = torch.get_num_threads()
    try:
        return module.probe(["strategy=single", "model.init_device=cpu", "data.batch_size=8", *COMMON])
    finally:
        torch.set_num_threads(threads)  # the process group sets them per rank


@pytest.mark.parametrize("nproc,strategy,init_device,batch", [
    (2, "fsdp", "meta", 3), pytest.param(3, "ddp", "meta", 2, marks=pytest.mark.slow),
    pytest.param(4, "fsdp", "cpu", 5, marks=pytest.mark.slow)])
def test_same_weights_and_eval_loss_whatever_the_build_and_layout(reference_probe, nproc, strategy, init_device,
                                                                   batch):
    """Every parameter comes from its own seeded generator: a meta-device build sharded over N ranks holds exactly
    the weights of an eager single-process build (no shard a copy of another, ties kept), and the fixed eval set
    gives the same eval loss at (W=1, B=8) and (W=N, B=batch)."""
    ref = reference_probe
    got = _probe(nproc, f"strategy={strategy}", f"model.init_device={init_device}", f"data.batch_size={batch}",
                 *COMMON)
    assert got["world_size"] == nproc and got["tied"] and got["n_params"] == ref["n_params"]
    assert got["repeated_blocks"] == [] and ref["repeated_blocks"] == []
    assert got["sha"] == ref["sha"]
    assert got["eval_loss"] == pytest.approx(ref["eval_loss"], abs=1e-5)


# -------------------------------------------------------------------------------- console, option effects
def test_only_rank_0_prints_and_ddp_reduces_in_the_configured_dtype(shared_sweep):
    """Read from the session's shared 2-rank sweep: its console has each job's lines once (rank 0's), Hydra's own
    lines too ("Launching N jobs locally", "#N : ..."), each rank's log file keeps its own; the job that all-reduces
    DDP gradients in bfloat16 differs from the fp32 one (step 1's gradient norm is taken before any update: same
    model, seed and first batch) by bf16 rounding only."""
    out, jobs = shared_sweep.result.output, len(SHARED_RUNS)
    assert out.count("process group: backend=gloo") == jobs, out[-3000:]
    assert out.count("[HYDRA] Launching") == 1 and len(re.findall(r"\[HYDRA\]\s+#\d+ : ", out)) == jobs, out[:3000]
    assert len(re.findall(r"precision=\w+ \(compute \w+, reduce \w+", out)) == jobs, out[-3000:]
    run_dir = shared_sweep.job("ddp_fp32_reduce_bf16")
    assert "world_size=2 rank=1" in log_of(run_dir, 1)  # each rank's log file keeps its lines
    assert "gradients all-reduced in bfloat16" in log_of(run_dir)
    bf16 = tb_scalars(run_dir, "train/grad_norm")
    fp32 = tb_scalars(shared_sweep.job("ddp_fp32"), "train/grad_norm")
    assert bf16[1] != fp32[1] and bf16[1] == pytest.approx(fp32[1], rel=1e-2)  # it took effect, and it is bf16


# ------------------------------------------------------------------------------------------- user paths
@pytest.mark.slow  # a sibling of it runs by default; CI runs this too (default suite near 4 minutes)
def test_paths_resolve_against_the_launch_dir_under_the_torchrun_launcher(cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the inputs are made in this process, relative to the launch dir
    write_user_inputs(cli, tmp_path)
    sweep = tmp_path / "sweep"
    run(["launcher=torchrun", "strategy=ddp", "data=text_files", "data.paths=[notes/*.txt]",
         "data.val_fraction=0.3", "model.init_from=w.safetensors", "hydra.job.chdir=true", "trainer.max_steps=2",
         f"hydra.sweep.dir={sweep}"], cwd=tmp_path).ok()
    assert "initialised the model from" in log_of(sweep / "0") and results(sweep / "0")["steps"] == 2
