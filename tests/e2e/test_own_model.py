"""A model, datasets, loss and metric defined outside the package (examples/own_model, copied into a temp launch dir)
on 2 gloo ranks: DDP and FSDP2 with its blocks found (wrap_policy=auto), activation checkpointing, a meta build
initialised through reset_parameters, a 0-d parameter under FSDP, the same weights under either strategy and the
same initial ones at any world size, export loading strictly into the class; and an exact resume after a kill.
(In-process checks of the same example: tests/unit/test_components.py.)
"""
from __future__ import annotations

import pytest
import torch

from helpers import FAULTY, forget_mypkg, log_of, own_launch_dir, report_rows, results, run

BASE = ["--config-dir", "my_conf", "+experiment=spirals", "device=cpu", "precision=fp32", "logger.peak_flops=1e11",
        "trainer.progress_bar=false", "data.n=1200", "data.batch_size=16", "trainer.eval_every_n_steps=0",
        "trainer.log_every_n_steps=1"]


# the example's model with its logits scaled by a learnable 0-d temperature, as CLIP's logit_scale: FSDP2 cannot
# shard a 0-d parameter, so every rank holds it whole and its gradient is averaged over the ranks
TEMPERED = """
import torch
from torch import nn

from mypkg.nets import ResMLP


class TemperedResMLP(ResMLP):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.logit_scale = nn.Parameter(torch.zeros(()))

    def reset_parameters(self):
        nn.init.zeros_(self.logit_scale)

    def forward(self, x):
        return super().forward(x) * self.logit_scale.exp()
"""


# cross-entropy over the global batch: every rank's logits and labels all-gathered, as contrastive losses (CLIP's)
# gather their embeddings; every rank must call it as often and with as many rows at the eval too
GATHERED = """
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.nn.functional import all_gather


def cross_entropy(outputs, targets):
    if not dist.is_initialized():
        return F.cross_entropy(outputs, targets)
    return F.cross_entropy(torch.cat(all_gather(outputs)), torch.cat(all_gather(targets)))
"""


# the example's model with dropout after its embedding; with MASK_RECORD set, each rank writes the mask of its first
# training forward to MASK_RECORD/rank<R>.txt
DROPPED = """
import os

import torch
from torch import nn

from mypkg.nets import ResMLP


class DroppedResMLP(ResMLP):
    def __init__(self, p: float = 0.2, **kwargs):
        super().__init__(**kwargs)
        self.drop = nn.Dropout(p)
        self.record = os.environ.get("MASK_RECORD")

    def forward(self, x):
        x = self.drop(self.embed(x))
        if self.training and self.record:
            mask = (x != 0).int().flatten().tolist()
            with open(os.path.join(self.record, f"rank{os.environ['RANK']}.txt"), "w") as f:
                f.write("".join(map(str, mask)))
            self.record = None
        for block in self.blocks:
            x = block(x)
        return self.head(x)
"""


def _launch_dir(tmp_path):
    return own_launch_dir(tmp_path / "launch", tempered=TEMPERED, gathered=GATHERED, dropped=DROPPED)


def test_own_model_on_two_ranks_ddp_and_fsdp_with_blocks_checkpointing_and_meta_init(tmp_path, cli, monkeypatch):
    launch = _launch_dir(tmp_path)
    sweep = tmp_path / "sweep"
    # 113 eval samples in global batches of 2 x 16: the loss, which all-gathers, is called on the 3 whole ones by
    # every rank (the last, nine samples on rank 0 and eight on rank 1, goes to the metrics alone)
    gathered = ["loss._target_=mypkg.gathered.cross_entropy", "trainer.eval_samples=113"]
    r = run(["-m", *BASE, "strategy=ddp,fsdp", "activation_checkpointing=true", "+model.init_device=meta",
             "model._target_=mypkg.tempered.TemperedResMLP", *gathered, "trainer.max_steps=12",
             f"hydra.sweep.dir={sweep}"], nproc=2, cwd=launch, fast=False, timeout=300)
    assert r.returncode == 0, r.output[-4000:]
    ddp, fsdp = (results(sweep / str(i)) for i in (0, 1))
    for res in (ddp, fsdp):
        assert res["steps"] == 12 and res["train_loss"] < res["first_loss"] and res["hparams"]["world_size"] == 2
        assert res["eval_metrics"]["accuracy"] > 0.4
    assert ddp["first_loss"] == pytest.approx(fsdp["first_loss"], abs=1e-6)  # one init, whatever the strategy
    for job in (0, 1):
        log = log_of(sweep / str(job))
        assert "activation checkpointing on 4 ResidualBlock" in log
        assert "initialised by the reset_parameters() of 15 modules" in log
        assert "eval: the loss communicates across ranks (it ran a collective), so eval/loss is over whole global " \
               "batches: 96 of the 113 eval samples (the rest fill no global batch)" in log
    assert "fsdp: sharded 5 modules (4 ResidualBlock by wrap_policy=auto + root)" in log_of(sweep / "1")
    assert "1 0-d parameters replicated (logit_scale)" in log_of(sweep / "1")
    rows = report_rows(sweep)
    assert [row["status"] for row in rows] == ["COMPLETED"] * 2 and all(row["eval/accuracy"] for row in rows)

    from safetensors.torch import load_file

    monkeypatch.syspath_prepend(str(launch))
    forget_mypkg()  # another test's copy, imported in this process, has no tempered.py
    from mypkg.tempered import TemperedResMLP

    forget_mypkg()  # this test's copy: the next test that imports mypkg gets its own

    exported = [load_file(sweep / job / "model.safetensors") for job in ("0", "1")]
    TemperedResMLP().load_state_dict(exported[1], strict=True)  # FSDP's export: the model's own names
    # FSDP trains as DDP does, the replicated temperature included (its gradient averaged over the ranks)
    assert exported[0]["logit_scale"].abs() > 1e-3
    for name, value in exported[0].items():
        torch.testing.assert_close(exported[1][name], value, rtol=1e-4, atol=1e-5, msg=name)
    # the same weights at world size 1 (one process, twice the micro-batch: the same 32 samples at step 1)
    monkeypatch.chdir(launch)
    one = cli([*BASE, "strategy=fsdp", "+model.init_device=meta", "model._target_=mypkg.tempered.TemperedResMLP",
               *gathered, "data.batch_size=32", "trainer.max_steps=1"], tmp_path / "one", fast=False)
    assert one.returncode == 0, one.output[-3000:]
    assert results(tmp_path / "one")["first_loss"] == pytest.approx(fsdp["first_loss"], abs=1e-5)
    assert torch.isfinite(torch.tensor(results(tmp_path / "one")["first_loss"]))


