"""Callbacks on 2 gloo ranks under FSDP: a stop one rank asks for is agreed, so every rank stops after the same
step; and a user callback's state and early stopping's counter survive a SIGKILL, so the resumed run stops where the
uninterrupted one does, with the same weights."""
from __future__ import annotations

import json

import pytest

from helpers import FAULTY, log_of, own_launch_dir, results, run

CALLBACKS = '''
import json

from hydratrain.train.callbacks import Callback


class Count(Callback):
    def __init__(self):
        self.steps, self.evals = 0, 0

    def on_train_step_end(self, run, step, logs):
        self.steps += 1

    def on_eval_end(self, run, step, metrics):
        self.evals += 1

    def on_fit_end(self, run, result):
        (run.run_dir / f"count{run.rank}.json").write_text(json.dumps([self.steps, self.evals, run.step]))

    def state_dict(self):
        return {"steps": self.steps, "evals": self.evals}

    def load_state_dict(self, state):
        self.steps, self.evals = state["steps"], state["evals"]


class StopOnRank1:
    def on_train_step_end(self, run, step, logs):
        if run.rank == 1 and step == 5:
            run.request_stop("rank 1 asked at step 5")
'''

BASE = ["--config-dir", "my_conf", "+experiment=spirals", "device=cpu", "precision=fp32", "logger.peak_flops=1e11",
        "trainer.progress_bar=false", "data.n=1200", "data.batch_size=16", "plan.enabled=false", "strategy=fsdp",
        "scheduler=constant", "trainer.max_steps=30", "trainer.log_every_n_steps=2"]


@pytest.mark.slow  # (four 2-rank runs: about 40 s here)
def test_callbacks_agree_on_two_ranks_and_survive_a_kill(tmp_path):
    launch = own_launch_dir(tmp_path / "launch", cb=CALLBACKS)
    one_rank = run([*BASE, "trainer.eval_every_n_steps=0", "+callbacks.stop._target_=mypkg.cb.StopOnRank1",
                    f"hydra.run.dir={tmp_path / 'stop'}"], nproc=2, cwd=launch, fast=False, timeout=600).ok()
    assert results(tmp_path / "stop")["steps"] == 6  # asked after step 5, agreed at the log step after it
    for rank in (0, 1):  # the asking rank's reason on every rank (rank 0's log and results.json give it)
        assert "stopping after step 6 of 30: rank 1 asked at step 5" in log_of(tmp_path / "stop", rank), one_rank.output
    assert results(tmp_path / "stop")["stopped_early"] == "rank 1 asked at step 5"

    # early stopping that no eval satisfies (min_delta 100): the third eval (step 12) stops the run
    args = [*BASE, "trainer.eval_every_n_steps=4", "checkpoint.every_n_steps=8",
            "+callbacks.count._target_=mypkg.cb.Count", "trainer.early_stopping.monitor=eval/loss",
            "trainer.early_stopping.patience=2", "trainer.early_stopping.min_delta=100"]
    run([*args, f"hydra.run.dir={tmp_path / 'a'}"], nproc=2, cwd=launch, fast=False, timeout=600).ok()
    kill = {"HT_FAULT": "kill", "HT_FAULT_STEP": "9", "HT_FAULT_AT": "after_step", "HT_FAULT_RANK": "all"}
    killed = run([*args, f"hydra.run.dir={tmp_path / 'b'}"], nproc=2, cwd=launch, fast=False, script=FAULTY,
                 env=kill, timeout=600)
    assert killed.returncode != 0 and (tmp_path / "b" / "checkpoints" / "step_00000008").is_dir()
    run([*args, f"hydra.run.dir={tmp_path / 'b'}"], nproc=2, cwd=launch, fast=False, timeout=600).ok()
    assert "resumed from" in log_of(tmp_path / "b")
    for d in ("a", "b"):
        assert results(tmp_path / d)["steps"] == 12 and "stopping after step 12 of 30" in log_of(tmp_path / d)
        assert [json.loads((tmp_path / d / f"count{r}.json").read_text()) for r in (0, 1)] == [[12, 3, 12]] * 2
    from safetensors.torch import load_file

    a, b = (load_file(tmp_path / d / "model.safetensors") for d in ("a", "b"))
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
