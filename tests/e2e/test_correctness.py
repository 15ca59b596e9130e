"""Correctness under real use, end to end: the same model whatever the build and world size, the same eval set at
any world size and batch size, divergence caught, logged scalars that mean what they say, resuming with new
hyper-parameters, one console, options that take effect, one-line checkpoint errors, and user paths that mean the
same file under every Hydra setting."""
from __future__ import annotations

import json

import pytest
import torch

from helpers import ROOT, ckpt_of, log_of, results, run, tb_scalars

PROBE = str(ROOT / "tests" / "scripts" / "probe_model.py")


def _probe(nproc: int, *overrides: str) -> dict:
    r = run(list(overrides), nproc=nproc, script=PROBE, fast=False, timeout=240).ok()
    return json.loads(r.output.strip().splitlines()[-1])


# ------------------------------------------------------------------- the model and the eval set, any layout
@pytest.mark.parametrize("nproc,strategy,init_device,batch", [(2, "fsdp", "meta", 3), (3, "ddp", "meta", 2),
                                                               pytest.param(4, "fsdp", "cpu", 5, marks=pytest.mark.slow)])
def test_same_weights_and_eval_loss_whatever_the_build_and_layout(nproc, strategy, init_device, batch):
    """Every parameter comes from its own seeded generator: a meta-device build sharded over N ranks holds exactly
    the weights of an eager single-process build (no shard a copy of another, ties kept), and the fixed eval set
    gives the same eval loss at (W=1, B=8) and (W=N, B=batch)."""
    common = ["trainer.eval_samples=24", "model.tie_embeddings=true"]
    ref = _probe(1, "strategy=single", "model.init_device=cpu", "data.batch_size=8", *common)
    got = _probe(nproc, f"strategy={strategy}", f"model.init_device={init_device}", f"data.batch_size={batch}",
                 *common)
    assert got["world_size"] == nproc and got["tied"] and got["n_params"] == ref["n_params"]
    assert got["repeated_blocks"] == [] and ref["repeated_blocks"] == []
    assert got["sha"] == ref["sha"]
    assert got["eval_loss"] == pytest.approx(ref["eval_loss"], abs=1e-5)


# ------------------------------------------------------------------------------------------ divergence
def test_divergence_stops_before_the_update_and_keeps_the_good_checkpoint(tmp_path):
    """optim.lr=1e30: step 1's update blows the weights up, step 2's gradient norm is not finite. The run stops
    before step 2's optimizer step with exit status 4 naming the step and the last good checkpoint; no checkpoint of
    non-finite weights exists and keep_last evicted nothing good."""
    r = run(["strategy=single", "optim.lr=1e30", "scheduler=constant", "checkpoint.every_n_steps=1",
             "checkpoint.keep_last=1", "trainer.eval_every_n_steps=0"], tmp_path)
    assert r.returncode == 4, r.output[-3000:]
    line = [x for x in r.output.splitlines() if x.startswith("hydratrain: diverged:")]
    assert len(line) == 1 and "at step 2" in line[0] and str(ckpt_of(tmp_path, 1)) in line[0], r.output[-2000:]
    from hydratrain.checkpoint.io import read_all
    from hydratrain.checkpoint.manager import list_checkpoints

    assert [s for s, _ in list_checkpoints(tmp_path / "checkpoints")] == [1]
    saved = read_all(ckpt_of(tmp_path, 1))
    assert all(torch.isfinite(v).all() for v in saved.values() if isinstance(v, torch.Tensor) and v.is_floating_point())
    assert not (tmp_path / "results.json").exists()


def test_skip_drops_nonfinite_updates_then_stops_after_too_many(tmp_path):
    r = run(["strategy=single", "optim.lr=1e30", "scheduler=constant", "trainer.on_nonfinite=skip",
             "trainer.max_consecutive_nonfinite=3", "trainer.eval_every_n_steps=0"], tmp_path)
    assert r.returncode == 4 and "3 steps in a row up to step 4 had non-finite gradients" in r.output, r.output[-2000:]
    assert log_of(tmp_path).count("update skipped on every rank (trainer.on_nonfinite=skip)") == 3
    assert tb_scalars(tmp_path, "train/skipped_steps")[4] == 3


# ------------------------------------------------------------------------------------- what is logged
def test_logged_lr_loss_and_grad_norm_mean_what_the_readme_says(tmp_path):
    """train/lr at step s is the lr step s's update used (warm-up: lr * s / warmup_steps); train/loss is the mean of
    the window's step losses; train/grad_norm is the norm before clipping."""
    common = ["strategy=single", "optim.lr=0.01", "scheduler=constant", "scheduler.warmup_steps=4",
              "trainer.max_steps=6", "trainer.eval_every_n_steps=0", "trainer.grad_clip=1e-6"]
    run([*common, "trainer.log_every_n_steps=1"], tmp_path / "every").ok()
    run([*common, "trainer.log_every_n_steps=3"], tmp_path / "three").ok()
    lr = tb_scalars(tmp_path / "every", "train/lr")
    assert [lr[s] for s in range(1, 7)] == pytest.approx([0.0025, 0.005, 0.0075, 0.01, 0.01, 0.01])
    every, three = tb_scalars(tmp_path / "every"), tb_scalars(tmp_path / "three")
    assert sorted(three) == [1, 3, 6]
    assert three[3] == pytest.approx((every[2] + every[3]) / 2, rel=1e-6)  # step 1 was its own window
    assert three[6] == pytest.approx((every[4] + every[5] + every[6]) / 3, rel=1e-6)
    assert min(tb_scalars(tmp_path / "every", "train/grad_norm").values()) > 0.1  # not the clipped 1e-6


