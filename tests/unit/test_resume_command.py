"""Every line that says how to resume gives the command that does: the launch's own command with the run dir (a
sweep: the sweep dir) in it. The same command without it makes a new, time-stamped dir and starts over."""
from __future__ import annotations

import os
import re
import shlex
import signal
from pathlib import Path

from helpers import FAST, TRAIN, cut_command

FEW = ["strategy=single", "trainer.max_steps=6", "checkpoint.every_n_steps=2", "trainer.eval_every_n_steps=0"]


def _stop_after(monkeypatch, step: int, how):
    """Make the trainer call ``how()`` once training has finished ``step`` (its checkpoint, if due, saved); returns
    what puts the trainer back (not ``monkeypatch.undo``, which would also leave the test's temporary launch dir)."""
    from hydratrain.train.trainer import Trainer

    end_of_step = Trainer._end_of_step

    def stop(self, s, votes):
        stopped = end_of_step(self, s, votes)
        if s == step:
            how()
        return stopped

    monkeypatch.setattr(Trainer, "_end_of_step", stop)
    return lambda: monkeypatch.setattr(Trainer, "_end_of_step", end_of_step)


def _interrupt():
    raise KeyboardInterrupt


def _line(output: str, start: str) -> str:
    return next(ln for ln in output.splitlines() if ln.startswith(start))


def _args(command: str) -> list:
    """The arguments after the script of a ``python .../train.py ARGS`` command line, as the shell splits them."""
    words = shlex.split(command)
    assert words[:2] == ["python", TRAIN], words
    return words[2:]


def test_the_line_at_ctrl_c_gives_the_command_that_resumes_a_default_run_dir(cli, monkeypatch):
    """Ctrl-C at step 4 of a run in the default time-stamped dir: the line's command (hydra.run.dir included)
    resumes from step 4 in that dir. The same command without it, what the line used to advise, starts over in a
    new dir."""
    train_on = _stop_after(monkeypatch, 4, _interrupt)
    first = cli(FEW)
    assert first.returncode == 130, first.output[-3000:]
    head, command = cut_command(_line(first.err, "hydratrain: interrupted"))
    assert head.endswith("; to resume from the latest checkpoint"), head
    run_dir = re.search(r"run dir (\S+);", first.output).group(1)
    assert command == shlex.join(["python", TRAIN, *FAST, *FEW, f"hydra.run.dir={os.path.relpath(run_dir)}"])
    train_on()
    resumed = cli(_args(command), fast=False)
    assert resumed.returncode == 0 and f"resumed from {run_dir}/checkpoints/step_00000004" in resumed.output, \
        resumed.output[-3000:]
    again = cli(FEW)  # the same command as typed: another dir, from step 1
    assert again.returncode == 0 and "resumed from" not in again.output and run_dir not in again.output


def test_a_preempted_run_logs_the_command_that_resumes_it(cli, monkeypatch):
    _stop_after(monkeypatch, 3, lambda: os.kill(os.getpid(), signal.SIGTERM))
    run = cli(FEW)
    assert run.returncode == 75, run.output[-3000:]
    line = next(ln for ln in run.output.splitlines() if "stopping at step 4 after a preemption signal" in ln)
    run_dir = re.search(r"run dir (\S+);", run.output).group(1)
    assert line.endswith(f"; to resume: {shlex.join(['python', TRAIN, *FAST, *FEW])} "
                         f"hydra.run.dir={os.path.relpath(run_dir)}"), line


def test_a_stopped_sweep_gives_the_sweep_command_with_its_sweep_dir(cli, monkeypatch):
    train_on = _stop_after(monkeypatch, 2, _interrupt)
    sweep = cli(["-m", *FEW, "optim.lr=1e-3,2e-3"])
    assert sweep.returncode == 130, sweep.output[-3000:]
    head, command = cut_command(_line(sweep.err, "hydratrain: interrupted"))
    sweep_dir = next(Path.cwd().glob("multirun/*/*"))
    assert command == shlex.join(["python", TRAIN, "-m", *FAST, *FEW, "optim.lr=1e-3,2e-3",
                                  f"hydra.sweep.dir={sweep_dir.relative_to(Path.cwd())}"]), command
    train_on()
    resumed = cli(_args(command), fast=False)
    assert resumed.returncode == 0 and f"resumed from {sweep_dir}/0/checkpoints/step_00000002" in resumed.output, \
        resumed.output[-3000:]


def test_divergence_after_a_checkpoint_gives_the_command_that_resumes_from_it(cli):
    run = cli(["strategy=single", "optim.lr=1e30", "scheduler=constant", "checkpoint.every_n_steps=1"])
    assert run.returncode == 4, run.output[-3000:]
    head, command = cut_command(_line(run.err, "hydratrain: diverged"))
    assert "last good checkpoint: " in head and head.endswith("; to resume from the latest checkpoint with such a "
                                                              "change"), head
    assert re.fullmatch(re.escape(shlex.join(["python", TRAIN, *FAST, "strategy=single", "optim.lr=1e30",
                                              "scheduler=constant", "checkpoint.every_n_steps=1"]))
                        + r" hydra\.run\.dir=outputs/\S+", command), command


def test_a_torchrun_rank_gives_torchruns_command(monkeypatch, tmp_path):
    """A rank's own command line is ``python -u train.py ARGS``; the command that resumes is its agent's
    (``torchrun [options] train.py ARGS``), read from /proc when the rank starts, with the run dir, quoted so
    that the shell and Hydra's override grammar both read it back as it is."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from hydratrain.dist import launch

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")
    monkeypatch.setattr(launch.sys, "argv", ["train.py", "strategy=ddp", "hydra.run.dir=runs/old"])
    monkeypatch.setattr(launch, "_LAUNCHER", {"pid": os.getppid(), "cmdline": [
        "/venv/bin/python3", "/venv/bin/torchrun", "--nproc_per_node", "2", "train.py", "strategy=ddp",
        "hydra.run.dir=runs/old"]})
    odd = tmp_path / "run dir, 1"
    command = launch.resume_command(odd)
    assert command == f"torchrun --nproc_per_node 2 train.py strategy=ddp \"hydra.run.dir='{odd}'\"", command
    value = OverridesParser.create().parse_overrides([shlex.split(command)[-1]])[0].value()
    assert value == str(odd)
    assert launch.launcher_gone() is None  # its launcher, this process's parent, lives
    monkeypatch.setitem(launch._LAUNCHER, "pid", os.getppid() + 100000)
    assert launch.launcher_gone() == f"torchrun (pid {os.getppid() + 100000})"
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    assert launch.launcher_gone() is None  # not a torchrun rank: nothing to watch
