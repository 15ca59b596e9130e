"""Launches into a run dir that already holds TensorBoard events (README, "Checkpoints and resuming"): whatever the
launch (a resume, a fresh start after a crash before the first checkpoint, a deliberate fresh start, a requeue of a
finished run with nothing left to train), TensorBoard loads every tag with strictly increasing steps, each step once,
and no NaN, both as TensorBoard's server loads the run dir and as the legacy ``EventAccumulator`` does
(``helpers.assert_tb_clean``). Runs in this process (``cli``)."""
from __future__ import annotations

import math
import re

import pytest
import torch

from helpers import assert_tb_clean, hparams_row, hparams_runs, results, tb_as_loaded


def _steps(points, tag):
    return [s for s, _ in points[tag]]


@pytest.mark.slow  # several in-process runs; keeps the default suite near 4 minutes
def test_a_fresh_start_over_earlier_events_replaces_their_curves(cli, tmp_path, monkeypatch):
    """The first launch dies after step 4 (its eval at 3 logged), before its first checkpoint (5): the relaunch starts
    afresh, and its curves replace the dead launch's from step 0 on instead of going back to step 1 beside them.
    Then a deliberate fresh start (``checkpoint.auto_resume=false``, another lr, 4 steps) over that finished run:
    its checkpoints are set aside and its curves give way to the new launch's."""
    from hydratrain.train.trainer import Trainer

    common = ["strategy=single", "scheduler=constant", "trainer.eval_every_n_steps=3", "checkpoint.every_n_steps=5"]
    original = Trainer._end_of_step

    def crash_after_4(self, step, votes):
        stop = original(self, step, votes)
        if step == 4:
            raise RuntimeError("crashed after step 4 (test)")
        return stop

    with monkeypatch.context() as patch:
        patch.setattr(Trainer, "_end_of_step", crash_after_4)
        assert cli([*common, "trainer.max_steps=6"], tmp_path).returncode != 0
    assert _steps(tb_as_loaded(tmp_path), "train/loss") == [1, 2, 3, 4]
    assert not list(tmp_path.glob("checkpoints/step_*"))
    r = cli([*common, "trainer.max_steps=6"], tmp_path).ok()
    points = assert_tb_clean(tmp_path)
    assert _steps(points, "train/loss") == [1, 2, 3, 4, 5, 6] and _steps(points, "eval/loss") == [3, 6]
    assert len(re.findall(r"TensorBoard events of an earlier launch", r.output)) == 1, r.output[-3000:]

    cli([*common, "trainer.max_steps=4", "optim.lr=2e-3", "checkpoint.auto_resume=false"], tmp_path).ok()
    points = assert_tb_clean(tmp_path)
    assert _steps(points, "train/loss") == [1, 2, 3, 4]
    assert [lr for _, lr in points["train/lr"]] == pytest.approx([2e-3] * 4)
    row = hparams_row(tmp_path)  # the one row, this launch's: the first launch's values are gone
    assert _steps(points, "eval/loss") == [3, 4] and _steps(row, "hparam/eval_loss") == [4]
    assert _steps(row, "_hparams_/session_start_info") == [4]
    assert row["hparam/train_loss"][0][1] == pytest.approx(results(tmp_path)["train_loss"])


