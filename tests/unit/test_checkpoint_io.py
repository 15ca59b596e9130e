"""Checkpoints in this process: atomic saves and pruning, an incomplete checkpoint is never picked, truncated or
corrupt shards and unsafe metadata are one-line errors (a run refuses them before any step), weights-only loading,
init_from shape checks, the data position remapped across world sizes, checkpoint config checks. Resuming across
processes, world sizes and strategies: tests/e2e/test_checkpoint.py."""
from __future__ import annotations

import io
import os
import pickle
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import assert_same_tensors, ckpt_of, cut_command
from hydratrain.checkpoint.io import SafeLoadPlanner, read_all, read_metadata, verify
from hydratrain.checkpoint.manager import find_resume, latest_checkpoint, list_checkpoints, resolve_checkpoint
from hydratrain.data.streams import ShardedBatches, TokenDataset
from hydratrain.errors import EXIT_CHECKPOINT, CheckpointError


@pytest.fixture
def saved(make_job, tmp_path) -> Path:
    """A run dir whose checkpoints/ holds step_00000010 and step_00000020 of a tiny single-process job."""
    run_dir = tmp_path / "saved"
    job = make_job(run_dir)
    for step in (10, 20):
        job.trainer.progress.step = step
        job.checkpoints.save(step)
    return run_dir


# ------------------------------------------------------------------------------------------ saving and picking
def test_save_is_atomic_and_pruned(make_job, tmp_path, monkeypatch):
    """keep_last prunes; a save that dies before its rename leaves the previous checkpoint as the latest, loadable,
    and the next start removes the leftover temporary dir."""
    import hydratrain.checkpoint.manager as ck

    job = make_job(tmp_path, "checkpoint.keep_last=2")
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

    fresh = make_job(tmp_path)
    assert not (root / ".tmp-step_00000005").exists()
    fresh.checkpoints.load(latest_checkpoint(root))
    assert fresh.trainer.progress.step == 4 and fresh.trainer.train_batches.position() == (0, 4 * 4)
    assert_same_tensors(fresh.model.state_dict(), weights, "weights loaded from step 4")


class _Holder:
    """A Stateful component holding ``state`` as given."""

    def __init__(self, state: dict):
        self.state = state

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, state: dict) -> None:
        self.state = state


def test_a_value_loads_as_a_tensor_or_a_number_as_this_run_holds_it(tmp_path):
    """Whether a value is a 0-d tensor or a number is its writer's choice (torchao's AdamW8bit keeps lr as a
    tensor, torch's AdamW a float): a checkpoint loads either way round, each value in this run's kind."""
    from hydratrain.checkpoint.manager import CheckpointManager

    def manager(state: dict) -> CheckpointManager:
        return CheckpointManager(tmp_path / "checkpoints", {"opt": _Holder(state)}, {}, {}, 0, torch.device("cpu"))

    saved = {"groups": [{"lr": torch.tensor(0.5), "momentum": 0.25, "n": torch.tensor(3), "flag": True,
                         "name": "g0"}]}
    ckpt = manager(saved).save(1)
    md = read_metadata(ckpt).state_dict_metadata
    assert type(md["opt.groups.0.lr"]).__name__ == "TensorStorageMetadata"
    assert type(md["opt.groups.0.momentum"]).__name__ == "BytesStorageMetadata"
    live = manager({"groups": [{"lr": 0.1, "momentum": torch.tensor(0.0, dtype=torch.float64), "n": 0,
                                "flag": torch.tensor(False), "name": "x"}]})
    live.load(ckpt)
    group = live.components["opt"].state["groups"][0]
    assert type(group["lr"]) is float and group["lr"] == 0.5
    assert type(group["n"]) is int and group["n"] == 3
    assert group["momentum"].dtype == torch.float64 and group["momentum"].item() == 0.25
    assert group["flag"].dtype == torch.bool and bool(group["flag"])
    assert group["name"] == "g0"


def test_incomplete_checkpoint_is_never_picked(saved, tmp_path):
    root = tmp_path / "run" / "checkpoints"
    shutil.copytree(ckpt_of(saved, 10), root / "step_00000010")
    shutil.copytree(ckpt_of(saved, 20), root / "step_00000020")
    (root / "step_00000020" / ".metadata").unlink()  # as if the metadata never got written
    shutil.copytree(ckpt_of(saved, 20), root / ".tmp-step_00000030")  # a save killed before its rename
    assert latest_checkpoint(root) == root / "step_00000010"
    with pytest.raises(CheckpointError, match=r"step_00000020/.metadata: missing"):
        resolve_checkpoint(root / "step_00000020")


