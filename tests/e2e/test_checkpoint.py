"""Checkpoints across processes: bit-identical resume after SIGKILL, resume_from into another strategy and world size
(resharding 2 -> 1 and, slow, 2 -> 4), the old-format checkpoint fixture still loads and continues exactly,
export/init_from, SIGTERM on one rank, compile-independent keys, the fp16 scaler state, logging windows across a kill.

Multi-rank tests launch ``train.py`` under ``torch.distributed.run`` on gloo (CPU, fp32, a tiny GPT). One 20-step
FSDP run on 2 ranks (``run_a``, a job of the session's shared sweep, helpers.SHARED_RUNS["ckpt_a"]) is shared by the
tests that need a checkpoint to start from; the 2-rank runs that start from it are the jobs of one more sweep
(``from_run_a``). Checkpoint files themselves (atomic saves, corrupt shards, safe loading, the data position):
tests/unit/test_checkpoint_io.py.
"""
from __future__ import annotations

import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

from helpers import (
    DEBUG,
    FAULTY,
    FIXTURE_V1,
    SHARED_RUNS,
    Sweep,
    assert_same_tensors,
    ckpt_of,
    diff_checkpoints,
    load_weights,
    log_of,
    run,
    sh,
    start,
    sweep_runs,
    tb_scalars,
)
from hydratrain.checkpoint.io import read_all
from hydratrain.checkpoint.manager import latest_checkpoint, list_checkpoints
from hydratrain.errors import EXIT_PREEMPTED

CKPT = ["strategy=fsdp", "trainer.eval_samples=8"]  # with helpers.FAST: every step logged, no sample
RUN_A = [*DEBUG, *SHARED_RUNS["ckpt_a"]]  # FSDP, fp32, 20 steps, checkpoints at 10 and 20 (run with fast=False)
# every rank SIGKILLs itself right after step 10 and its save (tests/scripts/faulty_train.py)
KILL_AT_10 = {"HT_FAULT": "kill", "HT_FAULT_STEP": "10", "HT_FAULT_AT": "after_step", "HT_FAULT_RANK": "all"}
# what differs between a checkpoint and its re-save on another world size
WORLD_SIZE_KEYS = ["checkpoint.world_size", "data.world_size"]


@pytest.fixture(scope="module")
def run_a(two_rank_run) -> Path:
    """RUN_A (FSDP, 2 ranks, 20 steps, checkpoints at steps 10 and 20, final weights in model.safetensors), run as a
    job of the session's shared sweep."""
    return two_rank_run("ckpt_a")


@pytest.fixture(scope="module")
def from_run_a(run_a, tmp_path_factory, cache_dir) -> Sweep:
    """Two 2-rank runs that start from run A, as the jobs of one sweep inside 2 torchrun ranks: ``resume_ddp2``
    (resume_from its step 10 under DDP, re-saving step 10) and ``init_from`` (FSDP from its final weights, exported
    in this process by ``python -m hydratrain.export``'s main to ``<base>/w.safetensors``)."""
    from hydratrain.export import main as export_main

    base = tmp_path_factory.mktemp("from_run_a")
    weights = base / "w.safetensors"
    assert export_main([str(ckpt_of(run_a, 20)), str(weights)]) == 0
    fp32 = ["precision=fp32", "trainer.eval_samples=8"]
    runs = {"resume_ddp2": ["strategy=ddp", *fp32, f"checkpoint.resume_from={ckpt_of(run_a, 10)}",
                            "trainer.max_steps=10", "checkpoint.save_last=true"],
            "init_from": ["strategy=fsdp", *fp32, f"model.init_from={weights}", "trainer.max_steps=1",
                          "trainer.eval_every_n_steps=0", "checkpoint.save_last=false"]}
    return sweep_runs(runs, base, sweep_dir=base / "sweep", env={"HYDRATRAIN_CACHE": str(cache_dir)})


