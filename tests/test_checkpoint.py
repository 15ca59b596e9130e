"""Checkpoints: exact resume after SIGKILL, auto-resume, resume_from, resharding, export/init_from, SIGTERM,
corrupt checkpoints, weights_only loading, AC/compile-independent keys, and the data position across world sizes.

Multi-rank tests launch ``train.py`` under ``torch.distributed.run`` on gloo (CPU, fp32, a tiny GPT). One 20-step
FSDP run on 2 ranks (``run_a``) is shared by the tests that need a checkpoint to start from.
"""
from __future__ import annotations

import io
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from _ckpt_utils import FAULTY, REPO, assert_same_tensors, launch, load_weights, tb_scalars
from hydratrain.checkpoint.io import SafeLoadPlanner, read_all, read_metadata, verify
from hydratrain.checkpoint.manager import find_resume, latest_checkpoint, list_checkpoints, resolve_checkpoint
from hydratrain.errors import EXIT_CHECKPOINT, EXIT_PREEMPTED, CheckpointError
from hydratrain.data import ShardedBatches, TokenDataset

RUN_A = ["trainer.max_steps=20", "checkpoint.every_n_steps=10", "trainer.save_weights=true"]
# every rank SIGKILLs itself right after step 10 and its save (tests/scripts/faulty_train.py)
KILL_AT_10 = {"HT_FAULT": "kill", "HT_FAULT_STEP": "10", "HT_FAULT_AT": "after_step", "HT_FAULT_RANK": "all"}
# what differs between a checkpoint and its re-save on another world size
WORLD_SIZE_KEYS = ["checkpoint.world_size", "data.world_size"]


@pytest.fixture(scope="module")
def run_a(tmp_path_factory) -> Path:
    """FSDP, 2 ranks, 20 steps, checkpoints at steps 10 and 20, final weights in model.safetensors."""
    run_dir = tmp_path_factory.mktemp("ckpt") / "a"
    launch(2, run_dir, *RUN_A)
    return run_dir


def ckpt_of(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:08d}"


def diff_checkpoints(a: Path, b: Path, skip=()) -> list[str]:
    """Flat keys whose values differ between checkpoints ``a`` and ``b`` (or exist in one only)."""
    x, y = read_all(a), read_all(b)
    keys = {k for k in set(x) | set(y) if not k.startswith(tuple(skip))}
    out = []
    for k in sorted(keys):
        if k not in x or k not in y:
            out.append(f"only in one: {k}")
        elif isinstance(x[k], torch.Tensor):
            if not (isinstance(y[k], torch.Tensor) and x[k].dtype == y[k].dtype and torch.equal(x[k], y[k])):
                out.append(k)
        elif x[k] != y[k]:
            out.append(k)
    return out


# ------------------------------------------------------------------------------------------ exact resume
def test_exact_resume_after_sigkill(run_a, tmp_path):
    """Run B is SIGKILLed right after its step-10 save, relaunched with the same command, and matches run A
    bit for bit: every logged loss (steps 1-20) and the final weights."""
    run_b = tmp_path / "b"
    killed = launch(2, run_b, *RUN_A, check=False, script=FAULTY, env=KILL_AT_10)
    assert killed.returncode != 0 and "SIGKILL" in killed.stderr
    assert [p.name for _, p in list_checkpoints(run_b / "checkpoints")] == ["step_00000010"]
    assert not (run_b / "model.safetensors").exists()
    launch(2, run_b, *RUN_A)
    log = (run_b / "train_rank0.log").read_text()
    assert f"resumed from {ckpt_of(run_b, 10)}: step 10" in log
    losses_a, losses_b = tb_scalars(run_a), tb_scalars(run_b)
    assert sorted(losses_a) == list(range(1, 21)) and sorted(losses_b) == list(range(1, 21))
    assert [losses_b[s] for s in range(11, 21)] == [losses_a[s] for s in range(11, 21)]
    assert_same_tensors(load_weights(run_a / "model.safetensors"), load_weights(run_b / "model.safetensors"),
                        "final weights of A and of the killed-and-resumed B")
    assert diff_checkpoints(ckpt_of(run_a, 20), ckpt_of(run_b, 20)) == []


