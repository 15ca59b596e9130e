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
# (min_delta 100), so it stops at the third eval (step 15) whatever the values; a checkpoint at step 12; a
# constant lr (the schedule's length apart)
OWN = ["--config-dir", "my_conf", "+experiment=spirals", "device=cpu", "precision=fp32", "logger.peak_flops=1e11",
       "trainer.progress_bar=false", "data.n=600", "strategy=single", "plan.enabled=false"]
LOOP = [*OWN, "trainer.max_steps=30", "trainer.eval_every_n_steps=5", "trainer.log_every_n_steps=2",
        "scheduler=constant", "checkpoint.every_n_steps=12", "+callbacks.count._target_=mypkg.cb.Count",
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
    assert 15 in tb_all(own / "whole")["train/loss"]  # the last step's window is logged, as a last step's is

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
    kept = [*LOOP, "checkpoint.save_last=true"]  # the stop step saved: a relaunch (a requeue) stays stopped
    assert cli(kept, own / "kept", fast=False).returncode == 0
    done = results(own / "kept")
    again = cli(kept, own / "kept", fast=False)
    assert again.returncode == 0, again.output[-3000:]
    assert "resumed at step 15, where this run stopped (early stopping: eval/loss" in again.output, again.output[-4000:]
    assert "nothing to train, evaluating only" in again.output and "stopping after" not in again.output
    redone = results(own / "kept")
    assert (redone["steps"], redone["eval_loss"], redone["stopped_early"]) == (15, done["eval_loss"],
                                                                               done["stopped_early"])
    assert sorted(p.name for p in (own / "kept" / "checkpoints").glob("step_*"))[-1] == "step_00000015"


QUICK = [*OWN, "trainer.max_steps=12", "trainer.eval_every_n_steps=2", "trainer.log_every_n_steps=6", "optim.lr=0.02"]


def test_the_two_best_checkpoints_by_accuracy_are_kept_tested_and_evaluated_again(cli, own):
    """Top-2 by eval/accuracy: kept, recorded, the best one the objective, tested at the end (a test split), and
    evaluated again by mode=eval, which reproduces the recorded value and the test figures. (On 2 ranks under FSDP:
    tests/e2e/test_evaluate_ranks.py.)"""
    r = cli([*QUICK, "checkpoint.monitor=eval/accuracy", "checkpoint.mode=max", "checkpoint.save_top_k=2",
             "checkpoint.every_n_steps=0", "checkpoint.keep_last=1", "trainer.objective_at=best",
             "+data.test_fraction=0.2", "trainer.test_after_fit=true"], own / "run", fast=False)
    assert r.returncode == 0, r.output[-3000:]
    accuracy = tb_all(own / "run")["eval/accuracy"]  # {step: value} of every evaluation, the final one included
    ranked = sorted(accuracy, key=lambda step: (-accuracy[step], step))[:2]
    record = json.loads((own / "run" / "best_checkpoints.json").read_text())
    assert [b["step"] for b in record["best"]] == ranked
    assert [b["value"] for b in record["best"]] == [accuracy[s] for s in ranked]
    kept = sorted(p.name for p in (own / "run" / "checkpoints").glob("step_*"))
    assert kept == sorted({f"step_{s:08d}" for s in ranked} | {f"step_{max(ranked):08d}"})  # the best and no other
    # the end says the last steps are in no checkpoint only when the final evaluation did not save the last step
    assert ("are in no checkpoint" in r.output) == (12 not in ranked), r.output[-2000:]
    res = results(own / "run")
    assert res["objective"] == accuracy[ranked[0]] and res["best"] == {"step": ranked[0],
                                                                         "eval/accuracy": accuracy[ranked[0]]}
    from mypkg.nets import ResMLP
    from safetensors.torch import load_file

    best = load_file(own / "run" / "best" / "model.safetensors")
    ResMLP(width=64, depth=4, num_classes=3).load_state_dict(best, strict=True)  # the model's own names
    assert set(res["test_metrics"]) == {"loss", "accuracy"} and "testing the best weights" in r.output
    again = cli([*OWN, "+data.test_fraction=0.2", "mode=eval", f"checkpoint.resume_from={own / 'run'}"],
                own / "again", fast=False)
    assert again.returncode == 0, again.output[-3000:]
    assert "differs from the one that saved it" not in again.output and "WARNING" not in again.output
    evaluated = json.loads((own / "again" / "eval_results.json").read_text())
    assert evaluated["step"] == ranked[0] and evaluated["eval"]["accuracy"] == accuracy[ranked[0]]
    assert all(abs(evaluated["test"][k] - v) <= 1e-6 for k, v in res["test_metrics"].items())
    assert not (own / "again" / "checkpoints").exists()  # nothing trained, nothing saved


def test_a_checkpoint_pushed_out_of_the_top_k_after_the_last_save_is_removed_at_once(tmp_path):
    """The run's last evaluation can re-rank the top k after the run's last save (a periodic save of the last step):
    the checkpoint it pushes out is pruned then, not at a next save that never comes; a resume restores the ranking
    without pruning."""
    from types import SimpleNamespace

    import torch

    from hydratrain.checkpoint.layout import METADATA
    from hydratrain.checkpoint.manager import CheckpointManager, step_dir_name
    from hydratrain.train.best_checkpoints import BestCheckpoints

    root = tmp_path / "checkpoints"
    for step in (100, 200, 300):
        (root / step_dir_name(step)).mkdir(parents=True)
        (root / step_dir_name(step) / METADATA).write_text("")
    manager = CheckpointManager(root, {}, {}, {}, keep_last=2, device=torch.device("cpu"))
    best = BestCheckpoints(manager, "eval/accuracy", "max", save_top_k=2)
    run = SimpleNamespace(is_main=True, run_dir=tmp_path, request_checkpoint=lambda: None)
    best.load_state_dict(best.state_dict() | {"best": json.dumps([{"step": 100, "value": 0.9, "objective": None},
                                                                   {"step": 50, "value": 0.8, "objective": None}])})
    assert sorted(p.name for p in root.iterdir()) == [step_dir_name(s) for s in (100, 200, 300)]  # resumed as is
    manager.last_saved_step = 300
    best.on_eval_end(run, 200, {"eval/accuracy": 0.95})  # 100 still second: nothing pushed out
    assert [b["step"] for b in best.best] == [200, 100] and (root / step_dir_name(100)).is_dir()
    best.on_eval_end(run, 300, {"eval/accuracy": 0.97})  # after step 300's save: 100 out, neither best nor latest
    assert [b["step"] for b in best.best] == [300, 200]
    assert sorted(p.name for p in root.iterdir()) == [step_dir_name(s) for s in (200, 300)]
    assert [b["step"] for b in json.loads((tmp_path / "best_checkpoints.json").read_text())["best"]] == [300, 200]


def test_a_monitor_that_names_no_logged_metric_is_one_line_before_the_run(cli, own):
    r = cli([*QUICK, "checkpoint.monitor=eval/acuracy"], own / "typo", fast=False)
    assert r.returncode == 2 and r.err.strip().splitlines() == [
        "hydratrain: config error: checkpoint.monitor='eval/acuracy': names no metric the evaluation logs; allowed: "
        "eval/loss, eval/accuracy"], r.output[-2000:]
    r = cli([*QUICK, "trainer.objective_at=best"], own / "best", fast=False)
    assert r.returncode == 2 and "trainer.objective_at='best': needs checkpoint.monitor" in r.err
    r = cli([*QUICK, "trainer.test_after_fit=true"], own / "untested", fast=False)  # (no test split): before training
    assert r.returncode == 2 and r.err.strip().splitlines() == [
        "hydratrain: config error: trainer.test_after_fit=True: the data has no test split (a data function returns "
        "{'train', 'val', 'test'}: docs/research-loop.md#a-test-split); or set it to false"], r.output[-2000:]
    assert "eval at step" not in r.output and not (own / "untested" / "checkpoints").exists()


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
# ---------------------------------------------------------------------------------------------- EMA weights
def test_the_ema_weights_are_evaluated_beside_the_raw_ones_and_serve_the_monitors(cli, own):
    """eval_ema/* is logged at every evaluation and reaches the later callbacks (the best checkpoint by
    eval_ema/loss, early stopping on eval_ema/accuracy) and the objective; model_ema.safetensors is the model's
    format; the swap in and out for its evaluation leaves the training exactly as it is without an EMA."""
    stop = ["trainer.early_stopping.patience=2", "trainer.early_stopping.min_delta=100"]  # the third eval: step 6
    r = cli([*QUICK, "trainer.ema.decay=0.8", "trainer.ema.warmup_steps=4", "checkpoint.monitor=eval_ema/loss",
             "checkpoint.every_n_steps=0", "trainer.objective=eval_ema/accuracy", "trainer.objective_at=last",
             "trainer.early_stopping.monitor=eval_ema/accuracy", "trainer.early_stopping.mode=max", *stop],
            own / "ema", fast=False)
    assert r.returncode == 0, r.output[-3000:]
    assert "stopping after step 6 of 12: early stopping: eval_ema/accuracy has not improved" in r.output
    tb = tb_all(own / "ema")
    ema_loss = tb["eval_ema/loss"]
    assert sorted(ema_loss) == sorted(tb["eval/loss"]) == [2, 4, 6] and sorted(tb["eval_ema/accuracy"]) == [2, 4, 6]
    assert all(ema_loss[s] != tb["eval/loss"][s] for s in ema_loss)
    best = json.loads((own / "ema" / "best_checkpoints.json").read_text())
    assert best["monitor"] == "eval_ema/loss" and best["best"][0]["value"] == min(ema_loss.values())
    assert results(own / "ema")["objective"] == tb["eval_ema/accuracy"][6]
    from mypkg.nets import ResMLP
    from safetensors.torch import load_file

    ema, raw = load_file(own / "ema" / "model_ema.safetensors"), load_file(own / "ema" / "model.safetensors")
    ResMLP(width=64, depth=4, num_classes=3).load_state_dict(ema, strict=True)  # the model's own names
    assert any(not (ema[k] == raw[k]).all() for k in raw)

    r = cli([*QUICK, "checkpoint.every_n_steps=0", "trainer.early_stopping.monitor=eval/accuracy",
             "trainer.early_stopping.mode=max", *stop], own / "plain", fast=False)
    assert r.returncode == 0, r.output[-3000:]
    plain = tb_all(own / "plain")
    assert plain["train/loss"] == tb["train/loss"] and plain["eval/loss"] == tb["eval/loss"]
    assert not (own / "plain" / "model_ema.safetensors").exists()


def test_a_bad_ema_setting_or_an_eval_ema_monitor_without_an_ema_is_one_config_line(cli, own):
    r = cli([*QUICK, "trainer.ema.decay=1.0"], own / "decay", fast=False)
    assert r.returncode == 2 and r.err.strip().splitlines() == [
        "hydratrain: config error: trainer.ema.decay=1.0: must be in (0, 1), e.g. 0.999 (null: no EMA)"], r.output
    r = cli([*QUICK, "trainer.ema.decay=0.99", "trainer.ema.warmup_steps=-1"], own / "warmup", fast=False)
    assert r.returncode == 2 and r.err.strip().splitlines() == [
        "hydratrain: config error: trainer.ema.warmup_steps=-1: must be >= 0 (steps)"], r.output
    r = cli([*QUICK, "checkpoint.monitor=eval_ema/loss"], own / "monitor", fast=False)
    assert r.returncode == 2 and r.err.strip().splitlines() == [
        "hydratrain: config error: checkpoint.monitor='eval_ema/loss': names no metric the evaluation logs; allowed: "
        "eval/loss, eval/accuracy (eval_ema/* is logged with an EMA of the weights: set trainer.ema.decay, e.g. "
        "0.999)"], r.output
    r = cli([*QUICK, "trainer.ema.decay=0.99", "+callbacks.ema._target_=mypkg.cb.Count"], own / "name", fast=False)
    assert r.returncode == 2 and r.err.strip().splitlines() == [
        "hydratrain: config error: callbacks.ema._target_='mypkg.cb.Count': callbacks.ema is the name of trainer.ema's "
        "own callback (trainer.ema.decay is set): give yours another name"], r.output


def test_the_ema_update_its_warm_up_and_the_swap_that_leaves_the_weights_bit_for_bit():
    import torch

    from hydratrain.train.ema import EMA

    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.LayerNorm(5))
    model[1].bias.requires_grad_(False)  # frozen: no EMA of it
    ema = EMA(model, decay=0.9, warmup_steps=4)
    assert ema.names == ["0.weight", "0.bias", "1.weight"]
    assert [ema.decay_at(t) for t in (1, 2, 4, 8)] == [0.9 * 0.25, 0.9 * 0.5, 0.9, 0.9]
    assert EMA(model, decay=0.9).decay_at(1) == 0.9
    start = [p.detach().clone() for p in ema.params]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ema.on_train_step_end(None, 2, {})
    for e, s in zip(ema.ema, start):
        torch.testing.assert_close(e, s + 0.55)  # 0.45 * s + 0.55 * (s + 1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with ema.swapped(model):
        assert torch.equal(model[0].weight, ema.ema[0]) and torch.equal(model[1].bias, before["1.bias"])
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    restored = EMA(model, decay=0.9)
    restored.load_state_dict({"weights": {k: v.clone() for k, v in ema.state_dict()["weights"].items()}})
    assert all(torch.equal(a, b) for a, b in zip(restored.ema, ema.ema))