# ------------------------------------------------------------------------------------------ exact resume
@pytest.mark.slow  # 11 s: the default suite keeps the SIGTERM resume test (test_sigterm_on_one_rank_...)
def test_exact_resume_after_sigkill(run_a, tmp_path):
    """Run B is SIGKILLed right after its step-10 save, relaunched with the same command, and matches run A
    bit for bit: every logged loss (steps 1-20) and the final weights."""
    run_b = tmp_path / "b"
    killed = run(RUN_A, run_b, nproc=2, script=FAULTY, env=KILL_AT_10, fast=False)
    assert killed.returncode != 0 and "SIGKILL" in killed.output
    assert [p.name for _, p in list_checkpoints(run_b / "checkpoints")] == ["step_00000010"]
    assert not (run_b / "model.safetensors").exists()
    run(RUN_A, run_b, nproc=2, fast=False).ok()
    assert f"resumed from {ckpt_of(run_b, 10)}: step 10" in log_of(run_b)
    losses_a, losses_b = tb_scalars(run_a), tb_scalars(run_b)
    assert sorted(losses_a) == list(range(1, 21)) and sorted(losses_b) == list(range(1, 21))
    assert [losses_b[s] for s in range(11, 21)] == [losses_a[s] for s in range(11, 21)]
    assert_same_tensors(load_weights(run_a / "model.safetensors"), load_weights(run_b / "model.safetensors"),
                        "final weights of A and of the killed-and-resumed B")
    assert diff_checkpoints(ckpt_of(run_a, 20), ckpt_of(run_b, 20)) == []


@pytest.mark.slow  # 2 launches of 2 ranks (21 s on a loaded 2-core machine)
def test_a_kill_during_a_background_write_resumes_from_the_previous_checkpoint_exactly(run_a, tmp_path):
    """Run A with checkpoint.async_save=true and saves every 5 steps: every rank SIGKILLs itself inside the background
    write of step 15 (its shards written, DCP's .metadata not yet). The half-written save is no checkpoint: the
    relaunch resumes from step 10 and matches the synchronous run A bit for bit (losses, final weights, and the
    step-20 checkpoint, written in the background too)."""
    run_b = tmp_path / "b"
    args = [*RUN_A, "checkpoint.async_save=true", "checkpoint.every_n_steps=5"]
    kill = {**KILL_AT_10, "HT_FAULT_STEP": "15", "HT_FAULT_AT": "async_write"}
    killed = run(args, run_b, nproc=2, script=FAULTY, env=kill, fast=False)
    assert killed.returncode != 0 and "SIGKILL" in killed.output
    assert list(run_b.glob("fault_rank*_step15"))  # (the first rank killed, torchrun may end the other first)
    assert [p.name for _, p in list_checkpoints(run_b / "checkpoints")] == ["step_00000005", "step_00000010"]
    assert not (run_b / "checkpoints" / ".tmp-step_00000015" / ".metadata").exists()
    run(args, run_b, nproc=2, fast=False).ok()
    assert f"resumed from {ckpt_of(run_b, 10)}: step 10" in log_of(run_b)
    losses_a, losses_b = tb_scalars(run_a), tb_scalars(run_b)
    assert [losses_b[s] for s in range(11, 21)] == [losses_a[s] for s in range(11, 21)]
    assert_same_tensors(load_weights(run_a / "model.safetensors"), load_weights(run_b / "model.safetensors"),
                        "final weights of A and of the killed-and-resumed async B")
    assert diff_checkpoints(ckpt_of(run_a, 20), ckpt_of(run_b, 20)) == []


def test_the_old_format_checkpoint_still_loads_and_continues_exactly(two_rank_run):
    """tests/fixtures/ckpt_v1_fsdp2_step3 (2 ranks, FSDP, fp32, step 3, written by the first checkpoint format):
    resumed on 2 ranks (helpers.SHARED_RUNS["ckpt_v1"]) it trains steps 4 and 5 to the losses measured when it was
    written (step 4 bit for bit)."""
    run_dir = two_rank_run("ckpt_v1")
    assert f"resumed from {FIXTURE_V1}" in log_of(run_dir)
    losses = tb_scalars(run_dir)
    assert sorted(losses) == [4, 5]
    assert losses[4] == 5.531301498413086
    assert losses[5] == pytest.approx(5.528346538543701, abs=1e-6)