# ---------------------------------------------------------------------- resuming with new hyper-parameters
def test_resume_with_a_new_lr_trains_with_it_and_records_it(tmp_path):
    common = ["strategy=single", "scheduler=constant", "trainer.log_every_n_steps=1", "trainer.eval_every_n_steps=0"]
    run([*common, "optim.lr=1e-3", "trainer.max_steps=4", "checkpoint.every_n_steps=4"], tmp_path / "a").ok()
    b = tmp_path / "b"
    run([*common, "optim.lr=5e-3", "optim.weight_decay=0.05", "trainer.max_steps=6",
         f"checkpoint.resume_from={tmp_path / 'a'}"], b).ok()
    assert tb_scalars(b, "train/lr")[5] == pytest.approx(5e-3)
    assert results(b)["hparams"]["optim.lr"] == 5e-3
    log = log_of(b)
    assert "optim.lr: 0.001 -> 0.005" in log and "optim.weight_decay: 0.1 -> 0.05" in log
    # auto-resume in the same run dir with yet another lr
    run([*common, "optim.lr=2e-3", "trainer.max_steps=8", "checkpoint.every_n_steps=2"], tmp_path / "a").ok()
    assert tb_scalars(tmp_path / "a", "train/lr")[5] == pytest.approx(2e-3)
    assert results(tmp_path / "a")["hparams"]["optim.lr"] == 2e-3


# -------------------------------------------------------------------------------- console, option effects
def test_only_rank_0_prints_and_ddp_reduces_in_the_configured_dtype(tmp_path):
    common = ["strategy=ddp", "trainer.max_steps=4", "trainer.log_every_n_steps=1", "trainer.eval_every_n_steps=0"]
    r = run([*common, "precision.reduce_dtype=bfloat16"], tmp_path / "bf16", nproc=2).ok()
    assert r.output.count("process group: backend=gloo") == 1 and r.output.count("precision=fp32") == 1
    assert "world_size=2 rank=1" in log_of(tmp_path / "bf16", 1)  # each rank's log file keeps its lines
    assert "gradients all-reduced in bfloat16" in log_of(tmp_path / "bf16")
    run(common, tmp_path / "fp32", nproc=2).ok()
    bf16, fp32 = tb_scalars(tmp_path / "bf16", "train/grad_norm"), tb_scalars(tmp_path / "fp32", "train/grad_norm")
    assert bf16[1] != fp32[1] and bf16[1] == pytest.approx(fp32[1], rel=1e-2)  # it took effect, and it is bf16


def test_loading_a_checkpoint_of_another_model_size_is_one_line(tmp_path):
    run(["strategy=single", "trainer.max_steps=2", "checkpoint.save_last=true"], tmp_path / "a").ok()
    r = run(["strategy=single", "model.d_model=32", f"checkpoint.resume_from={tmp_path / 'a'}"], tmp_path / "b")
    assert r.returncode == 3
    errors = [x for x in r.output.splitlines() if "checkpoint error" in x]
    assert len(errors) == 1 and "model.d_model: 64 -> 32" in errors[0] and "Traceback" not in r.output


# ------------------------------------------------------------------------------------------- user paths
def _inputs(tmp_path):
    """notes/*.txt, a weights file and a run with a checkpoint, all under tmp_path, referred to relatively."""
    (tmp_path / "notes").mkdir()
    for i in range(4):
        (tmp_path / "notes" / f"n{i}.txt").write_text(f"note {i}: the quick brown fox jumps over the lazy dog\n" * 80)
    run(["strategy=single", "trainer.max_steps=2", "checkpoint.save_last=true"], tmp_path / "src", cwd=tmp_path).ok()
    from hydratrain.checkpoint.export import export

    export(tmp_path / "src", tmp_path / "w.safetensors")


@pytest.mark.parametrize("chdir", ["true", "false"])
def test_every_path_key_resolves_against_the_launch_dir(tmp_path, chdir):
    _inputs(tmp_path)
    text = ["data=text_files", "data.paths=[notes/*.txt]", "data.val_fraction=0.3", "data.cache_dir=cache"]
    run(["strategy=single", *text, "model.init_from=w.safetensors", f"hydra.job.chdir={chdir}",
         "trainer.max_steps=2"], tmp_path / "r1", cwd=tmp_path).ok()
    assert f"initialised the model from {tmp_path / 'w.safetensors'}" in log_of(tmp_path / "r1")
    assert (tmp_path / "cache").is_dir() and not (tmp_path / "r1" / "cache").exists()
    run(["strategy=single", "checkpoint.resume_from=src", f"hydra.job.chdir={chdir}", "trainer.max_steps=3"],
        tmp_path / "r2", cwd=tmp_path).ok()
    assert f"resumed from {ckpt_of(tmp_path / 'src', 2)}" in log_of(tmp_path / "r2")


def test_paths_resolve_against_the_launch_dir_under_the_torchrun_launcher(tmp_path):
    _inputs(tmp_path)
    sweep = tmp_path / "sweep"
    run(["launcher=torchrun", "strategy=ddp", "data=text_files", "data.paths=[notes/*.txt]",
         "data.val_fraction=0.3", "model.init_from=w.safetensors", "hydra.job.chdir=true", "trainer.max_steps=2",
         f"hydra.sweep.dir={sweep}"], cwd=tmp_path).ok()
    assert "initialised the model from" in log_of(sweep / "0") and results(sweep / "0")["steps"] == 2
