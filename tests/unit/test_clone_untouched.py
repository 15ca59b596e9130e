"""Tests write under temporary dirs only: a run or sweep without a run dir, a subprocess started without ``cwd``, and
the guard that names a test (and fails the session) when something was written into the clone anyway."""
from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

from helpers import ROOT, clone_files, likely_writes, sh


def test_a_run_and_a_sweep_without_a_run_dir_write_outside_the_clone(cli):
    before = likely_writes()
    run = cli(["strategy=single", "trainer.max_steps=1", "trainer.eval_every_n_steps=0"])
    assert run.returncode == 0, run.output[-3000:]
    run_dir = Path(re.search(r"run dir (\S+);", run.output).group(1))
    assert ROOT not in run_dir.parents and Path.cwd() in run_dir.parents, run_dir
    sweep = cli(["-m", "launcher=torchrun", "+launcher.max_restart=1"])  # refused by the job's check, after Hydra's
    assert sweep.returncode == 1, sweep.output[-3000:]  # sweep dir exists (multirun/<date>/<time>)
    assert list(Path.cwd().glob("multirun/*/*/.hydratrain_multirun.json")), sweep.output[-3000:]
    assert likely_writes() == before


def test_a_subprocess_started_without_cwd_starts_outside_the_clone():
    here = sh([sys.executable, "-c", "import os; print(os.getcwd())"], timeout=60).ok().output.strip()
    assert Path(here) == Path.cwd() and ROOT not in Path(here).parents and Path(here) != ROOT


def test_the_guard_names_what_a_test_wrote_into_the_clone():
    before, likely = clone_files(), likely_writes()
    made = not (ROOT / "multirun").exists()
    probe = ROOT / "multirun" / f"guard-probe-{os.getpid()}"
    try:
        probe.mkdir(parents=True)
        (probe / "status.json").write_text("{}")
        new = clone_files() - before
        assert new == {f"multirun/{probe.name}", f"multirun/{probe.name}/status.json"} | (
            {"multirun"} if made else set()), new
        assert likely_writes() - likely == {f"multirun/{probe.name}"} | ({"multirun"} if made else set())
    finally:
        shutil.rmtree(ROOT / "multirun" if made else probe, ignore_errors=True)
    assert clone_files() == before
