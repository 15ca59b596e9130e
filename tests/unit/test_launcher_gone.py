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


_HANGS_WITH_THE_GIL = """
import ctypes, logging, sys
from hydratrain.dist.launch import end_within
logging.basicConfig(filename=sys.argv[1], level=logging.INFO)
end_within(1.5)
end_within(60)  # a later, longer deadline keeps the earlier one
libc, mutex = ctypes.PyDLL(None), ctypes.create_string_buffer(64)  # PyDLL keeps the GIL; zeros: an unlocked mutex
libc.pthread_mutex_lock(mutex)
print("blocked", flush=True)
libc.pthread_mutex_lock(mutex)  # locked again by its holder: blocked for good, the GIL held
"""


def test_a_rank_ending_for_its_launcher_ends_in_time_whatever_holds_its_gil(tmp_path):
    """A rank whose launcher is gone sets end_within's deadline as it tears down its process group; its end may then
    block in C with the GIL held (a gloo process group freed while one of its worker threads waits for that GIL),
    where no Python thread, the failure watch included, runs again. The deadline still ends the process, and its log
    shows where it hung."""
    import subprocess
    import sys
    import time

    log = tmp_path / "train_rank1.log"
    started = time.monotonic()
    r = subprocess.run([sys.executable, "-c", _HANGS_WITH_THE_GIL, str(log)], capture_output=True, text=True,
                       timeout=30)
    took = time.monotonic() - started
    assert r.returncode == 1 and r.stdout == "blocked\n" and took < 10, (r.returncode, took, r.stdout, r.stderr)
    text = log.read_text()
    assert "this rank is ending: within 1.5 s, whatever it is doing then" in text, text
    assert "Timeout (0:00:01.500000)!" in text and 'File "<string>", line 10 in <module>' in text, text