@pytest.mark.slow  # a sibling of it runs by default; CI runs this too (default suite near 4 minutes)
def test_relaunching_a_finished_run_adds_no_points_and_no_nan(cli, tmp_path):
    """A finished run (save_last) relaunched twice, as a requeued job is: nothing to train. Each relaunch evaluates
    (its eval loss is the sweep objective) and its end-of-run records replace those at the last step; the log line's
    scalars of that step (train loss, lr, tokens/s, ...) stay as the launch that trained it logged them; no NaN
    reaches the console, the scalars or the hparams row; results.json keeps the figures of the launch that trained."""
    common = ["strategy=single", "trainer.max_steps=5", "checkpoint.save_last=true"]
    cli(common, tmp_path).ok()
    before, first = assert_tb_clean(tmp_path), results(tmp_path)
    for _ in range(2):
        r = cli(common, tmp_path).ok()
        assert "nothing to train" in r.output and not re.search(r"\bnan\b", r.output, re.IGNORECASE), r.output[-3000:]
        after = assert_tb_clean(tmp_path)
        assert sorted(after) == sorted(before)
        for tag in after:
            if not tag.startswith(("eval/", "hparam/", "_hparams_/")):
                assert after[tag] == before[tag], tag  # the training launch's points, the step-5 one included
        assert _steps(after, "eval/loss") == [5] and after["eval/loss"][0][1] == pytest.approx(first["eval_loss"])
        row = hparams_row(tmp_path)
        hparams = {tag: pts[-1][1] for tag, pts in row.items() if tag.startswith("hparam/")}
        assert all(_steps(row, tag) == [5] for tag in row)
        assert hparams["hparam/train_loss"] == pytest.approx(first["train_loss"])
        assert hparams["hparam/tokens_per_sec"] == pytest.approx(first["tokens_per_sec"], rel=1e-6)
        res = results(tmp_path)
        assert res["steps_this_launch"] == 0 and res["eval_loss"] == pytest.approx(first["eval_loss"])
        for key in ("train_loss", "tokens_per_sec", "mfu", "first_loss"):
            assert res[key] == first[key], key


@pytest.mark.slow  # three launches
def test_a_resume_of_a_finished_run_writes_its_end_of_run_records_once(cli, tmp_path):
    """A finished run relaunched with its last checkpoint before the end (step 4 of 6) trains 5 and 6 again: they
    replace the first launch's (TensorBoard's server ignores a run's first ``SessionLog.START``, so the first launch
    must write one too), and so do its sample text, hparams session and hparams metrics (the session was written at
    step 0, where no resume purges)."""
    common = ["strategy=single", "trainer.max_steps=6", "checkpoint.every_n_steps=4", "trainer.sample_tokens=4"]
    cli(common, tmp_path).ok()
    cli(common, tmp_path).ok()
    points = assert_tb_clean(tmp_path)
    assert _steps(points, "train/loss") == [1, 2, 3, 4, 5, 6]
    ends = {t: pts for t, pts in {**points, **hparams_row(tmp_path)}.items()
            if t.startswith(("hparam/", "_hparams_/", "sample"))}
    assert len(ends) > 3 and all(_steps(ends, t) == [6] for t in ends), ends


def test_a_window_without_a_known_peak_logs_no_nan_mfu(tmp_path):
    """With no peak FLOP/s (a GPU not in the table), tokens/s is logged and MFU is left out, not logged as NaN."""
    from hydratrain.train.step_logger import StepLogger

    logger = StepLogger(tmp_path, torch.device("cpu"), tokens_per_step=256, flops_per_token=1e6,
                        peak_flops_total=math.nan, log_every=1, max_steps=2, is_main=True, tensorboard=True,
                        progress_bar=False)
    logger.start(0)
    for step in (1, 2):
        logger.step_done(step, torch.tensor(2.0))
        logger.log(step, torch.tensor(1.0), 1e-3, timed=step > 1)
    logger.tb.close()
    points = assert_tb_clean(tmp_path)
    assert _steps(points, "perf/tokens_per_sec") == [2] and "perf/mfu" not in points


@pytest.mark.slow  # two launches
def test_the_hparams_row_of_an_extended_run_has_the_values_of_its_last_launch(cli, tmp_path):
    """A run extended with another lr: TensorBoard keeps the first session it reads in a run, so a row written
    beside the scalars showed the first launch's lr and max_steps next to the last launch's loss. The row is a run of
    its own, replaced by each launch: as TensorBoard's hparams plugin reads the run dir, one row, the last launch's."""
    from tensorboard.plugins.hparams import metadata as hp

    common = ["strategy=single", "trainer.eval_every_n_steps=0"]
    cli([*common, "trainer.max_steps=4", "optim.lr=2e-3", "checkpoint.save_last=true"], tmp_path).ok()
    cli([*common, "trainer.max_steps=6", "optim.lr=1e-2"], tmp_path).ok()
    (session,) = hparams_runs(tmp_path).values()
    values = hp.parse_session_start_info_plugin_data(session).hparams
    assert (values["optim.lr"].number_value, values["trainer.max_steps"].number_value) == (1e-2, 6)
    row = hparams_row(tmp_path)
    assert row["hparam/train_loss"] == [(6, pytest.approx(results(tmp_path)["train_loss"]))]
