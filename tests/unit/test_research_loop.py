"""The research loop in this process: callbacks of one's own (state kept across a crash and a resume, a stop agreed
by the run, one line for a callback that raises), early stopping, and the best checkpoints by a metric."""
from __future__ import annotations

import json

from helpers import results, tb_all

CALLBACKS = '''
import json

from hydratrain.train.callbacks import Callback


class Count(Callback):
    def __init__(self):
        self.steps, self.evals, self.logged = 0, 0, 0

    def on_train_step_end(self, run, step, logs):
        self.steps += 1
        self.logged += "train/loss" in logs

    def on_eval_end(self, run, step, metrics):
        self.evals += 1

    def on_fit_end(self, run, result):
        if run.is_main:
            seen = {"steps": self.steps, "evals": self.evals, "logged": self.logged, "at": run.step}
            (run.run_dir / "count.json").write_text(json.dumps(seen))

    def state_dict(self):
        return {"steps": self.steps, "evals": self.evals, "logged": self.logged}

    def load_state_dict(self, state):
        self.steps, self.evals, self.logged = state["steps"], state["evals"], state["logged"]


class Crash:  # a callback need not subclass Callback
    def __init__(self, at: int):
        self.at = at

    def on_train_step_end(self, run, step, logs):
        if step == self.at:
            raise RuntimeError("boom")
'''

# the own-model example (seconds a run): 30 steps at most; an eval every 5; early stopping that no eval can satisfy
# (min_delta 100), so it stops at the third eval (step 15) whatever the values; checkpoints every 4 steps; a
# constant lr (the schedule's length apart)
OWN = ["--config-dir", "my_conf", "+experiment=spirals", "device=cpu", "precision=fp32", "logger.peak_flops=1e11",
       "trainer.progress_bar=false", "data.n=600", "strategy=single"]
LOOP = [*OWN, "trainer.max_steps=30", "trainer.eval_every_n_steps=5", "trainer.log_every_n_steps=2",
        "scheduler=constant", "checkpoint.every_n_steps=4", "+callbacks.count._target_=mypkg.cb.Count",
        "trainer.early_stopping.monitor=eval/loss", "trainer.early_stopping.patience=2",
        "trainer.early_stopping.min_delta=100"]


def test_a_callback_and_early_stopping_go_on_after_a_crash_as_if_uninterrupted(cli, own):
    (own / "mypkg" / "cb.py").write_text(CALLBACKS)
    whole = cli(LOOP, own / "whole", fast=False)
    assert whole.returncode == 0, whole.output[-3000:]
    assert "stopping after step 15 of 30: early stopping: eval/loss has not improved on its best" in whole.output
    assert json.loads((own / "whole" / "count.json").read_text()) == {"steps": 15, "evals": 3, "logged": 8, "at": 15}
    done = results(own / "whole")
    assert done["steps"] == 15 and done["stopped_early"].startswith("early stopping: eval/loss")

    crashed = cli([*LOOP, "+callbacks.crash._target_=mypkg.cb.Crash", "+callbacks.crash.at=13"], own / "split",
                  fast=False)
    assert crashed.returncode == 1, crashed.output[-3000:]
    assert crashed.err.strip().splitlines()[-1].startswith(
        "hydratrain: callback error: callbacks.crash (Crash.on_train_step_end) raised RuntimeError: boom")
    resumed = cli(LOOP, own / "split", fast=False)  # from step 12's checkpoint, which holds the callbacks' states
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert "resumed from" in resumed.output and "stopping after step 15 of 30" in resumed.output
    assert json.loads((own / "split" / "count.json").read_text()) == {"steps": 15, "evals": 3, "logged": 8, "at": 15}
    split = results(own / "split")
    assert (split["steps"], split["eval_loss"], split["train_loss"]) == \
        (done["steps"], done["eval_loss"], done["train_loss"])


QUICK = [*OWN, "trainer.max_steps=12", "trainer.eval_every_n_steps=2", "trainer.log_every_n_steps=6", "optim.lr=0.02"]