# ----------------------------------------------------------------------------- resume_from and resharding
def test_resume_fsdp2_into_fsdp1_with_activation_checkpointing(run_a, tmp_path):
    """2 -> 1 rank, AC off -> on: everything loads exactly (checked by re-saving step 10 in the new run dir)."""
    src = ckpt_of(run_a, 10)
    launch(1, tmp_path / "r", f"checkpoint.resume_from={src}", "trainer.max_steps=10", "checkpoint.save_last=true",
           "activation_checkpointing=true")
    log = (tmp_path / "r" / "train_rank0.log").read_text()
    assert "activation checkpointing on 2 blocks" in log and f"resumed from {src}" in log
    assert "data position remapped: 2 ranks x batch 4 -> 1 ranks x batch 4" in log
    # Same keys (AC adds no prefix) and values; only rank 1's RNG and the world size differ.
    assert diff_checkpoints(src, ckpt_of(tmp_path / "r", 10), skip=["rank1."]) == WORLD_SIZE_KEYS


def test_resume_fsdp2_into_ddp2(run_a, tmp_path):
    """fsdp -> ddp on 2 ranks: model, optimizer, scheduler, counters, RNG and data position load exactly."""
    src = ckpt_of(run_a, 10)
    launch(2, tmp_path / "r", f"checkpoint.resume_from={src}", "trainer.max_steps=10", "checkpoint.save_last=true",
           "strategy=ddp")
    assert f"resumed from {src}" in (tmp_path / "r" / "train_rank0.log").read_text()
    assert diff_checkpoints(src, ckpt_of(tmp_path / "r", 10)) == []


@pytest.mark.slow
def test_resume_fsdp2_into_fsdp4(run_a, tmp_path):
    src = ckpt_of(run_a, 10)
    launch(4, tmp_path / "r", f"checkpoint.resume_from={src}", "trainer.max_steps=10", "checkpoint.save_last=true")
    log = (tmp_path / "r" / "train_rank0.log").read_text()
    assert "data position remapped: 2 ranks x batch 4 -> 4 ranks x batch 4" in log
    assert diff_checkpoints(src, ckpt_of(tmp_path / "r", 10), skip=["rank2.", "rank3."]) == WORLD_SIZE_KEYS
    # auto-resumes from its own step 10 and trains on
    launch(4, tmp_path / "r", "trainer.max_steps=12", "checkpoint.save_last=true")
    assert "step 12/12" in (tmp_path / "r" / "train_rank0.log").read_text()


@pytest.mark.slow
def test_compile_does_not_change_keys(run_a, tmp_path):
    src = ckpt_of(run_a, 10)
    launch(1, tmp_path / "r", f"checkpoint.resume_from={src}", "trainer.max_steps=10", "checkpoint.save_last=true",
           "trainer.compile=true", timeout=600)
    assert diff_checkpoints(src, ckpt_of(tmp_path / "r", 10), skip=["rank1."]) == WORLD_SIZE_KEYS