# ----------------------------------------------------------------------------- resume_from and resharding
@pytest.mark.slow  # 2 runs; the window's folding at a save is also exercised by every default resume test
def test_a_logging_window_cut_by_a_save_continues_exactly_on_another_world_size(tmp_path, cli):
    """A checkpoint saved mid-window (step 15 of a 10-step logging window), resumed on 2 ranks: the log line of
    step 20 averages steps 11-20 as the uninterrupted 1-rank run does. The window's sums were per rank: rank 1
    started empty (steps 16-20 only) and both weighed 1/2, so the line read 4.9477 against 5.0251."""
    window = ["trainer.max_steps=20", "trainer.log_every_n_steps=10", "trainer.eval_every_n_steps=0",
              "checkpoint.every_n_steps=15"]
    r = cli(["strategy=single", "data.batch_size=8", *window], tmp_path / "one")
    assert r.returncode == 0, r.output[-3000:]
    run(["strategy=ddp", *window, f"checkpoint.resume_from={ckpt_of(tmp_path / 'one', 15)}"], tmp_path / "two",
        nproc=2).ok()
    one, two = tb_scalars(tmp_path / "one"), tb_scalars(tmp_path / "two")
    assert sorted(two) == [20] and two[20] == pytest.approx(one[20], abs=2e-5), (one, two)


def test_resume_fsdp2_into_fsdp1_with_activation_checkpointing(run_a, tmp_path, cli):
    """2 -> 1 rank, AC off -> on: everything loads exactly (checked by re-saving step 10 in the new run dir). One
    rank needs no process of its own: this runs in the test's process."""
    src = ckpt_of(run_a, 10)
    r = cli([*CKPT, f"checkpoint.resume_from={src}", "trainer.max_steps=10", "checkpoint.save_last=true",
             "activation_checkpointing=true"], tmp_path / "r")
    assert r.returncode == 0, r.output[-3000:]
    log = log_of(tmp_path / "r")
    assert "activation checkpointing on 2 Block" in log and f"resumed from {src}" in log
    assert "data position remapped: 2 ranks x batch 4 -> 1 ranks x batch 4" in log
    # Same keys (AC adds no prefix) and values; only rank 1's RNG and the world size differ.
    assert diff_checkpoints(src, ckpt_of(tmp_path / "r", 10), skip=["rank1."]) == WORLD_SIZE_KEYS


def test_resume_fsdp2_into_ddp2(run_a, from_run_a):
    """fsdp -> ddp on 2 ranks: model, optimizer, scheduler, counters, RNG and data position load exactly."""
    src, run_dir = ckpt_of(run_a, 10), from_run_a.job("resume_ddp2")
    assert f"resumed from {src}" in log_of(run_dir)
    assert diff_checkpoints(src, ckpt_of(run_dir, 10)) == []


@pytest.mark.slow
def test_resume_fsdp2_into_fsdp4(run_a, tmp_path):
    src = ckpt_of(run_a, 10)
    run([*CKPT, f"checkpoint.resume_from={src}", "trainer.max_steps=10", "checkpoint.save_last=true"], tmp_path / "r",
        nproc=4).ok()
    assert "data position remapped: 2 ranks x batch 4 -> 4 ranks x batch 4" in log_of(tmp_path / "r")
    assert diff_checkpoints(src, ckpt_of(tmp_path / "r", 10), skip=["rank2.", "rank3."]) == WORLD_SIZE_KEYS
    # (training on from a resharded FSDP state: test_hsdp.py, fsdp <-> hsdp; test_lora_runs.py, 2 ranks -> 1)


@pytest.mark.slow
def test_compile_does_not_change_keys(run_a, tmp_path):
    src = ckpt_of(run_a, 10)
    run([*CKPT, f"checkpoint.resume_from={src}", "trainer.max_steps=10", "checkpoint.save_last=true",
         "trainer.compile=true"], tmp_path / "r", timeout=600).ok()
    assert diff_checkpoints(src, ckpt_of(tmp_path / "r", 10), skip=["rank1."]) == WORLD_SIZE_KEYS


