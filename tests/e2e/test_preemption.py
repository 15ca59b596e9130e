"""Preemption under SLURM through submitit: the time-limit signal is SIGUSR2 to rank 0; every rank saves, then
submitit's own handler requeues the job (rank 0), and every rank exits with checkpoint.preempt_exit_code. A
preemption signal during start-up, and Ctrl-C in a run and in a sweep: one line, a documented status, nothing held.
(SIGTERM during training: tests/e2e/test_checkpoint.py; to the torchrun launcher: tests/e2e/test_launchers.py.)"""
from __future__ import annotations

import os
import re
import shlex
import signal
import time
from pathlib import Path

import pytest

from helpers import FAULTY, finish, log_of, report_rows, start
from hydratrain.checkpoint.manager import latest_checkpoint


def _worker_pids(launcher_pid: int) -> dict[int, int]:
    """{RANK: pid} of the workers torchrun ``launcher_pid`` started."""
    out = {}
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == launcher_pid:
                env = dict(x.split("=", 1) for x in (d / "environ").read_text().split("\0") if "=" in x)
                out[int(env["RANK"])] = int(d.name)
        except (OSError, ValueError, KeyError, IndexError):
            continue
    return out


def _launches(base: Path) -> dict:
    """The single-process launches of this module's tests, by test name: ``(args, run_dir, env, cwd)`` as
    :func:`helpers.start` takes them (``script=FAULTY``), each in its own launch dir under ``base``."""
    compose = {"HT_FAULT_AT": "compose"}
    stop = ["strategy=single", "checkpoint.preempt_exit_code=76", "trainer.max_steps=2"]
    out = {}
    for phase, fault in (("startup", "sleep"), ("startup", "swallow"), ("final", "sleep")):
        out[f"test_sigterm_outside_training_ends_the_launch_at_once_with_the_preempt_status[{phase}-{fault}]"] = (
            stop, base / f"{phase}-{fault}" / "run", {"HT_FAULT": fault, "HT_FAULT_AT": phase, "HT_FAULT_RANK": "all"},
            base / f"{phase}-{fault}" / "launch")  # (the run dir outside it: the resume command names it whole)
    out["test_sigterm_while_a_sweep_composes_keeps_its_default_when_save_on_sigterm_is_off"] = (
        ["-m", "strategy=single", "checkpoint.save_on_sigterm=false", "optim.lr=1e-3,3e-3",
         f"hydra.sweep.dir={base / 'default' / 's'}"], None, compose, base / "default")
    for multirun in ("run", "sweep"):
        cwd = base / f"compose-{multirun}"
        args = ["-m", *stop, "optim.lr=1e-3,3e-3", f"hydra.sweep.dir={cwd / 's'}"] if multirun == "sweep" else stop
        out[f"test_sigterm_while_hydra_composes_ends_the_launch_as_preempted[{multirun}]"] = (
            args, None if multirun == "sweep" else cwd / "run", compose, cwd)
    return out


@pytest.fixture(scope="module")
def started(request, tmp_path_factory):
    """The launches of this module's tests that run in the current session, started together when the first of
    them needs its own: each waits idle at its fault (or ends by itself), so their start-ups (an interpreter, torch,
    Hydra: seconds each, on one core) overlap instead of adding up. ``started(request)`` -> (process, run dir, launch
    dir) of the calling test."""
    base = tmp_path_factory.mktemp("preemption")
    launches = _launches(base)
    wanted = {item.name for item in request.session.items if item.module is request.module} & set(launches)
    procs = {}
    for name in sorted(wanted):
        args, run_dir, env, cwd = launches[name]
        cwd.mkdir(parents=True, exist_ok=True)
        procs[name] = (start(args, run_dir, script=FAULTY, env=env, cwd=cwd), run_dir, cwd)
    yield lambda req: procs.pop(req.node.name)
    for proc, _, _ in procs.values():  # a test that did not take its own (it failed before, or was skipped)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()


@pytest.mark.slow  # a sibling of it runs by default; CI runs this too (default suite near 4 minutes)
@pytest.mark.parametrize("saves", [["checkpoint.every_n_steps=0"],
                                   ["checkpoint.every_n_steps=2", "checkpoint.async_save=true"]], ids=["sync", "async"])
