"""train.py run in this process (``cli``), single-process runs end to end: epochs with gradient accumulation, user
paths against the launch dir, the environment report; and the correctness checks that need no second rank:
divergence caught before the update, skipped non-finite updates, logged scalars that mean what they say, resuming
with new hyper-parameters, a checkpoint of another model size refused in one line, every path key under
hydra.job.chdir. (Multi-rank runs: tests/e2e/.)"""
from __future__ import annotations

import os
import re
import sys

import pytest
import torch

from helpers import ckpt_of, log_of, results, tb_scalars, write_user_inputs


def test_single_process_run_with_epochs_and_grad_accumulation(cli, tmp_path):
    cli(["strategy=single", "trainer.max_steps=null", "trainer.max_epochs=1", "data.synthetic_tokens=20000",
         "trainer.grad_accum_steps=2", "trainer.eval_every_n_steps=0"], tmp_path).ok()
    res = results(tmp_path)
    # 19000 train tokens / 64 = 296 samples -> 74 micro-batches of 4 -> 37 steps of 2
    assert res["steps"] == 37 and res["hparams"]["world_size"] == 1
    assert "process group" not in log_of(tmp_path)
    assert not (tmp_path / "hydratrain.lock").exists()  # released at the end (hydratrain.dist.run_lock)


def test_text_files_relative_paths_resolve_against_the_launch_dir(cli, tmp_path, monkeypatch):
    (tmp_path / "notes").mkdir()
    for i in range(4):
        (tmp_path / "notes" / f"n{i}.txt").write_text(f"note {i}: the quick brown fox jumps over the lazy dog\n" * 60)
    monkeypatch.chdir(tmp_path)
    cli(["strategy=single", "data=text_files", "data.paths=[notes/*.txt]", "data.val_fraction=0.3",
         "trainer.max_steps=3"], tmp_path / "run").ok()
    log0 = log_of(tmp_path / "run")
    assert re.search(r"data=text_files: .* \(train \d files / \d+ tokens, val \d files", log0), log0


def test_running_the_library_module_says_how_to_train(capsys):
    """``python -m hydratrain.run`` (a guess at an entry point) printed nothing and exited 0."""
    import runpy
    import warnings

    with warnings.catch_warnings(), pytest.raises(SystemExit) as err:
        warnings.simplefilter("ignore", RuntimeWarning)  # hydratrain.run is imported already
        runpy.run_module("hydratrain.run", run_name="__main__")
    assert err.value.code == 2 and "train with python train.py [OVERRIDES]" in capsys.readouterr().err


def test_importing_train_py_leaves_sigterm_alone(monkeypatch):
    """train.py's early SIGTERM guard (for the seconds Hydra composes) was installed on import too: a wrapper script
    or notebook that imported train.py, and every child it spawned, ignored SIGTERM for good."""
    import importlib.util
    import signal

    from helpers import TRAIN

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    before = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        spec = importlib.util.spec_from_file_location("train_imported", TRAIN)
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, before)


def test_env_report(capsys, monkeypatch, tmp_path):
    """``python -m hydratrain.env`` prints the report; on a machine without SLURM's commands (a PATH without them)
    it says that slurm needs them."""
    import runpy
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # hydratrain.env may be imported already
        monkeypatch.setattr(sys, "argv", ["hydratrain.env", "bogus"])  # not the report with status 0
        with pytest.raises(SystemExit) as err:
            runpy.run_module("hydratrain.env", run_name="__main__")
        assert err.value.code == 2 and "unrecognized arguments: bogus" in capsys.readouterr().err
        monkeypatch.setattr(sys, "argv", ["hydratrain.env"])
        runpy.run_module("hydratrain.env", run_name="__main__")
    out = capsys.readouterr().out
    assert "torch 2." in out and "cuda available:" in out and "backends: gloo" in out
    assert "strategies: single, ddp, fsdp" in out and "precisions: fp32" in out
    assert "launchers: local, torchrun, slurm (" in out and "sweepers: basic, optuna for" in out
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch, no srun
    from hydratrain.env import report

    line = next(x for x in report() if x.startswith("launchers:"))
    assert "needs SLURM's sbatch and srun, missing here)" in line and "submitit_local (" in line, line


