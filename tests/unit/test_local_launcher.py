"""train.py's command line in this process where no worker process is the point: the default config under the local
launcher, local sweeps and Optuna searches whose failed jobs are reported while the sweep goes on, and launcher errors
found before any worker starts (a port that cannot be had, submitit's GPU/task mismatch, SLURM missing,
stop_on_failure)."""
from __future__ import annotations

import json
import socket

import pytest
from omegaconf import OmegaConf

from helpers import FAULTY, check_optuna_search, report_rows, requires, results, skip_without

# the default config (data=python_stdlib, model=gpt_tiny, strategy=fsdp, precision=auto), only made short
SHORT = ["trainer.max_steps=3", "data.batch_size=2", "data.seq_len=64", "trainer.eval_samples=8",
         "trainer.sample_tokens=0"]


def test_local_launcher_runs_the_default_config(cli, tmp_path):
    """No precision= override: precision=auto is resolved by the rank (never written into the config), so the config
    passes the checks as composed (the torchrun and submitit launchers: tests/e2e/test_launchers.py)."""
    out_dir = tmp_path / "out"
    r = cli(["launcher=local", *SHORT, f"hydra.run.dir={out_dir}"], fast=False)
    assert r.returncode == 0, r.output[-4000:]
    assert [p.parent for p in out_dir.rglob("results.json")] == [out_dir]
    res = results(out_dir)
    assert res["steps"] == 3 and res["hparams"]["world_size"] == 1
    assert res["hparams"]["precision.name"] == "auto" and res["hparams"]["data"] == "python_stdlib"
    saved = OmegaConf.load(out_dir / ".hydra" / "config.yaml")
    assert (saved.precision.name, saved.strategy.name) == ("auto", "fsdp")


def test_failed_jobs_are_reported_and_the_sweep_goes_on_basic_local(cli, tmp_path, monkeypatch):
    """Basic sweeper + local launcher (jobs in-process): a config error fails that job only, a diverged run (the task
    raising) fails its job; the job between them completes and writes its results."""
    monkeypatch.setenv("HT_FAULT_JOBS", "2:raise")
    sweep = tmp_path / "local"
    r = cli(["-m", "strategy=single", "trainer.max_steps=-1,3,4", f"hydra.sweep.dir={sweep}"], script=FAULTY)
    assert r.returncode != 0
    rows = report_rows(sweep)
    assert [r["status"] for r in rows] == ["FAILED", "COMPLETED", "FAILED"], (rows, r.output[-3000:])
    assert rows[0]["error"] == "ConfigError: trainer.max_steps=-1: must be finite and > 0"
    assert rows[2]["error"] == "FloatingPointError: loss diverged (test)"
    assert (sweep / "1" / "results.json").exists() and results(sweep / "1")["steps"] == 3


def test_a_sweep_that_hydras_sweeper_ends_with_a_failure_ends_with_the_report_and_its_line(cli, tmp_path):
    """hydra.sweeper.max_batch_size=1: Hydra's basic sweeper raises the first batch's failure itself and runs no
    later job; the report callback cannot count such a sweep's jobs, so its end comes from the sweeping process's
    exit hook (the cli fixture runs it as the interpreter would), after Hydra's error: the report and the line, once.
    The same end under launchers whose jobs run in other processes: tests/e2e/test_launchers.py."""
    sweep = tmp_path / "batches"
    r = cli(["-m", "strategy=single", "trainer.max_steps=-1,2", "hydra.sweeper.max_batch_size=1",
             f"hydra.sweep.dir={sweep}"])
    assert r.returncode == 1 and not (sweep / "1").exists(), r.output[-3000:]
    (row,) = report_rows(sweep)
    assert r.err.rstrip("\n").splitlines()[-1] == (
        f"hydratrain: 1 of 1 sweep job(s) failed (see {sweep / 'sweep_report.md'}); first: job 0 ({row['overrides']}): "
        "ConfigError: trainer.max_steps=-1: must be finite and > 0"), r.err[-3000:]
    assert r.output.count("sweep report: ") == 1 and r.output.count("sweep job(s) failed") == 1


