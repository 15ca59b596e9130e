"""The sweep report (hydratrain.sweep_report) lists the jobs of the multirun that wrote it last, not those an earlier
multirun left in the same sweep dir, and never shows a results.json that the job did not write."""
from __future__ import annotations

import json
import os
import shutil
import time

from helpers import requires
from hydratrain.sweep_report import mark_multirun, sweep_rows, write_job_status


def _job(sweep, num, lr, results=None, status=True, multirun=None, results_current=True, age_s=0.0):
    job = sweep / str(num)
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text(f"- optim.lr={lr}\n")
    if results is not None:
        (job / "results.json").write_text(json.dumps({"steps": 2, "train_loss": results, "seconds": 1.0}))
    if status:
        write_job_status(job, num, [f"optim.lr={lr}"], "COMPLETED" if results_current else "FAILED",
                         multirun=multirun, results_current=results_current)
    for path in job.rglob("*"):
        os.utime(path, (time.time() - age_s, time.time() - age_s))
    return job


def test_a_sweep_run_again_into_its_dir_reports_its_own_jobs_only(tmp_path):
    for num, lr in enumerate((1e-3, 2e-3, 3e-3)):  # an earlier multirun of 3 jobs (written before marks existed)
        _job(tmp_path, num, lr, results=5.0 + num, age_s=60)
    assert [r["job"] for r in sweep_rows(tmp_path)] == ["0", "1", "2"]  # no mark: every job dir
    run_id = mark_multirun(tmp_path)
    for num in (0, 1):  # this multirun's 2 jobs rewrite dirs 0 and 1
        shutil.rmtree(tmp_path / str(num))
    _job(tmp_path, 0, 5e-3, results=4.0, multirun=run_id)
    _job(tmp_path, 1, 6e-3, status=False)  # still running: Hydra wrote its overrides, no status yet
    rows = sweep_rows(tmp_path)
    assert [(r["job"], r["status"], r["train_loss"]) for r in rows] == [("0", "COMPLETED", 4.0), ("1", "RUNNING", "")]


def test_a_failed_job_does_not_show_the_figures_an_earlier_job_left_in_its_dir(tmp_path):
    run_id = mark_multirun(tmp_path)
    _job(tmp_path, 0, 5e-3, results=4.0, multirun=run_id, results_current=False)
    (row,) = sweep_rows(tmp_path)
    assert (row["status"], row["steps"], row["train_loss"], row["seconds"]) == ("FAILED", "", "", "")


def test_the_basic_sweepers_job_count_follows_its_own_expansion():
    """After the last job of a basic sweep with a failure, the report callback ends the sweep: the count
    must be the sweeper's, or a sweep would end early."""
    from omegaconf import OmegaConf

    from hydratrain.sweep.callback import basic_sweep_jobs

    def hydra(task, **sweeper):
        return OmegaConf.create({"sweeper": {"_target_": "hydra._internal.core_plugins.basic_sweeper.BasicSweeper",
                                             "max_batch_size": None, "params": None, **sweeper},
                                 "overrides": {"task": task}})

    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    def hydras(args):  # what the sweeper itself runs
        return sum(len(b) for b in BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(args), None))

    for task in (["optim.lr=1e-3,1e-2", "a=range(3)", "b=5"], ["+a=1", "a=1,2"], ["a=choice(1,2)", "c=x,y,z"]):
        assert basic_sweep_jobs(hydra(task)) == hydras(task), task
    assert basic_sweep_jobs(hydra(["a=1,2,3"], params={"a": "1,2", "c": "x,y"})) == 6  # the command line wins
    assert basic_sweep_jobs(hydra(["a=1,2"], max_batch_size=1)) is None
    assert basic_sweep_jobs(hydra(["a=1,2"], _target_="hydra_plugins.hydra_optuna_sweeper.OptunaSweeper")) is None