@pytest.mark.slow  # three 2-rank launches
def test_own_model_resumes_bit_identically_after_a_kill(tmp_path):
    """An uninterrupted FSDP run, and the same run SIGKILLed right after its step-10 save and relaunched with the same
    command: the same final weights, bit for bit (the DataLoader's position, the sampler and each rank's RNGs
    restored); the model's dropout draws other masks on each rank; its eval, with a rank that holds no eval sample,
    syncs a metric with list states."""
    launch = _launch_dir(tmp_path)
    # one eval sample: rank 1 has none, and AUROC's list states still sync (it updates them with zero rows)
    args = [*BASE, "strategy=fsdp", "trainer.max_steps=16", "checkpoint.every_n_steps=10", "data.num_workers=1",
            "trainer.eval_samples=1", "+metrics.auroc._target_=torchmetrics.classification.MulticlassAUROC",
            "+metrics.auroc.num_classes=3", "model._target_=mypkg.dropped.DroppedResMLP"]
    masks = tmp_path / "masks"
    masks.mkdir()
    run([*args, f"hydra.run.dir={tmp_path / 'a'}"], nproc=2, cwd=launch, fast=False, timeout=600,
        env={"MASK_RECORD": str(masks)}).ok()
    rank0, rank1 = ((masks / f"rank{r}.txt").read_text() for r in (0, 1))
    assert len(rank0) == len(rank1) == 16 * 64 and "0" in rank0 and rank0 != rank1  # one seed gave equal masks
    kill = {"HT_FAULT": "kill", "HT_FAULT_STEP": "10", "HT_FAULT_AT": "after_step", "HT_FAULT_RANK": "all"}
    killed = run([*args, f"hydra.run.dir={tmp_path / 'b'}"], nproc=2, cwd=launch, fast=False, script=FAULTY,
                 env=kill, timeout=600)
    assert killed.returncode != 0 and (tmp_path / "b" / "checkpoints" / "step_00000010").is_dir()
    run([*args, f"hydra.run.dir={tmp_path / 'b'}"], nproc=2, cwd=launch, fast=False, timeout=600).ok()
    assert "resumed from" in log_of(tmp_path / "b")
    from safetensors.torch import load_file

    a, b = (load_file(tmp_path / d / "model.safetensors") for d in ("a", "b"))
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    assert results(tmp_path / "a")["train_loss"] == results(tmp_path / "b")["train_loss"]
    assert "auroc" in results(tmp_path / "b")["eval_metrics"]


# sequences of 1 to 12 real tokens, padded to 12 with targets -100 (as a supervised fine-tuning collate pads)
PADDED = """
import torch
from torch import nn
from torch.utils.data import TensorDataset


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 16, width: int = 8):
        super().__init__()
        self.embed, self.head = nn.Embedding(vocab, width), nn.Linear(width, vocab)

    def forward(self, x):
        return self.head(self.embed(x))


def padded(n: int = 64, seq_len: int = 12, vocab: int = 16):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, vocab, (2, n, seq_len), generator=g)
    lengths = torch.randint(1, seq_len + 1, (n,), generator=g)
    y[torch.arange(seq_len) >= lengths[:, None]] = -100
    return {"train": TensorDataset(x[:48], y[:48]), "val": TensorDataset(x[48:], y[48:])}


def ignored(train: bool = True, val: bool = False):  # padded(), every target of the chosen splits ignored
    splits = padded()
    for name, dead in (("train", train), ("val", val)):
        if dead:
            x, y = splits[name].tensors
            splits[name] = TensorDataset(x, torch.full_like(y, -100))
    return splits
"""


