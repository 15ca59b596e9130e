"""A rank whose launcher died (``kill -9`` of torchrun: it passes no signal on) stops at its next step or write,
before it trains, saves, completes a save or prunes anything more, and leaves its run dir, so that a relaunch at once
resumes from the checkpoints that existed when the launcher died. In-process: the launcher's death is the rank's
parent pid changing (tests/e2e/test_fail_fast.py kills a real torchrun)."""
from __future__ import annotations

import os

import pytest

from helpers import cut_command

FEW = ["strategy=single", "trainer.max_steps=8", "checkpoint.every_n_steps=2", "checkpoint.keep_last=2",
       "trainer.eval_every_n_steps=0"]


@pytest.mark.parametrize("when,stopped,left", [
    ("after_step_4", "before step 5", ["step_00000002", "step_00000004"]),
    ("in_step_6", "before saving step 6", ["step_00000002", "step_00000004"]),
    ("in_save_6", "before completing its save of step 6 (left as .tmp-step_00000006)",
     [".tmp-step_00000006", "step_00000002", "step_00000004"]),
    ("after_rename_6", "before pruning step_00000002", ["step_00000002", "step_00000004", "step_00000006"]),
])
def test_a_rank_whose_launcher_died_stops_before_it_writes_or_prunes(cli, monkeypatch, tmp_path, when, stopped, left):
    import torch.distributed.checkpoint as dcp

    from hydratrain.checkpoint import manager
    from hydratrain.dist import launch
    from hydratrain.train.trainer import Trainer

    def launcher_dies():
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
        monkeypatch.setattr(launch, "_LAUNCHER", {"pid": os.getppid() + 100000, "cmdline": [
            "/venv/bin/python3", "/venv/bin/torchrun", "--nproc_per_node", "1", "train.py"]})

    end_of_step, train_step, save, fsync = Trainer._end_of_step, Trainer.train_step, dcp.save, manager._fsync_dir

    def after(step, then):
        def wrapped(*args, **kwargs):
            out = then(*args, **kwargs)
            if step():
                launcher_dies()
            return out
        return wrapped

    if when == "after_step_4":
        monkeypatch.setattr(Trainer, "_end_of_step", lambda self, s, v: after(lambda: s == 4, end_of_step)(self, s, v))
    elif when == "in_step_6":
        monkeypatch.setattr(Trainer, "train_step", lambda self, b: after(lambda: self.progress.step == 6,
                                                                         train_step)(self, b))
    elif when == "in_save_6":
        monkeypatch.setattr(dcp, "save", after(lambda: (tmp_path / "checkpoints" / ".tmp-step_00000006").is_dir(),
                                               save))
    else:
        monkeypatch.setattr(manager, "_fsync_dir", after(lambda: (tmp_path / "checkpoints" / "step_00000006").is_dir(),
                                                         fsync))
    run = cli(FEW, tmp_path)
    assert run.returncode == 5, run.output[-3000:]
    lines = [ln for ln in run.err.splitlines() if ln.startswith("hydratrain: ")]
    assert len(lines) == 1, run.output[-3000:]
    head, command = cut_command(lines[0])
    pid = os.getppid() + 100000
    assert head == (f"hydratrain: stopped: torchrun (pid {pid}) is gone: it died without stopping this rank (kill -9, "
                    f"the OOM killer, a closed terminal), so the rank stopped {stopped}, writing and pruning nothing "
                    "after that, and left its run dir; to resume from the latest checkpoint"), lines[0]
    assert command.endswith(f"hydra.run.dir={tmp_path}"), command
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == left
    assert not (tmp_path / "hydratrain.lock").exists() and not (tmp_path / "results.json").exists()


def test_the_launcher_is_watched_only_for_ranks_of_torchs_agent(monkeypatch):
    from hydratrain.dist import launch

    monkeypatch.setattr(launch, "_LAUNCHER", {"pid": os.getppid() + 100000, "cmdline": None})
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    launch.stop_if_launcher_gone("before step 1")  # one process, SLURM, Ray: their parent is not a launcher to watch
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    with pytest.raises(launch.LauncherGoneError, match=r"its launcher, the parent process \(pid \d+\) is gone"):
        launch.stop_if_launcher_gone("before step 1")
    monkeypatch.setattr(launch, "_LAUNCHER", {"pid": os.getppid(), "cmdline": None})
    launch.stop_if_launcher_gone("before step 1")  # alive