def test_a_search_goes_on_after_a_trial_whose_sampled_value_a_check_refused(tmp_path):
    """``-m +hparams_search=lr_optuna 'model.d_model=choice(64,66)'``: trial 0 sampled d_model=66, the check refused it
    as ``model.n_head=4: must divide model.d_model=66``, and the search stopped as hopeless ("no sampled value
    (optim.lr, ...) causes it"): keys swept on the command line were not counted as sampled, and the error's key is
    the other one of the check. Either alone now counts; an error naming no sampled key still stops."""
    from omegaconf import OmegaConf

    from hydratrain.errors import ConfigError
    from hydratrain.sweep.checks import _hopeless

    OmegaConf.save({"hydra": {"overrides": {"task": ["+hparams_search=lr_optuna", "model.d_model=choice(64,66)"]}}},
                   tmp_path / "multirun.yaml")
    hc = OmegaConf.create({"sweeper": {"max_failure_rate": 1.0, "n_trials": 4, "params": {"optim.lr": "x"}},
                           "launcher": {"_target_": "hydra._internal.core_plugins.basic_launcher.BasicLauncher"},
                           "job": {"num": 0}, "sweep": {"dir": str(tmp_path)}, "runtime": {"cwd": str(tmp_path)}})
    sampled_cross_key = ConfigError("model.n_head", 4, "must divide model.d_model=66")
    assert _hopeless(hc, sampled_cross_key, [], launching=True) == ""
    fixed = ConfigError("data.paths", "nope", "matches no file")
    assert _hopeless(hc, fixed, [], launching=True).endswith(
        "no sampled value (optim.lr, model.d_model) causes it, so every trial would fail alike")
    (tmp_path / "multirun.yaml").unlink()  # the command line's keys unknown: in doubt, the search goes on
    assert _hopeless(hc, ConfigError("model.n_head", 4, "must divide model.d_model=66"), [], launching=True) == ""
    assert _hopeless(hc, fixed, [], launching=True) == ""


def _optuna_hc(tmp_path, task, params=None, choices=None, num=0):
    """A job's Hydra config under the Optuna preset (no multirun.yaml: Optuna's sweeper writes none), with the
    mark the sweep wrote at its start from its command line ``task``."""
    from omegaconf import OmegaConf

    from hydratrain.sweep.checks import sampled_keys

    params = {"optim.lr": "tag(log, interval(1e-4, 1e-2))", "optim.weight_decay": "interval(0.0, 0.2)"} \
        if params is None else params
    sweep = {"sweeper": {"max_failure_rate": 1.0, "n_trials": 4, "params": params}, "overrides": {"task": task}}
    mark_multirun(tmp_path, sampled_keys(OmegaConf.create(sweep)))
    return OmegaConf.create({**sweep, "overrides": {"task": []},
                             "launcher": {"_target_": "hydra._internal.core_plugins.basic_launcher.BasicLauncher"},
                             "job": {"num": num}, "sweep": {"dir": str(tmp_path)},
                             "runtime": {"cwd": str(tmp_path), "choices": choices or {"model": "gpt_tiny"}}})


def test_a_search_stops_early_only_when_every_trial_provably_fails_alike(tmp_path):
    """``-m +hparams_search=lr_optuna "data.seq_len=choice(128,512)"``: trial 0 sampled 512, the check refused it
    (``data.seq_len=512: must be <= model.max_seq_len=256``) and the search stopped as hopeless, though half the
    trials train: Optuna's sweeper writes no multirun.yaml, so the command line's keys were never seen. The keys a
    sweep samples come from its start (every syntax), and any doubt goes on."""
    from omegaconf import OmegaConf

    from hydratrain.errors import CheckpointError, ConfigError
    from hydratrain.sweep.checks import _hopeless, sampled_keys

    refused = ConfigError("data.seq_len", 512, "must be <= model.max_seq_len=256")
    fixed = ConfigError("data.paths", ["nope.txt"], "matches no file")
    for task in (["data.seq_len=choice(128,512)"], ["data.seq_len=128,512"], ["data.seq_len=range(128,640,384)"],
                 ["+data.seq_len=choice(128,512)"], ["++data.seq_len=128,512"], ["data.seq_len=interval(128,512)"],
                 ["data.seq_len=tag(a, choice(128,512))"], ["~data.seq_len=128,512"],
                 ["model.max_seq_len=choice(256,1024)"]):
        hc = _optuna_hc(tmp_path, ["+hparams_search=lr_optuna", "hydra.sweeper.n_trials=4", *task])
        assert _hopeless(hc, refused, [], launching=True) == "", task
        assert _hopeless(hc, fixed, [], launching=True).endswith("so every trial would fail alike"), task
    # sampled in the search space, with Hydra's prefixes
    hc = _optuna_hc(tmp_path, [], params={"+data.seq_len": "choice(128,512)"})
    assert _hopeless(hc, refused, [], launching=True) == ""
    # a swept config group, or experiment overlay, may set any key: in doubt
    hc = _optuna_hc(tmp_path, ["model=gpt_tiny,gpt_small"], choices={"model": "gpt_tiny"})
    assert _hopeless(hc, fixed, [], launching=True) == ""
    # a value that is an interpolation may follow a sampled key; Hydra's own keys (one job's dir); checkpoints
    hc = _optuna_hc(tmp_path, [])
    job = OmegaConf.create({"model": {"max_seq_len": 256}, "data": {"seq_len": "${model.max_seq_len}"}})
    assert _hopeless(hc, refused, [], launching=True, config=job) == ""
    assert _hopeless(hc, refused, [], launching=True, config=OmegaConf.create({"data": {"seq_len": 512}})) != ""
    assert _hopeless(hc, ConfigError("hydra.sweep.dir", "s", "another trial's"), [], launching=True) == ""
    assert _hopeless(hc, CheckpointError("step_1: model.d_model differs"), [], launching=True) == ""
    # the keys of the command line unknown (no mark, no multirun.yaml): in doubt, it goes on to the last trial
    (tmp_path / ".hydratrain_multirun.json").unlink()
    assert _hopeless(hc, fixed, [], launching=True) == ""
    last = OmegaConf.merge(hc, {"job": {"num": 3}})
    assert _hopeless(last, fixed, [{"status": "FAILED"}] * 4, launching=True).startswith("all 4 trials failed")
    assert sampled_keys(OmegaConf.create({"overrides": {"task": ["a=choice(1,2"]}})) is None  # unparsable