def _padded_launch(tmp_path):
    """A launch dir with PADDED as mypkg.padded, and my_conf's model=tiny_lm, data=padded and data=ignored."""
    launch = _launch_dir(tmp_path)
    (launch / "mypkg" / "padded.py").write_text(PADDED)
    (launch / "my_conf" / "model" / "tiny_lm.yaml").write_text("_target_: mypkg.padded.TinyLM\n")
    for name in ("padded", "ignored"):
        (launch / "my_conf" / "data" / f"{name}.yaml").write_text(f"_target_: mypkg.padded.{name}\nbatch_size: 4\n")
    return launch

def test_padded_targets_weigh_the_same_whatever_the_accumulation_and_world_size(tmp_path, cli, monkeypatch):
    """The next-token loss is a mean over the targets that are not -100: one step of 4 padded sequences gives the same
    loss, gradient and eval loss as 1 process x batch 4, or as 2 FSDP ranks x 2 micro-batches of 1 (each micro-batch
    weighed by its real tokens, not as one of 4), and the eval loss is the mean over the eval set's real tokens at
    any eval batch size."""
    launch = _padded_launch(tmp_path)
    args = ["--config-dir", "my_conf", "model=tiny_lm", "data=padded", "loss=next_token", "device=cpu",
            "precision=fp32", "logger.peak_flops=1e11", "trainer.progress_bar=false", "trainer.max_steps=3",
            "trainer.eval_every_n_steps=0", "trainer.eval_samples=13", "metrics={}", "trainer.objective=eval/loss"]
    two = run([*args, "strategy=fsdp", "data.batch_size=1", "trainer.grad_accum_steps=2",
               f"hydra.run.dir={tmp_path / 'two'}"], nproc=2, cwd=launch, fast=False, timeout=300).ok()
    monkeypatch.chdir(launch)
    monkeypatch.syspath_prepend(str(launch))
    forget_mypkg()  # another test's copy, imported in this process, has no padded.py
    one = cli([*args, "strategy=single"], tmp_path / "one", fast=False)
    assert one.returncode == 0, one.output[-3000:]
    a, b = results(tmp_path / "one"), results(tmp_path / "two")
    assert b["first_loss"] == pytest.approx(a["first_loss"], rel=1e-6), two.output[-2000:]
    assert b["eval_loss"] == pytest.approx(a["eval_loss"], rel=1e-6)
    from safetensors.torch import load_file

    wa, wb = (load_file(tmp_path / d / "model.safetensors") for d in ("one", "two"))
    for name, value in wa.items():
        torch.testing.assert_close(wb[name], value, rtol=1e-5, atol=1e-6, msg=name)
    forget_mypkg()


def test_steps_and_eval_sets_whose_targets_are_all_ignored(tmp_path, cli, monkeypatch):
    """Every train target ignored: each step has nothing to learn from, so its update is skipped and counted (the
    weights stay as built: AdamW's weight decay does not shrink them), no NaN train/loss is logged,
    ``trainer.on_nonfinite=stop`` does not stop, and fp16's loss scale does not grow on such steps. Every eval
    target ignored: no eval/loss and one warning, not a divergence, and the run's outputs are written."""
    launch = _padded_launch(tmp_path)
    monkeypatch.chdir(launch)
    monkeypatch.syspath_prepend(str(launch))
    forget_mypkg()
    args = ["--config-dir", "my_conf", "model=tiny_lm", "data=ignored", "loss=next_token", "device=cpu",
            "precision=fp32", "logger.peak_flops=1e11", "trainer.progress_bar=false", "trainer.eval_every_n_steps=0",
            "metrics={}", "strategy=single", "trainer.on_nonfinite=stop", "trainer.log_every_n_steps=1",
            "trainer.grad_accum_steps=2"]
    for steps in (1, 3):
        run = cli([*args, f"trainer.max_steps={steps}"], tmp_path / f"s{steps}", fast=False)
        assert run.returncode == 0, run.output[-3000:]
        assert results(tmp_path / f"s{steps}")["skipped_steps"] == steps
    assert "had no target on any rank" in run.output and "loss n/a (every update skipped)" in run.output
    assert "loss nan" not in run.output
    from safetensors.torch import load_file

    built, after = (load_file(tmp_path / d / "model.safetensors") for d in ("s1", "s3"))
    assert all(built[k].equal(after[k]) for k in built)
    fp16 = cli([*args, "precision=fp16", "precision.growth_interval=1", "trainer.max_steps=2"], tmp_path / "h",
               fast=False)
    assert fp16.returncode == 0 and "loss_scale 65536 skipped_steps 2" in fp16.output, fp16.output[-3000:]
    dead_eval = cli([*args, "+data.train=false", "+data.val=true", "trainer.max_steps=1"], tmp_path / "e", fast=False)
    assert dead_eval.returncode == 0, dead_eval.output[-3000:]
    assert "every target of the 16 eval samples is ignored (the loss's ignore_index): no eval/loss" in dead_eval.output
    assert results(tmp_path / "e")["eval_loss"] is None and (tmp_path / "e" / "model.safetensors").is_file()
    forget_mypkg()