# ------------------------------------------------------------------------------------------ unusable checkpoints
def test_truncated_shard_stops_the_run_with_one_line(saved, tmp_path, cli):
    run = tmp_path / "run"
    ckpt = run / "checkpoints" / "step_00000010"
    shutil.copytree(ckpt_of(saved, 10), ckpt)
    shard = ckpt / "__0_0.distcp"
    with open(shard, "r+b") as fh:
        fh.truncate(shard.stat().st_size // 2)
    with pytest.raises(CheckpointError, match=re.escape(str(shard)) + ": truncated"):
        verify(ckpt)
    r = cli(["strategy=single", "trainer.max_steps=20"], run)  # auto-resume finds it: refused before any step
    assert r.returncode == EXIT_CHECKPOINT, r.output[-3000:]
    errors = [line for line in r.err.splitlines() if "checkpoint error" in line]
    assert len(errors) == 1 and errors[0].startswith(f"hydratrain: checkpoint error: {shard}: truncated")
    assert "step 1/" not in r.output


def test_a_truncated_latest_checkpoint_names_the_previous_one_and_resume_from_is_said_to_lose(saved, caplog):
    """Auto-resume in a run dir whose newest checkpoint is unusable: the error says how to resume from the one
    before. A checkpoint.resume_from that the run dir's own checkpoint wins over is said, not silently dropped."""
    from omegaconf import OmegaConf

    shard = ckpt_of(saved, 20) / "__0_0.distcp"
    with open(shard, "r+b") as fh:
        fh.truncate(shard.stat().st_size // 2)
    ccfg = OmegaConf.create({"auto_resume": True, "resume_from": "elsewhere/step_00000005"})
    with pytest.raises(CheckpointError, match=re.escape(
            f"; to resume from the previous checkpoint instead: checkpoint.auto_resume=false "
            f"checkpoint.resume_from={ckpt_of(saved, 10)} (later ones are then set aside)")):
        find_resume(ccfg, saved, saved)
    assert "checkpoint.resume_from=elsewhere/step_00000005 not used: this run dir has its own checkpoint" in caplog.text


def test_a_corrupt_latest_checkpoint_names_the_previous_one(saved, cli):
    """Shard bytes overwritten in place (the size still right, so the start-up checks pass): the load finds the
    corruption, and the one line says how to resume from the previous checkpoint, as for a truncated shard."""
    shard = ckpt_of(saved, 20) / "__0_0.distcp"
    shard.write_bytes(bytes(range(256)) * (shard.stat().st_size // 256) + b"\0" * (shard.stat().st_size % 256))
    r = cli(["strategy=single", "trainer.max_steps=30"], saved)
    assert r.returncode == EXIT_CHECKPOINT, r.output[-3000:]
    (line,) = [ln for ln in r.err.splitlines() if "checkpoint error" in ln]
    assert line.startswith(f"hydratrain: checkpoint error: {shard}: bytes ") and "are corrupt" in line, line
    assert line.endswith(f"; to resume from the previous checkpoint instead: checkpoint.auto_resume=false "
                         f"checkpoint.resume_from={ckpt_of(saved, 10)} (later ones are then set aside)"), line


def test_another_data_order_is_refused_naming_the_config_keys_that_changed_it(saved, tmp_path, cli):
    r = cli(["strategy=single", "trainer.max_steps=12", "data.synthetic_tokens=300000",
             f"checkpoint.resume_from={ckpt_of(saved, 10)}"], tmp_path / "run")
    assert r.returncode == EXIT_CHECKPOINT, r.output[-3000:]
    line = next(ln for ln in r.err.splitlines() if "checkpoint error" in ln)
    assert "cannot restore the data position (data (train split size, in samples) was" in line, line
    assert line.endswith("(the config differs: data.synthetic_tokens: 2000000 -> 300000)"), line


def test_a_checkpoint_without_its_config_says_what_is_not_checked(saved, make_job, tmp_path, caplog):
    ckpt = tmp_path / "step_00000010"
    shutil.copytree(ckpt_of(saved, 10), ckpt)
    (ckpt / "config.yaml").write_text(": not yaml [")
    make_job(tmp_path / "run").checkpoints.load(ckpt)
    assert f"{ckpt} has no readable config.yaml: the model architecture and the config" in caplog.text


def test_corrupt_bytes_are_named(saved, tmp_path):
    ckpt = tmp_path / "step_00000010"
    shutil.copytree(ckpt_of(saved, 10), ckpt)
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


def test_init_from_wrong_shapes_is_refused(tmp_path):
    from safetensors.torch import save_file

    from hydratrain.checkpoint.io import init_from_file
    from hydratrain.models.gpt import GPT, GPTConfig

    bad = tmp_path / "bad.safetensors"
    save_file({k: v.clone() for k, v in GPT(GPTConfig(d_model=32, n_layer=2, n_head=2)).state_dict().items()}, str(bad))
    model = GPT(GPTConfig(d_model=64, n_layer=2, n_head=2))
    with pytest.raises(CheckpointError, match=r"model.init_from=.*bad.safetensors: tok_emb.weight has shape"):
        init_from_file(model, bad)


def test_init_from_a_compiled_modules_state_dict_names_the_prefix(tmp_path):
    """A user's own state dict of a torch.compile'd model carries '_orig_mod.' in every key: the refusal says so
    (not only in the missing/unexpected key lists)."""
    from safetensors.torch import save_file

    from hydratrain.checkpoint.io import init_from_file
    from hydratrain.models.gpt import GPT, GPTConfig

    model = GPT(GPTConfig(d_model=32, n_layer=1, n_head=2))
    compiled = tmp_path / "compiled.safetensors"
    save_file({f"_orig_mod.{k}": v.clone() for k, v in model.state_dict().items()}, str(compiled))
    with pytest.raises(CheckpointError, match="the file's keys carry torch.compile's '_orig_mod.'"):
        init_from_file(model, compiled)


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
def test_config_checks(compose):
    from hydratrain.config.validate import validate
    from hydratrain.errors import ConfigError

    with pytest.raises(ConfigError, match="checkpoint.preempt_exit_code=2"):
        validate(compose(["checkpoint.preempt_exit_code=2"]))
    with pytest.raises(ConfigError, match="model.init_from='w.pt': must be a .safetensors file"):
        validate(compose(["model.init_from=w.pt"]))
    cfg = compose(["checkpoint.resume_from=/nonexistent/x"])
    with pytest.raises(CheckpointError, match="/nonexistent/x: no such checkpoint dir"):
        find_resume(cfg.checkpoint, Path("/nonexistent/run"), Path("/"))


def test_a_step_dir_without_metadata_is_warned_about_once(tmp_path, caplog):
    """Such a dir (a copy that lost its .metadata) is skipped; every save lists the checkpoints again, and used to
    repeat the warning each time."""
    from hydratrain.checkpoint.manager import list_checkpoints

    (tmp_path / "step_00000003").mkdir()
    for _ in range(3):
        assert list_checkpoints(tmp_path) == []
    assert caplog.text.count("is not a complete checkpoint") == 1


def test_a_fresh_start_does_not_import_the_checkpoint_reader(tmp_path):
    """Choosing where to start is a directory listing: ``torch.distributed.checkpoint`` (about 0.1-1 s to import, the
    rest shared with what the optimizer imports) waits for the first save or a real resume."""
    import subprocess
    import sys

    code = ("import sys; from pathlib import Path; from omegaconf import OmegaConf\n"
            "from hydratrain.checkpoint.manager import find_resume\n"
            "ccfg = OmegaConf.create({'auto_resume': True, 'resume_from': None})\n"
            f"assert find_resume(ccfg, Path({str(tmp_path)!r}), Path('.')) is None\n"
            "print('torch.distributed.checkpoint' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("where", ["shards", "config"])
def test_a_save_that_cannot_be_written_stops_with_one_line_and_keeps_the_last_checkpoint(make_job, tmp_path,
                                                                                         monkeypatch, where):
    """A full (or read-only, or lost) filesystem while saving: a CheckpointError naming the step, the cause and the
    intact checkpoint to resume from (it was DCP's CheckpointException traceback, exit 1); the partial dir is gone."""
    import errno

    from torch.distributed.checkpoint import FileSystemWriter

    run_dir = tmp_path / "r"
    job = make_job(run_dir)
    job.checkpoints.save(2)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    if where == "shards":
        monkeypatch.setattr(FileSystemWriter, "write_data", full)
    else:
        write_text = Path.write_text
        monkeypatch.setattr(Path, "write_text", lambda self, *a, **k: full() if self.name == "config.yaml"
                            else write_text(self, *a, **k))
    with pytest.raises(CheckpointError) as err:
        job.checkpoints.save(4)
    assert re.fullmatch(re.escape(f"saving step 4 under {run_dir / 'checkpoints'} failed (OSError: [Errno 28] No space "
                                  "left on device; ") + r"\d+\.\d MB free there\)" + re.escape(
        f"; training stopped. The latest complete checkpoint, {ckpt_of(run_dir, 2)}, is intact: make room (or lower "
        "checkpoint.keep_last) and resume from it with"), cut_command(str(err.value))[0]), str(err.value)
    assert cut_command(str(err.value))[1].endswith(f" hydra.run.dir={run_dir}"), str(err.value)  # its run dir
    assert err.value.same_on_every_rank  # rank 0 alone prints it
    assert err.value.own_failure  # every rank's own: not "another rank failed first" on the rank that recorded second
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step_00000002"]


@pytest.mark.parametrize("cause", ["quota", "permission", "file size"])
def test_a_save_refused_for_another_cause_than_space_gives_that_causes_remedy(make_job, tmp_path, monkeypatch, cause):
    """Every failed save but a read-only one said "make room (or lower checkpoint.keep_last)": with a
    quota, a ``chattr +i`` checkpoints dir (EPERM) and under ``ulimit -f``, where torch's writer raises a
    ``RuntimeError`` that lost the errno (EFBIG) and 43 GB were free."""
    import errno
    import resource

    from torch.distributed.checkpoint import FileSystemWriter

    run_dir = tmp_path / "r"
    job = make_job(run_dir)
    job.checkpoints.save(2)
    root = run_dir / "checkpoints"
    raised = {"quota": OSError(errno.EDQUOT, "Disk quota exceeded"),
              "file size": RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")}

    def refuse(*args, **kwargs):
        raise raised[cause]

    mkdir = Path.mkdir

    def immutable(self, *args, **kwargs):  # chattr +i checkpoints/: rank 0 cannot make the save's dir in it
        if self.parent == root:
            raise PermissionError(errno.EPERM, "Operation not permitted", str(self))
        return mkdir(self, *args, **kwargs)

    if cause == "permission":
        monkeypatch.setattr(Path, "mkdir", immutable)
    else:
        monkeypatch.setattr(FileSystemWriter, "write_data", refuse)
    getrlimit = resource.getrlimit
    monkeypatch.setattr(resource, "getrlimit", lambda which: (
        ((1000 * 1024 if cause == "file size" else resource.RLIM_INFINITY), resource.RLIM_INFINITY)
        if which == resource.RLIMIT_FSIZE else getrlimit(which)))
    with pytest.raises(CheckpointError) as err:
        job.checkpoints.save(4)
    remedy = {"quota": "free some of your quota (or lower checkpoint.keep_last)",
              "permission": f"fix the permissions or attributes (lsattr -d) of {root} (or write elsewhere)",
              "file size": "raise the file-size limit (`ulimit -f`, in the shell or job script that launches the "
                           "run)"}[cause]
    assert cut_command(str(err.value))[0].endswith(f"is intact: {remedy} and resume from it with"), str(err.value)
    if cause == "file size":
        assert ("unexpected pos 704 vs 598; the error has no errno; likely File too large: this process's file-size "
                "limit (RLIMIT_FSIZE, `ulimit -f`) is 1000 KiB); training stopped.") in str(err.value), str(err.value)
    assert [p.name for p in root.iterdir()] == ["step_00000002"]


def test_an_architecture_named_as_the_preset_derives_it_is_the_same_architecture():
    """d_ff=null derives the width from d_model (192 for 64) and n_kv_head=null is n_head: naming those values
    explicitly on resume or init_from is no architecture change (d_ff=192 is accepted); another width is."""
    from hydratrain.checkpoint.architecture import architecture_diff

    saved = {"d_model": 64, "n_head": 2, "n_kv_head": None, "d_ff": None, "ff_multiple_of": 64}
    assert architecture_diff(saved, {**saved, "d_ff": 192, "n_kv_head": 2}) == []
    assert architecture_diff(saved, {**saved, "d_ff": 256}) == ["model.d_ff: 192 -> 256"]
    assert architecture_diff(saved, {**saved, "ff_multiple_of": 128}) == ["model.d_ff: 192 -> 256"]
    assert architecture_diff(saved, {**saved, "n_kv_head": 1}) == ["model.n_kv_head: 2 -> 1"]


def test_an_unfinished_save_that_cannot_be_removed_is_not_said_to_be_removed(tmp_path, monkeypatch, caplog):
    """``removing .tmp-step_...`` was logged while a checkpoints dir that took no writes kept it (``rmtree`` ignored
    the error), and the save of that step then failed with a misleading ``FileExistsError``."""
    import shutil

    from hydratrain.checkpoint.manager import recover_unfinished_saves

    stale = tmp_path / ".tmp-step_00000012"
    stale.mkdir()

    def refused(path, *args, **kwargs):
        raise PermissionError(1, "Operation not permitted", str(path))

    monkeypatch.setattr(shutil, "rmtree", refused)
    with caplog.at_level("WARNING", logger="hydratrain"):
        recover_unfinished_saves(tmp_path)
    assert stale.is_dir() and "could not remove" in caplog.text and "Operation not permitted" in caplog.text
    assert "removed " not in caplog.text


def test_one_class_under_two_paths_is_the_same_architecture():
    """A re-export or a moved module that the old path still imports names the same class: a resume or init_from
    across the two spellings is not refused as another architecture."""
    from hydratrain.checkpoint.architecture import architecture_diff

    assert architecture_diff({"_target_": "torch.nn.modules.linear.Linear"}, {"_target_": "torch.nn.Linear"}) == []
    assert architecture_diff({"_target_": "torch.nn.Linear"}, {"_target_": "torch.nn.Conv2d"}) == [
        "model._target_: 'torch.nn.Linear' -> 'torch.nn.Conv2d'"]
