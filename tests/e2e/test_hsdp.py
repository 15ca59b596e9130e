"""strategy=hsdp on 4 gloo ranks (2 replicas x 2-way shards): the same weights and fp32 loss trajectory as ddp and
fsdp, checkpoints that move between fsdp and hsdp with bit-identical next losses, and a one-line error for a
shard_size that does not divide the world size."""
from __future__ import annotations

import json
import re

import pytest

from helpers import ROOT, Sweep, ckpt_of, log_of, run, sweep_runs, tb_scalars

PROBE = str(ROOT / "tests" / "scripts" / "probe_model.py")
# 8 steps, loss logged every step, no eval: the trajectory is the train/loss curve
COMMON = ["trainer.max_steps=8", "trainer.eval_every_n_steps=0", "optim.lr=1e-2", "scheduler.warmup_steps=2",
          "data.batch_size=2"]
HSDP = ["strategy=hsdp", "strategy.shard_size=2"]
CKPT = ["checkpoint.every_n_steps=3", "checkpoint.keep_last=0"]


def _losses(run_dir) -> list[float]:
    return [v for _, v in sorted(tb_scalars(run_dir).items())]


@pytest.fixture(scope="module")
def four_rank_runs(tmp_path_factory, cache_dir) -> Sweep:
    """The 4-rank runs that start from nothing, as the jobs of one sweep: the same 8 steps under hsdp, ddp and fsdp,
    and a 4-step fsdp run with a checkpoint at step 3 (``fsdp_ckpt``)."""
    fp32 = [*COMMON, "precision=fp32"]  # as helpers.FAST gives a run
    runs = {"hsdp": [*fp32, *HSDP], "ddp": [*fp32, "strategy=ddp"], "fsdp": [*fp32, "strategy=fsdp"],
            "fsdp_ckpt": [*fp32, "strategy=fsdp", "trainer.max_steps=4", *CKPT]}
    return sweep_runs(runs, tmp_path_factory.mktemp("hsdp"), nproc=4, env={"HYDRATRAIN_CACHE": str(cache_dir)})


@pytest.mark.slow
def test_hsdp_trains_the_same_fp32_trajectory_as_ddp_and_fsdp(four_rank_runs):
    names = ("hsdp", "ddp", "fsdp")
    losses = {name: _losses(four_rank_runs.job(name)) for name in names}
    ref = losses["hsdp"]
    assert len(ref) == 8 and ref[-1] < ref[0] - 0.3, ref
    for name in ("ddp", "fsdp"):
        assert losses[name] == pytest.approx(ref, rel=1e-4, abs=1e-4), (name, losses[name], ref)
    log0 = log_of(four_rank_runs.job("hsdp"))
    assert "hsdp: sharded 3 modules" in log0 and "on a 2 x 2 mesh" in log0, log0[-2000:]
    # each rank holds half of every parameter (2-way shards), i.e. twice what 4-way fsdp holds
    held = {name: float(log_of(four_rank_runs.job(name)).split("this rank holds ")[1].split(" MB")[0])
            for name in names}
    assert held["hsdp"] == pytest.approx(2 * held["fsdp"], rel=0.05) and held["ddp"] == pytest.approx(
        2 * held["hsdp"], rel=0.05), held


@pytest.mark.slow
def test_hsdp_builds_the_same_weights_as_a_single_process():
    """A meta-device build sharded over the 2 x 2 mesh holds exactly the eager single-process weights (ties kept,
    no shard a copy of another)."""
    def probe(nproc, *overrides):
        r = run(list(overrides), nproc=nproc, script=PROBE, fast=False, timeout=240).ok()
        return json.loads(r.output.strip().splitlines()[-1])

    common = ["trainer.eval_samples=24", "model.tie_embeddings=true"]
    ref = probe(1, "strategy=single", "model.init_device=cpu", "data.batch_size=8", *common)
    got = probe(4, *HSDP, "model.init_device=meta", "data.batch_size=2", *common)
    assert got["world_size"] == 4 and got["tied"] and got["repeated_blocks"] == []
    assert got["sha"] == ref["sha"]
    assert got["eval_loss"] == pytest.approx(ref["eval_loss"], abs=1e-5)


@pytest.mark.slow
def test_checkpoints_move_between_fsdp_and_hsdp_with_bit_identical_next_losses(four_rank_runs, tmp_path):
    """fsdp saves at step 3, hsdp resumes from it; hsdp saves at step 6, fsdp resumes from that. The first loss
    after each resume is bit-identical to the saving run's loss at that step (the restored weights, data position
    and RNG are exact; later steps may differ in the last bits: a 2 x 2 reduction sums in another order than a
    4-way one)."""
    fsdp, hsdp, back = four_rank_runs.job("fsdp_ckpt"), tmp_path / "hsdp", tmp_path / "back"
    run([*COMMON, *HSDP, "trainer.max_steps=7", *CKPT, f"checkpoint.resume_from={ckpt_of(fsdp, 3)}"], hsdp,
        nproc=4).ok()
    run([*COMMON, "strategy=fsdp", "trainer.max_steps=7", f"checkpoint.resume_from={ckpt_of(hsdp, 6)}"], back,
        nproc=4).ok()
    a, b, c = tb_scalars(fsdp), tb_scalars(hsdp), tb_scalars(back)
    assert sorted(b) == [4, 5, 6, 7] and sorted(c) == [7], (b, c)
    assert b[4] == a[4]  # fsdp -> hsdp: bit-identical
    assert c[7] == b[7]  # hsdp -> fsdp: bit-identical
    assert "resum" in log_of(hsdp).lower() and "2 x 2 mesh" in log_of(hsdp)


@pytest.mark.slow  # 4 ranks, like the other hsdp tests
def test_shard_size_that_does_not_divide_the_world_size_is_a_config_error(tmp_path):
    r = run(["strategy=hsdp", "strategy.shard_size=3"], tmp_path, nproc=2)
    assert r.returncode != 0
    lines = [x for x in r.output.splitlines() if x.startswith("hydratrain: config error:")]
    assert lines == ["hydratrain: config error: strategy.shard_size=3: must divide the world size 2; allowed: 1, 2"], \
        r.output[-3000:]
    assert "process group:" not in r.output
    # each rank finds the error and writes its line to its error file: the agent's root cause is that line, from the
    # rank whose file came first (status 2, or -15 when the agent stopped it after its peer's exit)
    root = r.output.split("Root Cause", 1)[-1]
    assert re.search(r"rank\s*: [01] \(local_rank: [01]\)\s*\n\s*exitcode\s*: (2|-15) ", root), r.output[-3000:]
    assert "traceback : hydratrain: config error: strategy.shard_size=3" in root, r.output[-3000:]