@requires("optuna")
def test_optuna_search_three_trials_minimises_eval_loss(cli, tmp_path):
    """Kept in the README's sqlite storage (the optuna extra pins SQLAlchemy 1.x: with SQLAlchemy 2, which optuna 2
    cannot use, it was an AssertionError traceback before any trial)."""
    sweep, db = tmp_path / "sweep", tmp_path / "optuna.db"
    r = cli(["+hparams_search=lr_optuna", "hydra.sweeper.n_trials=3", "strategy=single", "trainer.max_steps=3",
             f"hydra.sweep.dir={sweep}", f"hydra.sweeper.storage=sqlite:///{db}", "hydra.sweeper.study_name=lr"])
    assert r.returncode == 0, r.output[-3000:]
    rows = report_rows(sweep)
    assert len(rows) == 3 and all(r["status"] == "COMPLETED" for r in rows)
    best = min(float(r["eval_loss"]) for r in rows)
    assert f"Best value: {best:.4f}"[:16] in r.output
    assert all("optim.lr=" in r["overrides"] for r in rows)
    import optuna

    study = optuna.load_study(study_name="lr", storage=f"sqlite:///{db}")
    assert sorted(t.value for t in study.trials) == pytest.approx(sorted(float(r["eval_loss"]) for r in rows),
                                                                  abs=1e-4)
    # the same command again: Hydra's sweeper would number the new trials from job 0, into the old trials' dirs
    # (the seeded sampler proposed trial 0's values again, which only re-evaluated dir 0 and added a copy to the
    # study); refused before any trial, the study untouched
    again = cli(["+hparams_search=lr_optuna", "hydra.sweeper.n_trials=3", "strategy=single", "trainer.max_steps=3",
                 f"hydra.sweep.dir={sweep}", f"hydra.sweeper.storage=sqlite:///{db}", "hydra.sweeper.study_name=lr"])
    assert again.returncode == 2, again.output[-3000:]
    assert (f"hydratrain: config error: hydra.sweeper.storage='sqlite:///{db}': its study 'lr' already holds 3 "
            f"trial(s) and hydra.sweep.dir={sweep} holds 3 job dir(s): Hydra's Optuna sweeper numbers a relaunch's "
            "trials from job 0 again") in again.err
    assert len(optuna.load_study(study_name="lr", storage=f"sqlite:///{db}").trials) == 3
    # what the line advises adds a trial
    more = cli(["+hparams_search=lr_optuna", "hydra.sweeper.n_trials=1", "strategy=single", "trainer.max_steps=3",
                f"hydra.sweep.dir={tmp_path / 'more'}", f"hydra.sweeper.storage=sqlite:///{db}",
                "hydra.sweeper.study_name=lr", "hydra.sweeper.sampler.seed=7"])
    assert more.returncode == 0, more.output[-3000:]
    assert len(optuna.load_study(study_name="lr", storage=f"sqlite:///{db}").trials) == 4


@pytest.mark.slow  # five in-process trials
@requires("optuna")
def test_optuna_local_search_goes_on_past_failed_trials(cli, tmp_path, monkeypatch):
    """Optuna + local launcher: trials that sample an invalid weight decay fail with a config error (with the
    preset's seed, trial 2 does), trial 3 diverges (raises); the study still runs all 5 trials."""
    monkeypatch.setenv("HT_FAULT_JOBS", "3:raise")
    sweep = tmp_path / "sweep"
    r = cli(["+hparams_search=lr_optuna", "hydra.sweeper.n_trials=5", "strategy=single", "trainer.max_steps=3",
             "optim.weight_decay=interval(-0.2,0.2)", f"hydra.sweep.dir={sweep}"], script=FAULTY)
    check_optuna_search(r.returncode, r.output, sweep, 5, {3: "raise"}, ["ConfigError", "FloatingPointError"])