# ------------------------------------------------------------------------------------------ divergence
def test_divergence_stops_before_the_update_and_keeps_the_good_checkpoint(cli, tmp_path):
    """optim.lr=1e30: step 1's update blows the weights up, step 2's gradient norm is not finite. The run stops
    before step 2's optimizer step with exit status 4 naming the step and the last good checkpoint; no checkpoint of
    non-finite weights exists and keep_last evicted nothing good."""
    r = cli(["strategy=single", "optim.lr=1e30", "scheduler=constant", "checkpoint.every_n_steps=1",
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


def test_skip_drops_nonfinite_updates_then_stops_after_too_many(cli, tmp_path):
    r = cli(["strategy=single", "optim.lr=1e30", "scheduler=constant", "trainer.on_nonfinite=skip",
             "trainer.max_consecutive_nonfinite=3", "trainer.eval_every_n_steps=0"], tmp_path)
    assert r.returncode == 4 and "3 steps in a row up to step 4 had non-finite gradients" in r.output, r.output[-2000:]
    assert log_of(tmp_path).count("update skipped on every rank (trainer.on_nonfinite=skip)") == 3
    assert tb_scalars(tmp_path, "train/skipped_steps")[4] == 3


# ------------------------------------------------------------------------------------- what is logged
def test_logged_lr_loss_and_grad_norm_mean_what_the_readme_says(cli, tmp_path):
    """train/lr at step s is the lr step s's update used (warm-up: lr * s / warmup_steps); train/loss is the mean of
    the window's step losses; train/grad_norm is the norm before clipping."""
    common = ["strategy=single", "optim.lr=0.01", "scheduler=constant", "scheduler.warmup_steps=4",
              "trainer.max_steps=6", "trainer.eval_every_n_steps=0", "trainer.grad_clip=1e-6"]
    cli([*common, "trainer.log_every_n_steps=1"], tmp_path / "every").ok()
    cli([*common, "trainer.log_every_n_steps=3"], tmp_path / "three").ok()
    lr = tb_scalars(tmp_path / "every", "train/lr")
    assert [lr[s] for s in range(1, 7)] == pytest.approx([0.0025, 0.005, 0.0075, 0.01, 0.01, 0.01])
    every, three = tb_scalars(tmp_path / "every"), tb_scalars(tmp_path / "three")
    assert sorted(three) == [1, 3, 6]
    assert three[3] == pytest.approx((every[2] + every[3]) / 2, rel=1e-6)  # step 1 was its own window
    assert three[6] == pytest.approx((every[4] + every[5] + every[6]) / 3, rel=1e-6)
    assert min(tb_scalars(tmp_path / "every", "train/grad_norm").values()) > 0.1  # not the clipped 1e-6


def test_warmup_cosine_peaks_at_the_end_of_warmup_and_ends_at_min_lr_on_the_last_step():
    """The update of the last step uses min_lr_ratio exactly (the conf says so), the decay starts right after the
    warm-up's peak, and without warm-up the first step uses the peak."""
    from hydratrain.optim import lr_factor

    used = [lr_factor(s, "warmup_cosine", 4, 10, 0.1) for s in range(10)]  # step s + 1's update uses factor s
    assert used[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0]) and used[-1] == pytest.approx(0.1)
    assert all(a > b for a, b in zip(used[3:], used[4:]))  # strictly decaying after the peak
    no_warmup = [lr_factor(s, "warmup_cosine", 0, 5, 0.1) for s in range(5)]
    assert no_warmup[0] == 1.0 and no_warmup[-1] == pytest.approx(0.1)
    assert lr_factor(0, "warmup_cosine", 0, 1, 0.1) == 1.0  # a one-step run: no division by zero


# ---------------------------------------------------------------------- resuming with new hyper-parameters
def test_resume_with_a_new_lr_trains_with_it_and_records_it(cli, tmp_path):
    common = ["strategy=single", "scheduler=constant", "trainer.log_every_n_steps=1", "trainer.eval_every_n_steps=0"]
    cli([*common, "optim.lr=1e-3", "trainer.max_steps=4", "checkpoint.every_n_steps=4"], tmp_path / "a").ok()
    b = tmp_path / "b"
    cli([*common, "optim.lr=5e-3", "optim.weight_decay=0.05", "trainer.max_steps=6",
         f"checkpoint.resume_from={tmp_path / 'a'}"], b).ok()
    assert tb_scalars(b, "train/lr")[5] == pytest.approx(5e-3)
    assert results(b)["hparams"]["optim.lr"] == 5e-3
    log = log_of(b)
    assert "optim.lr: 0.001 -> 0.005" in log and "optim.weight_decay: 0.1 -> 0.05" in log
    assert "checkpoint.resume_from:" not in log  # where this launch starts from is not a difference of the training
    # auto-resume in the same run dir with yet another lr
    cli([*common, "optim.lr=2e-3", "trainer.max_steps=8", "checkpoint.every_n_steps=2"], tmp_path / "a").ok()
    assert tb_scalars(tmp_path / "a", "train/lr")[5] == pytest.approx(2e-3)
    assert results(tmp_path / "a")["hparams"]["optim.lr"] == 2e-3


def test_a_resume_that_moves_the_lr_says_by_how_much(cli, tmp_path):
    """A finished 10-step warmup_cosine run extended to 20 steps: its lr went from 2e-4 (the floor, step 10) back up
    to 1.1e-3 at step 11 without a word (a public report against another trainer). The resume now says
    so, with both values. A resume whose schedule gives the same lr (constant, a longer run) says nothing."""
    common = ["strategy=single", "optim.lr=2e-3", "trainer.log_every_n_steps=1", "trainer.eval_every_n_steps=0",
              "checkpoint.save_last=true"]
    cli([*common, "scheduler=constant", "trainer.max_steps=4"], tmp_path / "a").ok()
    r = cli([*common, "scheduler=constant", "trainer.max_steps=6"], tmp_path / "a").ok()
    assert "resumed from" in r.output and "the lr of step" not in r.output
    cosine = [*common, "scheduler=warmup_cosine", "scheduler.warmup_steps=2"]
    cli([*cosine, "trainer.max_steps=10"], tmp_path / "b").ok()
    r = cli([*cosine, "trainer.max_steps=20"], tmp_path / "b").ok()
    assert ("resumed at step 10: the lr of step 11 is 1.100e-03 on this launch's schedule (warmup_cosine over 20 "
            "steps, base lr 0.002) and was 2.000e-04 on the saved run's (x5.5)") in r.output, r.output[-3000:]
    lr = tb_scalars(tmp_path / "b", "train/lr")
    assert lr[10] == pytest.approx(2e-4) and lr[11] == pytest.approx(1.1e-3)


@pytest.mark.slow  # a sibling of it runs by default; CI runs this too (default suite near 4 minutes)
def test_an_epoch_limit_holds_across_a_resume_on_another_batch_size(cli, tmp_path):
    """44 training samples, trainer.max_epochs=2: 22 steps at batch 4. Stopped at step 5 (20 samples) and resumed at
    batch 8, the run trains to the end of epoch 2 (8 micro-batches of 8: 3 left in epoch 0, 5 in epoch 1; step 13),
    not to 2 epochs' worth of batch-8 steps counted from scratch (10 steps: 60 samples, 1.4 epochs), and the lr
    schedule ends on its last step."""
    common = ["strategy=single", "data.synthetic_tokens=3000", "trainer.max_epochs=2", "scheduler.warmup_steps=2",
              "trainer.eval_every_n_steps=0", "trainer.log_every_n_steps=1", "checkpoint.every_n_steps=5"]
    cli([*common, "trainer.max_steps=5"], tmp_path).ok()
    r = cli([*common, "trainer.max_steps=null", "data.batch_size=8"], tmp_path).ok()
    assert "13 optimizer steps in all, not the 10 the config alone gives" in r.output, r.output[-2000:]
    assert results(tmp_path)["steps"] == 13
    lr = tb_scalars(tmp_path, "train/lr")
    assert lr[13] == pytest.approx(min(lr.values()))  # min_lr_ratio on the last step of the re-targeted schedule


def test_the_untrained_micro_batches_warning_counts_from_the_resumed_data_position(cli, tmp_path):
    """44 training samples, 2 epochs, trainer.grad_accum_steps=2: at batch 4 (11 micro-batches an epoch) 11 steps
    train everything. Stopped at step 3 (24 samples) and resumed at batch 8: 2 micro-batches are left in epoch 0 and
    5 in epoch 1, 3 steps and 1 micro-batch untrained. The warning was computed before the load, from the fresh
    config's 10 micro-batches (5 steps, nothing left over), so it said nothing."""
    common = ["strategy=single", "data.synthetic_tokens=3000", "trainer.max_epochs=2", "trainer.grad_accum_steps=2",
              "scheduler.warmup_steps=1", "trainer.eval_every_n_steps=0", "checkpoint.every_n_steps=3"]
    r = cli([*common, "trainer.max_steps=3"], tmp_path).ok()
    assert ") untrained:" not in r.output
    r = cli([*common, "trainer.max_steps=null", "data.batch_size=8"], tmp_path).ok()
    assert ("trainer.max_epochs=2 leaves the run's last 1 micro-batch(es) per rank (8 samples each rank) untrained: "
            "the 7 micro-batches per rank left after the resumed step 3 fill 3 optimizer steps of "
            "trainer.grad_accum_steps=2; a grad_accum_steps that divides 7 trains them all") in r.output, \
        r.output[-3000:]
    assert r.output.count(") untrained:") == 1 and results(tmp_path)["steps"] == 6
    # max_steps=5 ends it first: 12 micro-batches of 8 in the 2 epochs' 10, 3 before the resume, 4 after it (1.4
    # epochs); the fraction was counted as if all 5 steps ran at batch 8 from the start (2 epochs)
    r = cli([*common, "trainer.max_steps=5", "data.batch_size=8",
             f"checkpoint.resume_from={ckpt_of(tmp_path, 3)}"], tmp_path / "b").ok()
    assert ("trainer.max_steps=5 ends the run before trainer.max_epochs=2 would (at 6 optimizer steps): it stops after "
            "1.4 epochs") in r.output, r.output[-3000:]


def test_a_step_longer_than_an_epoch_is_warned_about(caplog):
    """``trainer.grad_accum_steps=2**32`` (a typo, or a size meant for tokens) made the first step run for days without
    a word: one step of more micro-batches than an epoch has now says so at start, with the factor and the largest
    accumulation that keeps a step within an epoch. An accumulation that fits says nothing."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from hydratrain.optim import warn_run_length

    batches = SimpleNamespace(batches_per_epoch=11, batch_size=4)
    scheduler = OmegaConf.create({"name": "constant", "warmup_steps": 0})
    for accum, said in ((11, False), (12, True), (2**32, True)):
        trainer = OmegaConf.create({"grad_accum_steps": accum, "max_epochs": None, "max_steps": 10})
        caplog.clear()
        with caplog.at_level("WARNING", logger="hydratrain"):
            warn_run_length(trainer, scheduler, batches, steps=10)
        lines = [r.getMessage() for r in caplog.records if "grad_accum_steps=" in r.getMessage()]
        assert len(lines) == int(said), lines
    assert lines[0] == (
        "trainer.grad_accum_steps=4294967296 makes every optimizer step 4294967296 micro-batches per rank: 3.9e+08 "
        "epochs of the training data (11 micro-batches per rank an epoch at data.batch_size=4); a grad_accum_steps of "
        "at most 11 keeps a step within an epoch")


@pytest.mark.slow  # a sibling of it runs by default; CI runs this too (default suite near 4 minutes)
def test_going_back_to_an_earlier_checkpoint_sets_the_later_ones_aside(cli, tmp_path):
    """Resuming a run dir from its step-2 checkpoint (auto_resume off) while steps 4 and 6 of the abandoned line are
    there: those are moved to checkpoints/superseded-*/, so keep_last keeps this launch's checkpoints (it deleted
    the one just saved, as older than step 6) and a relaunch auto-resumes from this launch's, not the old line's."""
    from hydratrain.checkpoint.manager import list_checkpoints

    common = ["strategy=single", "scheduler=constant", "trainer.eval_every_n_steps=0", "checkpoint.every_n_steps=2"]
    cli([*common, "trainer.max_steps=6", "checkpoint.keep_last=0"], tmp_path).ok()
    r = cli([*common, "trainer.max_steps=5", "checkpoint.keep_last=1", "checkpoint.auto_resume=false",
             f"checkpoint.resume_from={ckpt_of(tmp_path, 2)}"], tmp_path).ok()
    assert "moved to" in r.output and "step_00000004, step_00000006" in r.output, r.output[-2000:]
    assert [s for s, _ in list_checkpoints(tmp_path / "checkpoints")] == [4]  # this launch's, keep_last=1
    aside = list((tmp_path / "checkpoints").glob("superseded-*"))
    assert [s for s, _ in list_checkpoints(aside[0])] == [4, 6]  # the old line's, not deleted


@pytest.mark.slow  # a sibling of it runs by default; CI runs this too (default suite near 4 minutes)
def test_a_resave_killed_between_its_renames_resumes_from_the_old_checkpoint(cli, tmp_path):
    """A re-save of step 4 killed between its two renames leaves step 4 as .tmp-old-step_00000004: the next launch
    puts it back before it chooses where to resume, and resumes there (it used to choose first, start from step 2,
    and set the restored step 4 aside as a later checkpoint)."""
    common = ["strategy=single", "trainer.eval_every_n_steps=0", "checkpoint.every_n_steps=2"]
    cli([*common, "trainer.max_steps=4"], tmp_path).ok()
    saved = ckpt_of(tmp_path, 4)
    os.replace(saved, saved.parent / f".tmp-old-{saved.name}")
    r = cli([*common, "trainer.max_steps=6"], tmp_path).ok()
    assert f"restored {saved}, set aside by a save that did not finish" in r.output
    assert f"resumed from {saved}" in r.output and "superseded" not in r.output, r.output[-3000:]
    assert not list((tmp_path / "checkpoints").glob("superseded-*"))


def test_loading_a_checkpoint_of_another_model_size_is_one_line(cli, tmp_path):
    cli(["strategy=single", "trainer.max_steps=2", "checkpoint.save_last=true"], tmp_path / "a").ok()
    r = cli(["strategy=single", "model.d_model=32", f"checkpoint.resume_from={tmp_path / 'a'}"], tmp_path / "b")
    assert r.returncode == 3
    errors = [x for x in r.output.splitlines() if "checkpoint error" in x]
    assert len(errors) == 1 and "model.d_model: 64 -> 32" in errors[0] and "Traceback" not in r.output


# ------------------------------------------------------------------------------------------- user paths
@pytest.mark.parametrize("chdir", [pytest.param("true", marks=pytest.mark.slow), "false"])
def test_every_path_key_resolves_against_the_launch_dir(cli, tmp_path, monkeypatch, chdir):
    monkeypatch.chdir(tmp_path)  # the launch dir
    write_user_inputs(cli, tmp_path)
    text = ["data=text_files", "data.paths=[notes/*.txt]", "data.val_fraction=0.3", "data.cache_dir=cache"]
    cli(["strategy=single", *text, "model.init_from=w.safetensors", f"hydra.job.chdir={chdir}",
         "trainer.max_steps=2"], tmp_path / "r1").ok()
    assert f"initialised the model from {tmp_path / 'w.safetensors'}" in log_of(tmp_path / "r1")
    assert (tmp_path / "cache").is_dir() and not (tmp_path / "r1" / "cache").exists()
    cli(["strategy=single", "checkpoint.resume_from=src", f"hydra.job.chdir={chdir}", "trainer.max_steps=3"],
        tmp_path / "r2").ok()
    assert f"resumed from {ckpt_of(tmp_path / 'src', 2)}" in log_of(tmp_path / "r2")


def test_a_size_based_wrap_policy_that_wraps_nothing_says_so(cli, tmp_path):
    run = cli(["strategy=fsdp", "wrap_policy=size_based", "wrap_policy.min_num_params=100000000",
               "trainer.max_steps=1", "trainer.eval_every_n_steps=0"], tmp_path / "r").ok()
    assert "fsdp: sharded 1 modules (0 by wrap_policy=size_based + root)" in log_of(tmp_path / "r")
    line = next(ln for ln in run.output.splitlines() if "wraps nothing" in ln)
    assert "wrap_policy.min_num_params=100000000" in line and "the largest submodule holds" in line, line


@pytest.mark.parametrize("logging_options", [["hydra/job_logging=disabled", "hydra/hydra_logging=disabled"],
                                             ["hydra/job_logging=stdout"]])
def test_hydras_other_logging_options_replace_hydratrains(cli, tmp_path, logging_options):
    """hydratrain's handlers are an option of Hydra's logging groups (conf/hydra/), not keys merged onto whichever
    option is chosen, where they made handlers without a class ("Unable to configure handler 'console'")."""
    cli([*logging_options, "strategy=single", "trainer.max_steps=1", "trainer.eval_every_n_steps=0"],
        tmp_path / "r").ok()
    assert results(tmp_path / "r")["steps"] == 1 and not (tmp_path / "r" / "train_rank0.log").exists()


def test_the_sample_shows_control_characters_as_escapes():
    """A byte-level model's sample held NUL, ESC, CR and backspace, written raw to the console and the log, where
    grep then answered 'binary file matches'."""
    from hydratrain.train.outputs import printable

    assert printable("def f():\n\tx\x00\x1b[31m\r\x08é") == "def f():\n\tx\\x00\\x1b[31m\\r\\x08é"