# -------------------------------------------------------------------------------------- export / init_from
def test_export_and_init_from_on_fsdp(run_a, tmp_path):
    out = tmp_path / "w.safetensors"
    proc = subprocess.run([sys.executable, "-m", "hydratrain.export", str(ckpt_of(run_a, 20)), str(out)],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert_same_tensors(load_weights(out), load_weights(run_a / "model.safetensors"), "export vs final weights")
    launch(2, tmp_path / "ft", f"model.init_from={out}", "trainer.max_steps=1", "trainer.eval_every_n_steps=0",
           "checkpoint.save_last=false")
    for rank in (0, 1):
        log = (tmp_path / "ft" / f"train_rank{rank}.log").read_text()
        assert "every rank's shard checked against the file" in log
    first = tb_scalars(tmp_path / "ft")[1]
    assert first < tb_scalars(run_a)[1] - 0.5  # starts from trained weights, not from scratch


@pytest.mark.slow
@pytest.mark.parametrize("nproc,strategy", [(1, "single"), (2, "ddp")])
def test_init_from_other_strategies(run_a, tmp_path, nproc, strategy):
    out = tmp_path / "w.safetensors"
    subprocess.run([sys.executable, "-m", "hydratrain.export", str(run_a), str(out)], check=True, cwd=REPO)
    launch(nproc, tmp_path / "ft", f"strategy={strategy}", f"model.init_from={out}", "trainer.max_steps=1",
           "checkpoint.save_last=false")
    assert "checked against the file" in (tmp_path / "ft" / "train_rank0.log").read_text()


def test_init_from_wrong_shapes_is_refused(tmp_path):
    from safetensors.torch import save_file

    from hydratrain.checkpoint.io import init_from_file
    from hydratrain.models.gpt import GPT, GPTConfig

    bad = tmp_path / "bad.safetensors"
    save_file({k: v.clone() for k, v in GPT(GPTConfig(d_model=32, n_layer=2, n_head=2)).state_dict().items()}, str(bad))
    model = GPT(GPTConfig(d_model=64, n_layer=2, n_head=2))
    with pytest.raises(CheckpointError, match=r"model.init_from=.*bad.safetensors: tok_emb.weight has shape"):
        init_from_file(model, bad)


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


def test_sigterm_on_one_rank_saves_exits_75_and_resumes(tmp_path):
    """SIGTERM to rank 1 only: both ranks finish the step, agree, save, exit 75; the relaunch auto-resumes."""
    run = tmp_path / "t"
    args = ["trainer.max_steps=400", "checkpoint.every_n_steps=0", "scheduler=constant", "trainer.eval_every_n_steps=0"]
    proc = launch(2, run, *args, background=True)
    try:
        log = run / "train_rank0.log"
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
    saved = latest_checkpoint(run / "checkpoints")
    assert saved is not None
    step = int(saved.name.split("_")[1])
    assert 3 <= step < 400
    for rank in (0, 1):
        assert f"stopping at step {step} after a preemption signal" in (run / f"train_rank{rank}.log").read_text()
    launch(2, run, *args[1:], f"trainer.max_steps={step + 2}")
    log = (run / "train_rank0.log").read_text()
    assert f"resumed from {saved}: step {step}" in log and f"step {step + 2}/{step + 2}" in log


# ------------------------------------------------------------------------------------ incomplete / corrupt
def test_incomplete_checkpoint_is_never_picked(run_a, tmp_path):
    root = tmp_path / "run" / "checkpoints"
    shutil.copytree(ckpt_of(run_a, 10), root / "step_00000010")
    shutil.copytree(ckpt_of(run_a, 20), root / "step_00000020")
    (root / "step_00000020" / ".metadata").unlink()  # as if the metadata never got written
    shutil.copytree(ckpt_of(run_a, 20), root / ".tmp-step_00000030")  # a save killed before its rename
    assert latest_checkpoint(root) == root / "step_00000010"
    with pytest.raises(CheckpointError, match=r"step_00000020/.metadata: missing"):
        resolve_checkpoint(root / "step_00000020")


def test_truncated_shard_stops_the_run_with_one_line(run_a, tmp_path):
    run = tmp_path / "run"
    ckpt = run / "checkpoints" / "step_00000010"
    shutil.copytree(ckpt_of(run_a, 10), ckpt)
    shard = ckpt / "__1_0.distcp"
    with open(shard, "r+b") as fh:
        fh.truncate(shard.stat().st_size // 2)
    with pytest.raises(CheckpointError, match=re.escape(str(shard)) + ": truncated"):
        verify(ckpt)
    proc = launch(1, run, "trainer.max_steps=20", check=False)  # auto-resume finds it: refused before any step
    assert proc.returncode == EXIT_CHECKPOINT
    errors = [line for line in proc.stderr.splitlines() if "checkpoint error" in line]
    assert len(errors) == 1 and errors[0].startswith(f"hydratrain: checkpoint error: {shard}: truncated")
    assert "step 1/" not in proc.stdout + proc.stderr


def test_corrupt_bytes_are_named(run_a, tmp_path):
    ckpt = tmp_path / "step_00000010"
    shutil.copytree(ckpt_of(run_a, 10), ckpt)
    shard = ckpt / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[: len(data) // 2] = bytes(len(data) // 2)
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=re.escape(str(shard)) + r": bytes \d+\.\.\d+ \(.*\) are corrupt"):
        read_all(ckpt)


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_metadata_is_read_without_running_code(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ckpt = tmp_path / "step_00000001"
    ckpt.mkdir()
    (ckpt / ".metadata").write_bytes(pickle.dumps(_Evil()))
    with pytest.raises(CheckpointError, match=r"\.metadata: unreadable checkpoint metadata .*posix.system"):
        read_metadata(ckpt)
    (ckpt / ".metadata").write_bytes(pickle.dumps({"a": 1})[:5])
    with pytest.raises(CheckpointError, match=r"\.metadata: unreadable"):
        read_metadata(ckpt)
    assert not (tmp_path / "PWNED").exists()


def test_stored_values_load_weights_only(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    buf = io.BytesIO()
    torch.save(_Evil(), buf)
    buf.seek(0)
    with pytest.raises(pickle.UnpicklingError):
        SafeLoadPlanner().load_bytes(None, buf)
    assert not (tmp_path / "PWNED").exists()


# ------------------------------------------------------------------------------------------- data position
@pytest.mark.parametrize("old,new", [((2, 4), (1, 4)), ((2, 4), (4, 4)), ((2, 4), (3, 5)), ((4, 3), (2, 4))])
def test_data_position_remaps_exactly(old, new):
    """After k micro-batches on W ranks of batch B, seeking on W' ranks of batch B' covers the rest of the epoch's
    order: nothing consumed twice, nothing skipped before the dropped tail of the epoch."""
    ds = TokenDataset(np.arange(203 * 8 + 1), 8)  # sample i starts with token 8 * i

    def take(world, batch, n, seek=None):
        seen = []
        for rank in range(world):
            sb = ShardedBatches(ds, batch, rank, world, seed=3)
            if seek:
                sb.seek(*seek)
            it = iter(sb)
            count = n if n is not None else sb.batches_left_in_epoch()
            for _ in range(count):
                x, _ = next(it)
                seen += (x[:, 0] // 8).tolist()
        return seen, sb.position()

    (w, b), (w2, b2) = old, new
    first, pos = take(w, b, 5)
    assert pos == (0, 5 * w * b)
    rest, end = take(w2, b2, None, seek=pos)
    starts = first + rest
    assert len(starts) == len(set(starts)), "a sample was repeated"
    sampler_order = ShardedBatches(ds, b, 0, 1, seed=3).order
    sampler_order.set_epoch(0)
    order = list(sampler_order)
    consumed = len(starts)
    assert sorted(starts) == sorted(order[:consumed]), "the consumed samples are not a prefix of the order"
    assert len(ds) // w2 * w2 - consumed < w2 * b2  # only a partial global batch is left over


# ----------------------------------------------------------------------------------------------- config
def test_config_checks():
    from hydra import compose, initialize_config_dir

    from hydratrain.config import ConfigError, register_configs, validate
    from hydratrain.dist.run_dir import register_resolvers

    register_configs()
    register_resolvers()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=["checkpoint.preempt_exit_code=2"])
        with pytest.raises(ConfigError, match="checkpoint.preempt_exit_code=2"):
            validate(cfg)
        cfg = compose("train", overrides=["model.init_from=w.pt"])
        with pytest.raises(ConfigError, match="model.init_from='w.pt': must be a .safetensors file"):
            validate(cfg)
        cfg = compose("train", overrides=["checkpoint.resume_from=/nonexistent/x"])
        with pytest.raises(CheckpointError, match="/nonexistent/x: no such checkpoint dir"):
            find_resume(cfg.checkpoint, Path("/nonexistent/run"), Path("/"))


@pytest.mark.slow
def test_exact_resume_keeps_logging_windows(tmp_path):
    """Checkpoint at step 10 inside a 3-step logging window (logged at 9, 12, ...): the resumed run logs the same
    window means (its step-12 value includes step 10's loss from before the kill)."""
    cmd = ["trainer.max_steps=14", "checkpoint.every_n_steps=10", "trainer.log_every_n_steps=3", "strategy=ddp"]
    launch(2, tmp_path / "a", *cmd)
    launch(2, tmp_path / "b", *cmd, check=False, script=FAULTY, env=KILL_AT_10)
    launch(2, tmp_path / "b", *cmd)
    a, b = tb_scalars(tmp_path / "a"), tb_scalars(tmp_path / "b")
    assert sorted(a) == [1, 3, 6, 9, 12, 14] and a == b


@pytest.mark.slow
def test_fp16_grad_scaler_state_round_trips(tmp_path):
    launch(1, tmp_path / "a", "precision=fp16", "trainer.max_steps=3", "checkpoint.save_last=true")
    src = ckpt_of(tmp_path / "a", 3)
    assert read_all(src)["scaler.scale"] > 0
    launch(1, tmp_path / "b", "precision=fp16", "trainer.max_steps=3", "checkpoint.save_last=true",
           f"checkpoint.resume_from={src}")
    assert diff_checkpoints(src, ckpt_of(tmp_path / "b", 3)) == []


def _job(tmp_path: Path, *overrides: str):
    """A real single-process training job (tiny GPT, no process group), built in this process."""
    from hydra import compose, initialize_config_dir

    from hydratrain.config import register_configs
    from hydratrain.dist.env import DistInfo
    from hydratrain.dist.run_dir import register_resolvers
    from hydratrain.parallel.strategy import build_strategy
    from hydratrain.run import build

    register_configs()
    register_resolvers()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=["+debug=fast", "precision=fp32", "strategy=single", "device=cpu",
                                          "logger.tensorboard=false", "logger.peak_flops=1e12", *overrides])
    return build(cfg, build_strategy(cfg), DistInfo(device=torch.device("cpu")), tmp_path, tmp_path)


def test_save_is_atomic_and_pruned(tmp_path, monkeypatch):
    """keep_last prunes; a save that dies before its rename leaves the previous checkpoint as the latest, loadable,
    and the next start removes the leftover temporary dir."""
    import hydratrain.checkpoint.manager as ck

    job = _job(tmp_path, "checkpoint.keep_last=2")
    root = tmp_path / "checkpoints"
    trainer = job.trainer
    batches = iter(trainer.train_batches)
    for step in range(1, 5):
        trainer.train_step(batches)
        trainer.progress.step = step
        job.checkpoints.save(step)
    assert [p.name for _, p in list_checkpoints(root)] == ["step_00000003", "step_00000004"]
    weights = {k: v.clone() for k, v in trainer.model.state_dict().items()}

    trainer.train_step(batches)
    trainer.progress.step = 5
    monkeypatch.setattr(ck.os, "replace", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt("killed")))
    with pytest.raises(KeyboardInterrupt):
        job.checkpoints.save(5)
    monkeypatch.undo()
    assert (root / ".tmp-step_00000005" / ".metadata").exists() and latest_checkpoint(root).name == "step_00000004"

    fresh = _job(tmp_path)
    assert not (root / ".tmp-step_00000005").exists()
    fresh.checkpoints.load(latest_checkpoint(root))
    assert fresh.trainer.progress.step == 4 and fresh.trainer.train_batches.position() == (0, 4 * 4)
    assert_same_tensors(fresh.model.state_dict(), weights, "weights loaded from step 4")