def test_the_two_best_checkpoints_by_accuracy_are_kept_and_the_best_is_the_objective(cli, own):
    r = cli([*QUICK, "checkpoint.monitor=eval/accuracy", "checkpoint.mode=max", "checkpoint.save_top_k=2",
             "checkpoint.every_n_steps=0", "checkpoint.keep_last=1", "trainer.objective_at=best"], own / "run",
            fast=False)
    assert r.returncode == 0, r.output[-3000:]
    accuracy = tb_all(own / "run")["eval/accuracy"]  # {step: value} of every evaluation, the final one included
    ranked = sorted(accuracy, key=lambda step: (-accuracy[step], step))[:2]
    record = json.loads((own / "run" / "best_checkpoints.json").read_text())
    assert [b["step"] for b in record["best"]] == ranked
    assert [b["value"] for b in record["best"]] == [accuracy[s] for s in ranked]
    kept = sorted(p.name for p in (own / "run" / "checkpoints").glob("step_*"))
    assert kept == sorted({f"step_{s:08d}" for s in ranked} | {f"step_{max(ranked):08d}"})  # the best and no other
    res = results(own / "run")
    assert res["objective"] == accuracy[ranked[0]] and res["best"] == {"step": ranked[0],
                                                                         "eval/accuracy": accuracy[ranked[0]]}
    from mypkg.nets import ResMLP
    from safetensors.torch import load_file

    best = load_file(own / "run" / "best" / "model.safetensors")
    ResMLP(width=64, depth=4, num_classes=3).load_state_dict(best, strict=True)  # the model's own names


def test_a_monitor_that_names_no_logged_metric_is_one_line_before_the_run(cli, own):
    r = cli([*QUICK, "checkpoint.monitor=eval/acuracy"], own / "typo", fast=False)
    assert r.returncode == 2 and r.err.strip().splitlines() == [
        "hydratrain: config error: checkpoint.monitor='eval/acuracy': names no metric the evaluation logs; allowed: "
        "eval/loss, eval/accuracy"], r.output[-2000:]
    r = cli([*QUICK, "trainer.objective_at=best"], own / "best", fast=False)
    assert r.returncode == 2 and "trainer.objective_at='best': needs checkpoint.monitor" in r.err


def test_a_schedule_of_ones_own_and_parameter_groups_resume_bit_identically(cli, own):
    """OneCycleLR by _target_ (its total_steps filled with the run's length) over two parameter groups (a lower lr
    for the first block, no decay on biases): a run crashed at step 9 and resumed from step 6's checkpoint ends
    with the weights of the uninterrupted run, bit for bit. A glob that matches nothing is one config line."""
    from safetensors.torch import load_file

    (own / "mypkg" / "cb.py").write_text(CALLBACKS)
    (own / "my_conf" / "scheduler").mkdir()
    (own / "my_conf" / "scheduler" / "onecycle.yaml").write_text(
        "_target_: torch.optim.lr_scheduler.OneCycleLR\nmax_lr: 0.01\n")
    args = [*OWN, "trainer.max_steps=14", "trainer.eval_every_n_steps=0", "trainer.log_every_n_steps=7",
            "checkpoint.every_n_steps=6", "scheduler=onecycle",
            "optim.param_groups=[{match: 'blocks.0.*', lr_scale: 0.5}, {match: '*.bias', weight_decay: 0.0}]"]
    whole = cli(args, own / "whole", fast=False)
    assert whole.returncode == 0, whole.output[-3000:]
    assert "'blocks.0.*' 33,216 parameters in 6 tensors, lr_scale 0.5; '*.bias' 1,219 parameters" in whole.output
    assert "OneCycleLR(max_lr=0.01, total_steps=14)" in whole.output
    crashed = cli([*args, "+callbacks.crash._target_=mypkg.cb.Crash", "+callbacks.crash.at=9"], own / "split",
                  fast=False)
    assert crashed.returncode == 1, crashed.output[-3000:]
    resumed = cli(args, own / "split", fast=False)
    assert resumed.returncode == 0 and "resumed from" in resumed.output, resumed.output[-3000:]
    a, b = load_file(own / "whole" / "model.safetensors"), load_file(own / "split" / "model.safetensors")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    typo = cli([*args, "optim.param_groups=[{match: 'block.0.*', lr_scale: 0.5}]"], own / "typo", fast=False)
    assert typo.returncode == 2 and typo.err.strip().splitlines()[-1].startswith(
        "hydratrain: config error: optim.param_groups[0].match='block.0.*': matches no trainable parameter"), \
        typo.output[-2000:]