@pytest.mark.slow  # four in-process trials, two under the torchrun launcher, and Optuna's import: about 25 s
@requires("optuna")
def test_optuna_search_that_cannot_succeed_stops_with_one_line(cli, tmp_path):
    """An error no sampled value causes (a data path that matches no file) would fail every trial alike: the search
    stops after the first. Trials that all fail for their sampled values (every lr diverges) end with one line, not
    Optuna's `ValueError: No trials are completed yet` traceback."""
    sweep = tmp_path / "bad_path"
    r = cli(["+hparams_search=lr_optuna", "hydra.sweeper.n_trials=3", f"data.paths=[{tmp_path}/nope.txt]",
             "data=text_files", f"hydra.sweep.dir={sweep}"])
    assert r.returncode == 1 and [row["status"] for row in report_rows(sweep)] == ["FAILED"], r.output[-3000:]
    assert (f"hydratrain: sweep stopped after job 0: config error: data.paths=['{tmp_path}/nope.txt']: "
            in r.output) and "no sampled value (optim.lr, optim.weight_decay) causes it" in r.output
    sweep = tmp_path / "diverging"
    r = cli(["-m", "+hparams_search=lr_optuna", "hydra.sweeper.n_trials=2", "optim.lr=interval(1e4,1e5)",
             "scheduler=constant", "scheduler.warmup_steps=0", "trainer.max_steps=3", f"hydra.sweep.dir={sweep}"])
    assert r.returncode == 1 and [row["status"] for row in report_rows(sweep)] == ["FAILED", "FAILED"]
    assert "hydratrain: sweep stopped after job 1: all 2 trials failed; the last: diverged: " in r.output
    assert "ValueError: No trials are completed yet" not in r.output, r.output[-3000:]
    # the same under the torchrun launcher, which learns of a failed trial in its own process, not from a worker
    sweep = tmp_path / "diverging_torchrun"
    r = cli(["-m", "+hparams_search=lr_optuna", "hydra.sweeper.n_trials=2", "optim.lr=interval(1e4,1e5)",
             "scheduler=constant", "scheduler.warmup_steps=0", "trainer.max_steps=3", "launcher=torchrun",
             "launcher.nproc_per_node=1", "strategy=ddp", f"hydra.sweep.dir={sweep}"])
    assert r.returncode == 1 and [row["status"] for row in report_rows(sweep)] == ["FAILED", "FAILED"]
    assert "hydratrain: sweep stopped after job 1: all 2 trials failed; the last: LaunchError: job #1: rank 0 " \
           "failed" in r.output, r.output[-3000:]
    assert "ValueError: No trials are completed yet" not in r.output