# -------------------------------------------------------------------------------------- export / init_from
def test_export_and_init_from_on_fsdp(run_a, from_run_a):
    """``python -m hydratrain.export``'s main (called in this process: the export is one process by design) wrote
    the final weights (from_run_a); a 2-rank FSDP run started from them."""
    out, run_dir = from_run_a.dir.parent / "w.safetensors", from_run_a.job("init_from")
    assert_same_tensors(load_weights(out), load_weights(run_a / "model.safetensors"), "export vs final weights")
    for rank in (0, 1):
        assert "every rank's shard checked against the file" in log_of(run_dir, rank)
    first = tb_scalars(run_dir)[1]
    assert first < tb_scalars(run_a)[1] - 0.5  # starts from trained weights, not from scratch


@pytest.mark.slow
@pytest.mark.parametrize("nproc,strategy", [(1, "single"), (2, "ddp")])
def test_init_from_other_strategies(run_a, tmp_path, nproc, strategy):
    out = tmp_path / "w.safetensors"
    sh([sys.executable, "-m", "hydratrain.export", str(run_a), str(out)]).ok()
    run([*CKPT, f"strategy={strategy}", f"model.init_from={out}", "trainer.max_steps=1", "checkpoint.save_last=false"],
        tmp_path / "ft", nproc=nproc).ok()
    assert "checked against the file" in log_of(tmp_path / "ft")