@requires("optuna")
def test_an_optuna_search_goes_on_after_a_trial_refused_for_its_sampled_value(cli, tmp_path):
    """The search of the report, in this process: trial 0 samples data.seq_len=512 (the preset's seed), which the
    check refuses; the search goes on to trial 1 instead of stopping as hopeless."""

    r = cli(["-m", "+hparams_search=lr_optuna", "hydra.sweeper.n_trials=2", "data.seq_len=choice(128,512)",
             "model.max_seq_len=256", "strategy=single", "trainer.max_steps=1", "trainer.eval_every_n_steps=0",
             f"hydra.sweep.dir={tmp_path}"])
    assert "data.seq_len=512: must be <= model.max_seq_len=256" in r.output, r.output[-3000:]
    assert "every trial would fail alike" not in r.output and "sweep stopped after job 0" not in r.output, \
        r.output[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit()) == ["0", "1"], r.output[-3000:]


def test_the_exit_hook_ends_a_sweep_that_ended_without_its_line_once(tmp_path, capsys, monkeypatch):
    """The sweeping process's exit hook (under launchers whose jobs run in other processes, a sweep whose last
    job completed after a failed one ended with Hydra's error, no report and no closing line): the report and
    the line, once; nothing when the sweep ended with a line of ours (sweep_ended: the closing line, a search
    stopped early, a preemption or Ctrl-C in a job), in a forked copy of the process, after Ctrl-C outside any job
    (Python's KeyboardInterrupt), or when no job failed."""
    import sys

    from hydratrain import exits

    run_id = mark_multirun(tmp_path)
    _job(tmp_path, 0, 1e-3, multirun=run_id, results_current=False)  # FAILED
    _job(tmp_path, 1, 2e-3, results=4.0, multirun=run_id)
    closing = f"hydratrain: 1 of 2 sweep job(s) failed (see {tmp_path / 'sweep_report.md'}); first: job 0 " \
              "(optim.lr=0.001): \n"
    exits.await_the_end(tmp_path)
    exits.end_of_process()
    exits.end_of_process()  # (once)
    assert capsys.readouterr().err == closing and (tmp_path / "sweep_report.md").exists()

    exits.await_the_end(tmp_path)
    exits.sweep_ended()
    exits.end_of_process()
    exits.await_the_end(tmp_path)
    monkeypatch.setitem(exits._AWAITED, "pid", -1)  # another process
    exits.end_of_process()
    exits.await_the_end(tmp_path)
    monkeypatch.setattr(sys, "last_value", KeyboardInterrupt(), raising=False)
    exits.end_of_process()
    monkeypatch.delattr(sys, "last_value")
    write_job_status(tmp_path / "0", 0, ["optim.lr=0.001"], "COMPLETED", multirun=run_id)
    exits.await_the_end(tmp_path)
    exits.end_of_process()
    assert capsys.readouterr().err == ""