def test_sigusr2_under_submitit_saves_on_every_rank_then_requeues(tmp_path, saves):
    """(async: background saves every 2 steps; the preemption's save waits for the one in flight and is complete
    when the stop line names it.)"""
    run_dir, markers = tmp_path / "run", tmp_path / "markers"
    markers.mkdir()
    proc = start(["strategy=ddp", "trainer.max_steps=400", "trainer.eval_every_n_steps=0",
                  *saves], run_dir, nproc=2, script=FAULTY,
                 env={"SUBMITIT_EXECUTOR": "slurm", "HT_FAKE_SUBMITIT": str(markers)})
    try:
        deadline = time.time() + 180
        while not ((run_dir / "train_rank0.log").exists() and "step 3/400" in log_of(run_dir)):
            assert proc.poll() is None and time.time() < deadline, "the run did not reach step 3"
            time.sleep(0.2)
        os.kill(_worker_pids(proc.pid)[0], signal.SIGUSR2)
        r = finish(proc, timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    codes = [int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", r.output)]
    assert codes and all(c == 75 for c in codes), r.output[-3000:]
    saved = latest_checkpoint(run_dir / "checkpoints")
    step = int(saved.name.split("_")[1])
    for rank in (0, 1):
        assert f"stopping at step {step} after a preemption signal" in log_of(run_dir, rank)
    assert "SIGUSR2 received" in log_of(run_dir, 0)
    assert sorted(p.name for p in markers.iterdir()) == ["requeued_rank0"]  # submitit's handler ran once, rank 0
    if "checkpoint.async_save=true" in saves:
        assert "staged checkpoint of step 2" in log_of(run_dir) and "writing it in the background" in log_of(run_dir)
        assert not list((run_dir / "checkpoints").glob(".tmp-*"))


def _wait_for(path, proc, what: str, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while not path.exists():
        assert proc.poll() is None and time.time() < deadline, f"{what}: {finish(proc, 10).output[-3000:]}"
        time.sleep(0.2)


@pytest.mark.parametrize("phase,fault", [("startup", "sleep"),
                                         pytest.param("startup", "swallow", marks=pytest.mark.slow),
                                         pytest.param("final", "sleep", marks=pytest.mark.slow)])
def test_sigterm_outside_training_ends_the_launch_at_once_with_the_preempt_status(started, request, phase, fault):
    """A SIGTERM while the run still starts (here while it builds its data, which HT_FAULT=sleep holds for 120 s),
    or after its last step (while it writes its outputs): training cannot stop at a step, so the launch ends at once
    with one line and checkpoint.preempt_exit_code and releases its run dir. It used to die of the signal (status
    143) with nothing said and its lock left behind. Library code that swallows the exception (``swallow``) only
    delays it to the first step."""
    proc, run_dir, _ = started(request)
    _wait_for(run_dir / f"fault_rank0_{phase}", proc, f"the run did not reach its {phase} fault")
    os.kill(proc.pid, signal.SIGTERM)
    killed = time.monotonic()
    r = finish(proc, timeout=60)
    assert r.returncode == 76 and time.monotonic() - killed < 100, r.output[-3000:]  # not after the 120 s fault
    what = ("during start-up, before this launch's first step: nothing trained, nothing to save; to resume"
            if phase == "startup" else "after the last step, during the final evaluation and outputs: nothing saved "
            "since the latest checkpoint; to finish from it")
    assert f"hydratrain: preempted: SIGTERM {what}: {shlex.join(r.cmd)}\n" in r.output, r.output[-3000:]
    assert "Traceback" not in r.output and "step 1/" not in log_of(run_dir)[:0 if phase == "final" else None]
    assert not (run_dir / "hydratrain.lock").exists()


def test_a_torchrun_worker_leaves_sigterm_to_its_agent_while_it_composes(monkeypatch):
    """The agent SIGTERMs the workers left after another failed (a config error on rank 0): a worker still composing
    must not report that as a preemption (it exited 75 in torchrun's failure summary)."""
    from hydratrain.checkpoint.preemption import early_guard

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    early_guard()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_rank_ending_with_an_error_ignores_sigterm_until_it_has_logged_why():
    """hold_sigterm (an error unwinding) outlasts the guards that end on the way out; release_sigterm (run.main, once
    the error is logged) gives SIGTERM its default again. The e2e side: test_fail_fast's slow-to-unwind rank 0."""
    from hydratrain.checkpoint.preemption import Preemption, end_guard, guard, hold_sigterm, release_sigterm

    try:
        guard(True, 75)
        hold_sigterm()
        end_guard()
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
        preemption = Preemption(True, 75)
        preemption.arm()
        preemption.close()
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
        release_sigterm()
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        end_guard()
        release_sigterm()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def test_sigterm_while_a_sweep_composes_keeps_its_default_when_save_on_sigterm_is_off(started, request):
    r = finish(started(request)[0], timeout=120)
    assert r.returncode == -signal.SIGTERM and "preempted" not in r.output, r.output[-3000:]


@pytest.mark.slow  # an in-process sweep killed between its jobs
@pytest.mark.parametrize("when", ["term", "term_after"])
def test_sigterm_between_a_local_sweeps_jobs_ends_the_sweep_as_preempted(tmp_path, when):
    """A SIGTERM while Hydra composes a job of an in-process sweep, before the job's guard (``term``), or between
    one job's end and the next one's composition (``term_after``), killed the sweep with 143 and nothing said; now
    the next guard ends the sweep as preempted: its line, checkpoint.preempt_exit_code, no later job."""
    sweep = tmp_path / "s"
    r = finish(start(["-m", "strategy=single", "checkpoint.preempt_exit_code=76", "trainer.max_steps=2",
                      "optim.lr=1e-3,2e-3,3e-3", f"hydra.sweep.dir={sweep}"], script=FAULTY,
                     env={"HT_FAULT_JOBS": f"0:{when}"}, cwd=tmp_path), timeout=180)
    assert r.returncode == 76, r.output[-3000:]
    assert "hydratrain: preempted: SIGTERM during start-up" in r.output and "Traceback" not in r.output, r.output
    assert "sweep job(s) failed" not in r.output, r.output[-3000:]
    assert (sweep / "0" / "results.json").exists() == (when == "term_after")
    assert not (sweep / "1" / "results.json").exists() and not (sweep / "2").exists()


@pytest.mark.parametrize("multirun", [False, True], ids=["run", "sweep"])
def test_sigterm_while_hydra_composes_ends_the_launch_as_preempted(started, request, multirun):
    """A SIGTERM before hydratrain's start-up guard exists (Hydra's import and composition: seconds on a loaded
    machine) used to kill the launch with 143 and nothing said; now it ends as preempted once the run (or the
    sweep) starts, with one line and checkpoint.preempt_exit_code."""
    proc, run_dir, _ = started(request)
    r = finish(proc, timeout=120)
    assert r.returncode == 76, r.output[-3000:]
    said = ("hydratrain: preempted: SIGTERM before the sweep's first job: nothing started" if multirun else
            "hydratrain: preempted: SIGTERM during start-up, before this launch's first step")
    assert said in r.output and "Traceback" not in r.output and "step 1/" not in r.output, r.output[-3000:]
    if not multirun:
        assert not (run_dir / "hydratrain.lock").exists()


def test_ctrl_c_ends_a_run_and_its_sweep_with_one_line_and_status_130(tmp_path):
    """SIGINT to an in-process sweep while job 0 trains: one line (it was a 75-line traceback, 130 lines in a sweep),
    exit status 130, job 1 never starts, and the report records job 0 as stopped by the interrupt."""
    sweep = tmp_path / "s"
    # keep_last=0: on a fast machine step 4's checkpoint was pruned (at step 8) before the poll saw it
    proc = start(["-m", "strategy=single", "trainer.max_steps=100000", "trainer.eval_every_n_steps=0",
                  "checkpoint.every_n_steps=2", "checkpoint.keep_last=0", "optim.lr=1e-3,3e-3",
                  f"hydra.sweep.dir={sweep}"], cwd=tmp_path)
    _wait_for(sweep / "0" / "checkpoints" / "step_00000004", proc, "job 0 did not save step 4")
    os.kill(proc.pid, signal.SIGINT)
    r = finish(proc, timeout=60)
    assert r.returncode == 130, r.output[-3000:]
    assert r.output.count("hydratrain: interrupted (SIGINT, Ctrl-C): stopped without saving") == 1
    assert f"; to resume from the latest checkpoint: {shlex.join([*r.cmd[:-1], 'hydra.sweep.dir=s'])}\n" in r.output
    assert "sweep job(s) failed" not in r.output, r.output[-3000:]  # the interrupt's one line, not a failed sweep's
    assert "Traceback" not in r.output and not (sweep / "1").exists()
    (row,) = report_rows(sweep)
    assert row["status"] == "FAILED" and row["error"].startswith("interrupted (SIGINT, Ctrl-C)"), row
    assert not (sweep / "0" / "hydratrain.lock").exists()


@pytest.mark.slow  # 2 ranks; one rank is covered by the start-up cases above
def test_sigterm_during_start_up_on_two_ranks_ends_both_as_preempted(tmp_path):
    """SIGTERM to both workers (as a scheduler signals every process) while rank 0 is still starting and rank 1
    waits for it in a collective: both exit with the preempt status, one line on the console, and rank 1 does not
    report rank 0's exit as a peer failure."""
    run_dir = tmp_path / "run"
    proc = start(["strategy=ddp"], run_dir, nproc=2, script=FAULTY,
                 env={"HT_FAULT": "sleep", "HT_FAULT_AT": "startup", "HT_FAULT_RANK": "0"})
    _wait_for(run_dir / "fault_rank0_startup", proc, "rank 0 did not reach its data")
    time.sleep(1)
    for pid in _worker_pids(proc.pid).values():
        os.kill(pid, signal.SIGTERM)
    r = finish(proc, timeout=90)
    codes = [int(c) for c in re.findall(r"exitcode\s+:\s*(-?\d+)", r.output)]  # torchrun's failure summary
    assert sorted(codes) == [75, 75], r.output[-3000:]
    said = [ln for ln in r.output.splitlines() if ln.startswith("hydratrain: preempted: SIGTERM during start-up")]
    assert len(said) == 1, r.output[-3000:]  # (torchrun's summary quotes it as each rank's traceback too)
    assert "another rank failed first" not in r.output + log_of(run_dir, 1)
    assert not (run_dir / "hydratrain.lock").exists()