# ------------------------------------------------------------------ launcher errors before any worker starts
def test_port_that_cannot_be_had_is_a_clear_error_not_a_hang(cli, tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = cli(["launcher=torchrun", "strategy=ddp", f"launcher.rdzv_endpoint=127.0.0.1:{port}",
                 f"hydra.sweep.dir={tmp_path / 's'}"])
    assert r.returncode != 0 and r.seconds < 60
    assert f"hydra.launcher.rdzv_endpoint=127.0.0.1:{port}: node 0 cannot host the rendezvous store" in r.output, \
        r.output[-3000:]
    assert report_rows(tmp_path / "s")[0]["status"] == "FAILED"


@pytest.mark.slow  # a sweep of several jobs
def test_stop_on_failure_ends_the_sweep(cli, tmp_path):
    sweep = tmp_path / "stops"
    r = cli(["-m", "launcher=torchrun", "launcher.nproc_per_node=1", "strategy=ddp",
             "hydra.launcher.stop_on_failure=true", "trainer.max_steps=-1,3", f"hydra.sweep.dir={sweep}"])
    assert r.returncode != 0 and [row["status"] for row in report_rows(sweep)] == ["FAILED"]
    assert not (sweep / "1").exists()
    # Hydra's sweeper raised the failure before the last job's end: the report and the line at the process's exit
    assert r.output.rstrip("\n").splitlines()[-1].startswith(f"hydratrain: 1 of 1 sweep job(s) failed (see {sweep}"), \
        r.output[-3000:]


@requires("slurm")
def test_submitit_gpu_task_mismatch_fails_before_submitting(cli, tmp_path):
    r = cli(["launcher=submitit_local", "launcher.gpus_per_node=2", "launcher.tasks_per_node=1",
             f"hydra.sweep.dir={tmp_path / 's'}"])
    assert r.returncode != 0
    assert "config error: launcher.tasks_per_node=1: must equal launcher.gpus_per_node=2" in r.output
    assert not (tmp_path / "s" / ".submitit").exists()


@requires("slurm")
def test_slurm_without_sbatch_fails_before_submitting(cli, tmp_path, monkeypatch):
    """launcher=slurm on a machine without SLURM: one line naming the key and what to use instead, not submitit's
    traceback ('Could not detect "srun"')."""
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch, no srun
    r = cli(["launcher=slurm", "strategy=ddp", "launcher.gpus_per_node=2", f"hydra.sweep.dir={tmp_path / 's'}"])
    assert r.returncode != 0 and "Traceback" not in r.output, r.output[-3000:]
    assert "hydratrain: config error: launcher='slurm': needs SLURM, but sbatch and srun are not on PATH here; " \
           "allowed here: local, torchrun, submitit_local" in r.output, r.output[-3000:]
    assert not (tmp_path / "s").exists()


@requires("slurm")
def test_submitit_bad_fixed_value_fails_before_submitting(cli, tmp_path):
    """A job's config checks run on the sweep's config before submitit queues anything: a typo no longer waits in
    the SLURM queue to fail when the job starts."""
    r = cli(["-m", "launcher=submitit_local", "optim.lr=-1", "trainer.max_steps=1,2",
             f"hydra.sweep.dir={tmp_path / 's'}"])
    assert r.returncode != 0 and "hydratrain: config error: optim.lr=-1.0: must be finite and > 0" in r.output, \
        r.output[-3000:]
    assert not (tmp_path / "s" / ".submitit").exists()


@pytest.mark.parametrize("swept", ["launcher.tasks_per_node=1,2", "launcher.timeout_min=range(5,7)"])
@requires("slurm")
def test_submitit_refuses_a_swept_executor_key_before_submitting(cli, tmp_path, swept):
    """hydra-submitit-launcher makes one executor per sweep: -m launcher.tasks_per_node=1,2 ran both jobs on 2
    ranks while job 0's report row said 1."""
    r = cli(["-m", "launcher=submitit_local", swept, f"hydra.sweep.dir={tmp_path / 's'}"])
    key, values = swept.split("=")
    assert r.returncode == 2 and (f"hydratrain: config error: {key}='{values}': cannot be swept under "
                                  "launcher=submitit_local") in r.output, r.output[-3000:]
    assert not (tmp_path / "s" / ".submitit").exists()


@pytest.mark.slow  # several in-process runs; keeps the default suite near 4 minutes
def test_a_sweep_run_again_into_its_sweep_dir_resumes_its_trials_and_refuses_other_ones(cli, tmp_path):
    """Job N of a sweep auto-resumes from its run dir (a preempted sweep, relaunched; here with a longer run). A
    sweep with other values in the same hydra.sweep.dir used to resume job N of the old sweep, find nothing to train
    and report the old figures under the new values (2 of 2 jobs); now each such job fails with one line."""
    sweep = tmp_path / "sweep"
    common = ["-m", "strategy=single", "checkpoint.save_last=true", "trainer.eval_every_n_steps=0",
              f"hydra.sweep.dir={sweep}"]
    assert cli([*common, "trainer.max_steps=3", "optim.lr=1e-3,3e-3"]).returncode == 0
    longer = cli([*common, "trainer.max_steps=5", "optim.lr=1e-3,3e-3"])
    assert longer.returncode == 0 and [results(sweep / j)["steps"] for j in "01"] == [5, 5], longer.output[-3000:]
    assert longer.output.count("resumed from") == 2
    other = cli([*common, "trainer.max_steps=5", "optim.lr=2e-2,5e-2"])
    rows = report_rows(sweep)
    assert [r["status"] for r in rows] == ["FAILED", "FAILED"], (rows, other.output[-3000:])
    assert rows[0]["error"].startswith(f"ConfigError: hydra.sweep.dir='{sweep}': job 0's run dir {sweep}/0 holds "
                                       "a checkpoint of another trial (step_00000005; optim.lr: 0.001 -> 0.02)")
    assert "checkpoint.auto_resume=false" in rows[1]["error"]
    assert [r["train_loss"] for r in rows] == ["", ""]  # not the old trial's figures under the new values
    # ... and their status (the refusal has a status file of its own, status.job<N>.json)
    assert [json.loads((sweep / j / "status.json").read_text())["status"] for j in "01"] == ["COMPLETED"] * 2
    # the refused jobs leave the old trials' record of their config alone (Hydra writes .hydra/ before the task runs)
    assert [(sweep / j / ".hydra" / "overrides.yaml").read_text().count(lr) for j, lr in
            (("0", "optim.lr=0.001"), ("1", "optim.lr=0.003"))] == [1, 1]
    dropped = cli([*common[:-1], f"hydra.sweep.dir={tmp_path / 'n1'}", "trainer.max_steps=3", "model.n_layer=1"])
    assert dropped.returncode == 0, dropped.output[-3000:]
    again = cli([*common[:-1], f"hydra.sweep.dir={tmp_path / 'n1'}", "trainer.max_steps=3"])  # override dropped
    assert "another trial (step_00000003; model.n_layer: 1 -> 2)" in report_rows(tmp_path / "n1")[0]["error"], \
        again.output[-3000:]


def test_a_sweep_run_again_with_other_values_keeps_a_trial_that_finished_without_a_checkpoint(cli, tmp_path):
    """The refusal of another trial's dir needed a checkpoint there: a short trial (no save_last, fewer steps than
    checkpoint.every_n_steps) had its results.json, .hydra/ and curves replaced by a re-run with other values, with
    only a TensorBoard warning. Its .hydra/config.yaml now tells the trial; the same trial runs again."""
    sweep = tmp_path / "sweep"
    common = ["-m", "strategy=single", "trainer.max_steps=2", "trainer.eval_every_n_steps=0",
              f"hydra.sweep.dir={sweep}"]
    assert cli([*common, "optim.lr=1e-3"]).returncode == 0 and not (sweep / "0" / "checkpoints").exists()
    other = cli([*common, "optim.lr=2e-2"])
    assert other.returncode == 1, other.output[-3000:]
    assert report_rows(sweep)[0]["error"].startswith(
        f"ConfigError: hydra.sweep.dir='{sweep}': job 0's run dir {sweep}/0 holds the results of another trial, "
        "finished without a checkpoint (its .hydra/config.yaml; optim.lr: 0.001 -> 0.02): sweep into a new "
        "hydra.sweep.dir"), other.output[-3000:]
    assert results(sweep / "0")["hparams"]["optim.lr"] == 1e-3
    assert "optim.lr=0.001" in (sweep / "0" / ".hydra" / "overrides.yaml").read_text()
    assert cli([*common, "optim.lr=1e-3"]).returncode == 0  # the same trial: trained again


@pytest.mark.parametrize("launcher", [pytest.param("local", marks=pytest.mark.slow),
                                      pytest.param("torchrun", marks=pytest.mark.slow)])
def test_two_jobs_whose_subdir_is_one_dir_keep_the_first_jobs_results(cli, tmp_path, launcher):
    """hydra.sweep.subdir that resolves alike for two jobs (a constant, an override_dirname without the swept key):
    the second job used to overwrite the first's results, log and curves, and the sweep report had one row. Under
    the torchrun launcher its process, which sees the refused job as a failed worker, left the first job's status
    alone too."""
    sweep = tmp_path / "sweep"
    extra = ["launcher=torchrun", "launcher.nproc_per_node=1"] if launcher == "torchrun" else []
    run = cli(["-m", *extra, "strategy=single", "trainer.max_steps=2", "trainer.eval_every_n_steps=0",
               "optim.lr=1e-3,5e-3", f"hydra.sweep.dir={sweep}", "hydra.sweep.subdir=same"])
    assert run.returncode == 1, run.output[-3000:]
    rows = report_rows(sweep)
    assert [(r["job"], r["status"], r["overrides"].split()[-1]) for r in rows] == [
        ("same", "COMPLETED", "optim.lr=0.001"), ("same (job 1)", "FAILED", "optim.lr=0.005")], rows
    assert rows[1]["error"] == (f"ConfigError: hydra.sweep.subdir='same': job 1's run dir {sweep / 'same'} is job "
                                "0's of this sweep: give every job a dir of its own (the default ${hydra.job.num}; "
                                "an override_dirname must keep every swept key)")
    assert results(sweep / "same")["hparams"]["optim.lr"] == 1e-3
    assert "optim.lr=0.001" in (sweep / "same" / ".hydra" / "overrides.yaml").read_text()


@pytest.mark.parametrize("sweeper", ["basic", pytest.param("optuna", marks=pytest.mark.slow),
                                     pytest.param("torchrun", marks=pytest.mark.slow)])
def test_a_relative_sweep_dir_under_job_chdir_is_reported_from_the_launch_dir(cli, tmp_path, monkeypatch, sweeper):
    """With hydra.job.chdir=true a job runs in its own dir: a relative hydra.sweep.dir (given, or built from a
    relative paths.output_dir as by default) still means the one below the launch dir. The report used to be looked
    for below the job dir: no report, every status.json outside the multirun, and an Optuna search with a failed
    trial exiting 0."""
    if sweeper == "optuna":
        skip_without("optuna")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HT_FAULT_JOBS", "1:raise")
    args = {"basic": ["-m", "trainer.max_steps=2,2", "hydra.sweep.dir=rel/sw", "strategy=single"],
            "optuna": ["+hparams_search=lr_optuna", "hydra.sweeper.n_trials=2", "trainer.max_steps=2",
                       "paths.output_dir=rel", "strategy=single"],
            "torchrun": ["-m", "trainer.max_steps=2,2", "hydra.sweep.dir=rel/sw", "launcher=torchrun",
                         "launcher.nproc_per_node=1", "strategy=ddp"]}[sweeper]
    r = cli([*args, "hydra.job.chdir=true"], script=FAULTY)
    assert r.returncode == 1, r.output[-3000:]
    (sweep,) = {p.parent for p in (tmp_path / "rel").rglob("sweep_report.csv")}
    assert sweep.relative_to(tmp_path).parts[:2] == (("rel", "multirun") if sweeper == "optuna" else ("rel", "sw"))
    rows = report_rows(sweep)
    assert [(row["job"], row["status"], row["steps"]) for row in rows] == [("0", "COMPLETED", "2"), ("1", "FAILED", "")]
    assert rows[1]["error"].endswith("FloatingPointError: loss diverged (test)")  # torchrun: in a LaunchError
    # the basic sweeper raises the failed job's error after the last job, so its report and line come with that job
    # (not Hydra's HYDRA_FULL_ERROR hint last)
    assert "hydratrain: 1 of 2 sweep job(s) failed" in r.output and "sweep report: " in r.output, r.output[-3000:]
    assert "HYDRA_FULL_ERROR" not in r.output, r.output[-3000:]