def test_a_stored_optuna_study_is_not_searched_inside_each_torchrun_rank(tmp_path, monkeypatch):
    """``torchrun ... train.py -m +hparams_search=lr_optuna hydra.sweeper.storage=sqlite:///...``: every rank ran
    its own sweeper and created the study at once (sqlite's IntegrityError traceback, a trial left RUNNING for good).
    Refused before any trial, naming launcher=torchrun."""
    import pytest
    from omegaconf import OmegaConf

    from hydratrain.errors import ConfigError
    from hydratrain.sweep.checks import refuse_a_stored_study_over_its_job_dirs

    hc = OmegaConf.create({"sweeper": {"_target_": "hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper",
                                       "storage": f"sqlite:///{tmp_path}/o.db", "study_name": "s"},
                           "sweep": {"dir": str(tmp_path / "sweep")}, "runtime": {"cwd": str(tmp_path)}})
    monkeypatch.setenv("WORLD_SIZE", "1")
    refuse_a_stored_study_over_its_job_dirs(hc)  # one process, a new sweep dir: fine
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="a search run inside each torchrun rank .* launcher=torchrun"):
        refuse_a_stored_study_over_its_job_dirs(hc)


@requires("report")
def test_the_report_draws_every_jobs_curves_and_marks_the_failed_one(tmp_path):
    """A 3-job sweep's report at its end: ``sweep_report.png`` (a valid image) drawn from each job's TensorBoard
    events, linked under the md's table, and an html page holding the table and the image; the failed job is named
    "failed" (its curve dashed, its point a cross)."""
    import matplotlib.image
    from torch.utils.tensorboard import SummaryWriter

    from hydratrain.sweep_chart import chart_jobs, swept_keys
    from hydratrain.sweep_report import write_sweep_report

    run_id = mark_multirun(tmp_path)
    jobs = [(1e-3, "gpt_tiny", True), (3e-2, "gpt_small", True), (1.0, "gpt_tiny", False)]
    for num, (lr, model, ok) in enumerate(jobs):
        job = _job(tmp_path, num, lr, results=4.0 - num if ok else None, multirun=run_id, results_current=ok)
        overrides = [f"optim.lr={lr}", f"model={model}"]
        write_job_status(job, num, overrides, "COMPLETED" if ok else "FAILED", "" if ok else "DivergenceError: nan",
                         multirun=run_id, results_current=ok)
        with SummaryWriter(str(job / "tensorboard")) as tb:
            for step in range(1, 4 if ok else 3):
                tb.add_scalar("train/loss", 5.0 - step * (num + 1) * 0.3, step)
                tb.add_scalar("eval/loss", 5.1 - step * (num + 1) * 0.3, step)
    assert swept_keys([["optim.lr=1", "model=a", "x=1"], ["optim.lr=2", "model=a", "x=1"], ["+model=b"]]) == [
        "optim.lr", "model", "x"]

    write_sweep_report(tmp_path)  # after a job: no picture yet
    assert not (tmp_path / "sweep_report.png").exists() and "sweep_report.png" not in \
        (tmp_path / "sweep_report.md").read_text()
    write_sweep_report(tmp_path, chart=True)  # the sweep's end
    image = matplotlib.image.imread(tmp_path / "sweep_report.png")
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100 and image.std() > 0
    assert "](sweep_report.png)" in (tmp_path / "sweep_report.md").read_text()
    page = (tmp_path / "sweep_report.html").read_text()
    assert '<img src="sweep_report.png"' in page and "FAILED" in page and "DivergenceError: nan" in page
    assert all(f"<td>{num}</td>" in page and f"optim.lr={lr}" in page for num, lr in enumerate((0.001, 0.03, 1.0)))
    drawn = chart_jobs(tmp_path, sweep_rows(tmp_path))
    assert [(len(j["train"]), j["failed"], j["label"].endswith("(failed)")) for j in drawn] == [
        (3, False, False), (3, False, False), (2, True, True)]
    assert drawn[2]["value"] == drawn[2]["objective"][-1][1]  # its last eval/loss: a cross in the objective's panels
    mark_multirun(tmp_path)  # a new multirun in the same dir: the earlier one's picture goes
    assert not (tmp_path / "sweep_report.png").exists()


def test_without_matplotlib_the_report_has_its_table_and_no_chart(tmp_path, monkeypatch, caplog):
    """matplotlib is an optional extra (report): without it the sweep's end writes the table, no picture and no link
    to one, and says why in the log."""
    import sys

    from hydratrain.sweep_report import write_sweep_report

    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # (what an import of a missing module raises)
    run_id = mark_multirun(tmp_path)
    _job(tmp_path, 0, 1e-3, results=4.0, multirun=run_id)
    with caplog.at_level("INFO", logger="hydratrain.sweep"):
        assert write_sweep_report(tmp_path, chart=True) == tmp_path / "sweep_report.csv"
    assert not (tmp_path / "sweep_report.png").exists() and "png" not in (tmp_path / "sweep_report.md").read_text()
    assert "<td>COMPLETED</td>" in (tmp_path / "sweep_report.html").read_text()
    assert "matplotlib is not installed" in caplog.text