# -------------------------------------------------------------------------------------------------- SIGTERM
def _children(pid: int) -> dict[int, int]:
    """{RANK: pid} of the worker processes torchrun ``pid`` started."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                env = dict(x.split("=", 1) for x in (d / "environ").read_text().split("\0") if "=" in x)
                out[int(env["RANK"])] = int(d.name)
        except (OSError, ValueError, KeyError, IndexError):
            continue
    return out


@pytest.mark.slow  # a sibling of it runs by default; CI runs this too (default suite near 4 minutes)
def test_sigterm_on_one_rank_saves_exits_75_and_resumes(tmp_path):
    """SIGTERM to rank 1 only: both ranks finish the step, agree, save, exit 75; the relaunch auto-resumes."""
    run_dir = tmp_path / "t"
    args = [*CKPT, "trainer.max_steps=400", "checkpoint.every_n_steps=0", "scheduler=constant",
            "trainer.eval_every_n_steps=0"]
    proc = start(args, run_dir, nproc=2)
    try:
        log = run_dir / "train_rank0.log"
        deadline = time.time() + 240
        while not (log.exists() and "step 3/400" in log.read_text()):
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            assert time.time() < deadline, "the run did not reach step 3"
            time.sleep(0.2)
        os.kill(_children(proc.pid)[1], signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", out)
    assert codes and all(int(c) == EXIT_PREEMPTED for c in codes), out[-3000:]
    saved = latest_checkpoint(run_dir / "checkpoints")
    assert saved is not None
    step = int(saved.name.split("_")[1])
    assert 3 <= step < 400
    for rank in (0, 1):
        assert f"stopping at step {step} after a preemption signal" in log_of(run_dir, rank)
    run([*args, f"trainer.max_steps={step + 2}"], run_dir, nproc=2).ok()
    log = log_of(run_dir)
    assert f"resumed from {saved}: step {step}" in log and f"step {step + 2}/{step + 2}" in log


# ------------------------------------------------------------------------------------------------------ slow
@pytest.mark.slow
def test_exact_resume_keeps_logging_windows(tmp_path):
    """Checkpoint at step 10 inside a 3-step logging window (logged at 9, 12, ...): the resumed run logs the same
    window means (its step-12 value includes step 10's loss from before the kill)."""
    cmd = [*CKPT, "trainer.max_steps=14", "checkpoint.every_n_steps=10", "trainer.log_every_n_steps=3", "strategy=ddp"]
    run(cmd, tmp_path / "a", nproc=2).ok()
    run(cmd, tmp_path / "b", nproc=2, script=FAULTY, env=KILL_AT_10)
    run(cmd, tmp_path / "b", nproc=2).ok()
    a, b = tb_scalars(tmp_path / "a"), tb_scalars(tmp_path / "b")
    assert sorted(a) == [1, 3, 6, 9, 12, 14] and a == b


@pytest.mark.slow
def test_fp16_grad_scaler_state_round_trips(tmp_path):
    run([*CKPT, "precision=fp16", "trainer.max_steps=3", "checkpoint.save_last=true"], tmp_path / "a").ok()
    src = ckpt_of(tmp_path / "a", 3)
    assert read_all(src)["scaler.scale"] > 0
    run([*CKPT, "precision=fp16", "trainer.max_steps=3", "checkpoint.save_last=true", f"checkpoint.resume_from={src}"],
        tmp_path / "b").ok()
    assert diff_checkpoints(src, ckpt_of(tmp_path / "b", 3)) == []


def _buffers_after_sync(rank: int, store_path: str, out: str) -> None:
    """One rank of the DDP buffer check: a BatchNorm updated with this rank's own batch, then the strategy's sync."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from hydratrain.dist.process_group import let_workers_finish
    from hydratrain.parallel.strategy import Strategy

    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    model = DistributedDataParallel(nn.BatchNorm1d(3))
    model(torch.full((4, 3), float(rank)) + torch.arange(4.0)[:, None])  # each rank's running stats its own
    Strategy.sync_buffers(None, model)
    torch.save({k: v.clone() for k, v in model.module.state_dict().items()}, f"{out}.{rank}")
    let_workers_finish()  # (gloo's worker may still be freeing the last collective's work)
    dist.destroy_process_group()


def _fsdp_buffers_before_forwards(rank: int, store_path: str, out: str) -> None:
    """One rank of the FSDP buffer check: two training forwards of a sharded BatchNorm model on this rank's own
    batches, recording the running mean each forward starts from."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hydratrain.dist.process_group import let_workers_finish
    from hydratrain.parallel.strategy import rank0_buffers_before_training_forwards

    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
    rank0_buffers_before_training_forwards(model)
    starts = []
    model[1].register_forward_pre_hook(lambda m, args: starts.append(m.running_mean.clone()))
    for _ in range(2):
        model(torch.full((4, 3), float(rank)) + torch.arange(4.0)[:, None]).sum().backward()
    torch.save({"starts": starts, "end": model[1].running_mean.clone()}, f"{out}.{rank}")
    let_workers_finish()  # (gloo's worker may still be freeing the last collective's work)
    dist.destroy_process_group()


def test_fsdp_buffers_start_each_training_forward_as_rank_0s(tmp_path):
    """FSDP left each rank its own running statistics, and a save or an eval made them rank 0's, so saving changed
    the training (1.6e-3 in the final weights of a 12-step run). As DDP does, each training forward now starts from
    rank 0's buffers; a save changes nothing."""
    import torch
    import torch.multiprocessing as mp

    mp.start_processes(_fsdp_buffers_before_forwards, args=(str(tmp_path / "store"), str(tmp_path / "bn")), nprocs=2,
                       start_method="spawn")
    rank0, rank1 = (torch.load(tmp_path / f"bn.{r}") for r in (0, 1))
    assert not rank0["end"].equal(rank1["end"])  # each forward updates the rank's copy with its own batch
    assert rank1["starts"][1].equal(rank0["starts"][1])  # the second forward starts from rank 0's


def test_ddp_buffers_are_rank_0s_before_a_save_or_an_eval(tmp_path):
    """DDP sends rank 0's buffers before each training forward, which each rank then updates with its own batch: a
    save (DCP writes a replicated tensor from any one rank) or an eval after it must first make them rank 0's on every
    rank, or a resume of a BatchNorm model continues from another rank's statistics."""
    import torch
    import torch.multiprocessing as mp

    mp.start_processes(_buffers_after_sync, args=(str(tmp_path / "store"), str(tmp_path / "bn")), nprocs=2,
                       start_method="spawn")
    rank0, rank1 = (torch.load(tmp_path / f"bn.{r}") for r in (0, 1))
    assert rank0["running_mean"].abs().sum() > 0
    assert all(rank0[k].equal(rank1[k]) for k in rank0), {k: (rank0[k], rank1[k]) for k in rank0}
