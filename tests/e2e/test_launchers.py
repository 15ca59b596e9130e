"""Launchers and sweeps whose workers are processes: the torchrun launcher plugin, sweeps inside torchrun ranks, sweep
report and TensorBoard hparams, Optuna with torchrun, multi-node, submitit, elastic restarts, Ctrl-C. Every run is a
tiny model on 2 gloo ranks. (The local launcher, and launcher errors found before any worker starts, are tested in
this process: tests/unit/test_local_launcher.py.)"""
from __future__ import annotations

import os
import shlex
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from helpers import (
    FAULTY,
    ROOT,
    SHARED_RUNS,
    check_optuna_search,
    finish,
    free_port,
    hparams_runs,
    log_of,
    report_rows,
    requires,
    results,
    run,
    sh,
    skip_without,
    start,
    why_missing,
)

# ------------------------------------------------------------------------------------------ torchrun launcher
# the default config (data=python_stdlib, model=gpt_tiny, strategy=fsdp, precision=auto), only made short
SHORT = ["trainer.max_steps=3", "data.batch_size=2", "data.seq_len=64", "trainer.eval_samples=8",
         "trainer.sample_tokens=0"]


@pytest.fixture(scope="module")
def torchrun_sweep(tmp_path_factory, cache_dir) -> Path:
    """``-m launcher=torchrun launcher.nproc_per_node=2 strategy=ddp,fsdp`` on the default config, shortened (job 1
    is the default config itself), with a 16-token sample: one launch for the tests below."""
    launch = tmp_path_factory.mktemp("torchrun_sweep")
    sweep = launch / "sweep"
    run(["-m", "launcher=torchrun", "launcher.nproc_per_node=2", "strategy=ddp,fsdp", *SHORT,
         "trainer.sample_tokens=16", f"hydra.sweep.dir={sweep}"], cwd=launch, fast=False, timeout=400,
        env={"HYDRATRAIN_CACHE": str(cache_dir)}).ok()
    return sweep


@pytest.mark.slow  # a 2-job sweep on 2 torchrun ranks each, about 40 s (the launcher stays in the default suite
# through its SIGTERM and port tests)
def test_torchrun_launcher_sweep_runs_each_job_on_two_fresh_ranks(torchrun_sweep):
    sweep = torchrun_sweep
    for job in ("0", "1"):
        res = results(sweep / job)
        assert res["hparams"]["world_size"] == 2 and res["steps"] == 3
        assert (sweep / job / "train_rank0.log").exists() and (sweep / job / "train_rank1.log").exists()
        assert "process group: backend=gloo world_size=2 rank=0" in (sweep / job / "train_rank0.log").read_text()
    assert [results(sweep / j)["hparams"]["strategy.name"] for j in "01"] == ["ddp", "fsdp"]
    rows = report_rows(sweep)
    assert [r["status"] for r in rows] == ["COMPLETED", "COMPLETED"]
    assert "strategy=ddp" in rows[0]["overrides"] and "strategy=fsdp" in rows[1]["overrides"]
    for r in rows:
        for col in ("train_loss", "eval_loss", "tokens_per_sec", "peak_memory_mb", "mfu"):
            assert float(r[col]) > 0, (col, r)
    assert float(rows[0]["eval_loss"]) == pytest.approx(results(sweep / "0")["eval_loss"], rel=1e-5)
    # TensorBoard's hparams plugin sees the sweep dir as one table: one session (row) per job
    sessions = hparams_runs(sweep)
    assert sorted(run.split("/hparams/")[0] for run in sessions) == ["0/tensorboard", "1/tensorboard"], sessions
    assert all(b"strategy.name" in s for s in sessions.values())


def _is_the_default_config_run(job: Path, world_size: int) -> None:
    """No precision= override: precision=auto is resolved by each rank (never written into the config), so the
    config the launcher hands its ranks passes the checks as composed."""
    res = results(job)
    assert res["steps"] == 3 and res["hparams"]["world_size"] == world_size
    assert res["hparams"]["precision.name"] == "auto" and res["hparams"]["data"] == "python_stdlib"
    saved = OmegaConf.load(job / ".hydra" / "config.yaml")
    assert (saved.precision.name, saved.strategy.name) == ("auto", "fsdp")


@pytest.mark.slow  # shares the 2-job torchrun sweep above
def test_torchrun_launcher_runs_the_default_config_and_writes_weights_and_a_sample(torchrun_sweep):
    """The main job's path on the stdlib corpus (shortened) through the torchrun launcher: the weights file loads
    into a fresh GPT, the sample is printed. (The local launcher: tests/unit/test_local_launcher.py.)"""
    job = torchrun_sweep / "1"
    _is_the_default_config_run(job, 2)
    log0 = log_of(job)
    assert "sample:\ndef " in log0 and "data=python_stdlib" in log0
    from safetensors.torch import load_file

    from hydratrain.models.gpt import GPT, GPTConfig

    state = load_file(str(job / "model.safetensors"))
    model = GPT(GPTConfig())
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied: stored once or twice, both load
    assert state["blocks.0.attn.wq.weight"].shape == (128, 128)


@pytest.mark.slow  # a sibling of it runs by default; CI runs this too (default suite near 4 minutes)
def test_failed_jobs_are_reported_and_the_sweep_goes_on_basic_torchrun(tmp_path):
    """Basic sweeper + torchrun launcher, 4 jobs (nproc 1, 2) x (max_steps -1, 3): the -1 jobs fail the app's job
    check before any worker starts; job 3's rank 1 dies (a crashed rank); job 1 runs on its own 1 rank."""
    sweep = tmp_path / "goes_on"
    r = run(["-m", "launcher=torchrun", "strategy=ddp", "launcher.nproc_per_node=1,2", "trainer.max_steps=-1,3",
             f"hydra.sweep.dir={sweep}"], cwd=tmp_path, script=FAULTY, env={"HT_FAULT_JOBS": "3:kill"})
    rc, out = r.returncode, r.output
    assert rc != 0  # Hydra's basic sweeper raises the first failure once the batch is done
    rows = report_rows(sweep)
    assert [r["status"] for r in rows] == ["FAILED", "COMPLETED", "FAILED", "FAILED"], (rows, out[-3000:])
    for r in rows[0], rows[2]:
        assert r["error"] == "ConfigError: trainer.max_steps=-1: must be finite and > 0", r
    assert not (sweep / "0" / ".hydra").exists()  # rejected in the launcher: no worker ran
    assert "launcher.nproc_per_node=2 trainer.max_steps=3" in rows[3]["overrides"]
    assert "job #3: rank 1 failed" in rows[3]["error"] and "SIGKILL" in rows[3]["error"], rows[3]
    assert results(sweep / "1")["steps"] == 3 and results(sweep / "1")["hparams"]["world_size"] == 1
    assert "ConfigError: trainer.max_steps=-1: must be finite and > 0" in out


@pytest.mark.slow  # a 2-job sweep of worker processes: ~25 s under torchrun, ~40 s under submitit on 2 busy cores
@pytest.mark.parametrize("launcher", ["torchrun", "submitit_local"])
def test_a_sweep_whose_last_job_completes_after_a_failed_one_ends_with_the_report_and_its_line(tmp_path, launcher):
    """Job 0 diverges, job 1 (the last) completes, each in processes of the launcher's own. The launching process saw
    no job end after the last one, and Hydra's basic sweeper then raised job 0's failure: the output ended with
    Hydra's error (its HYDRA_FULL_ERROR hint, or its traceback), no report, no closing line. Now the
    report and the closing line come last, once, with status 1; under torchrun the launcher's process says that job
    0 failed once (it said it twice)."""
    if launcher == "submitit_local":
        skip_without("slurm")
    sweep = tmp_path / "sweep"
    one_rank = {"torchrun": "launcher.nproc_per_node=1", "submitit_local": "launcher.tasks_per_node=1"}[launcher]
    r = run(["-m", f"launcher={launcher}", one_rank, "strategy=ddp", "trainer.max_steps=2",
             "trainer.eval_every_n_steps=0", "optim.lr=1e-3,2e-3", f"hydra.sweep.dir={sweep}"], cwd=tmp_path,
            script=FAULTY, env={"HT_FAULT_JOBS": "0:raise"}, timeout=400)
    rows = report_rows(sweep)
    assert [row["status"] for row in rows] == ["FAILED", "COMPLETED"], (rows, r.output[-3000:])
    assert r.returncode == 1, r.output[-3000:]
    lines = r.output.rstrip("\n").splitlines()
    assert lines[-1] == (f"hydratrain: 1 of 2 sweep job(s) failed (see {sweep / 'sweep_report.md'}); first: job 0 "
                         f"({rows[0]['overrides']}): {rows[0]['error']}"), r.output[-3000:]
    assert "FloatingPointError: loss diverged (test)" in rows[0]["error"]
    report = max(i for i, line in enumerate(lines) if "sweep report: " in line)
    hydras = max(i for i, line in enumerate(lines) if line.startswith("Error executing job with overrides: "))
    assert hydras < report and lines[report + 1].startswith("| job | overrides | status |"), lines[hydras:]
    assert [line[:4] for line in lines[report + 3:]] == ["| 0 ", "| 1 ", "", "hydr"], lines[report:]  # table, line
    assert r.output.count("sweep job(s) failed") == 1 and r.output.count("sweep report: ") == 1, r.output[-3000:]
    if launcher == "torchrun":
        assert r.output.count("job #0 failed: LaunchError") == 1, r.output[-3000:]


@pytest.mark.slow  # one worker's run, about 15 s
def test_one_run_under_the_torchrun_launcher_ends_as_a_run_with_its_workers_line_and_status(tmp_path):
    """``launcher=torchrun`` without ``-m`` is one run that the launcher makes a sweep of one job: a worker that
    diverged ended the launch with its line said three times (the worker's, "the sweep goes on", the closing line),
    the sweep report's table and status 1. It now ends as the run under ``torchrun`` or in one process does: the
    worker's one line, once, and its status (4); the sweep dir still records the job."""
    sweep = tmp_path / "sweep"
    r = run(["launcher=torchrun", "launcher.nproc_per_node=1", "strategy=ddp", "optim.lr=1e9", "scheduler=constant",
             "scheduler.warmup_steps=0", "trainer.max_steps=3", "trainer.eval_every_n_steps=0",
             f"hydra.sweep.dir={sweep}"], cwd=tmp_path, timeout=300)
    assert r.returncode == 4, r.output[-3000:]
    ours = [line for line in r.output.splitlines() if "diverged" in line]
    assert len(ours) == 1 and ours[0].startswith("hydratrain: diverged: non-finite "), r.output[-3000:]
    assert "sweep report" not in r.output and "sweep job(s) failed" not in r.output, r.output[-3000:]
    assert [row["status"] for row in report_rows(sweep)] == ["FAILED"]


@pytest.mark.slow  # ~40-70 s on 2 busy cores
def test_two_sweeps_at_once_get_their_own_ports(tmp_path):
    procs = [start(["launcher=torchrun", "launcher.nproc_per_node=2", "strategy=ddp",
                    f"hydra.sweep.dir={tmp_path / name}"], cwd=tmp_path) for name in ("a", "b")]
    outs = [finish(p, 300) for p in procs]
    for r, name in zip(outs, "ab"):
        r.ok()
        assert results(tmp_path / name / "0")["hparams"]["world_size"] == 2


def test_sigterm_while_the_torchrun_launcher_prepares_a_job_ends_the_sweep_as_preempted(tmp_path):
    """A SIGTERM to the launching process after the sweep started but before the agent's own handlers exist (the
    job's composition, its check, the rendezvous) killed it with 143 and nothing said; now it ends the sweep with one
    line and checkpoint.preempt_exit_code, no worker started, the job recorded as stopped."""
    sweep = tmp_path / "s"
    r = finish(start(["-m", "launcher=torchrun", "launcher.nproc_per_node=1", "strategy=ddp",
                      "checkpoint.preempt_exit_code=76", "hydra.launcher.job_check=__main__.sigterm_self",
                      "optim.lr=1e-3,3e-3", f"hydra.sweep.dir={sweep}"], script=FAULTY, cwd=tmp_path), 120)
    assert r.returncode == 76, r.output[-3000:]
    assert "TorchrunLauncher: sweep stopped: job #0: stopped by SIGTERM, before its workers started" in r.output
    assert r.output.rstrip("\n").splitlines()[-1].startswith("TorchrunLauncher: sweep stopped: ")  # its line last
    assert "sweep job(s) failed" not in r.output and "the sweep goes on" not in r.output, r.output[-3000:]
    assert "Traceback" not in r.output and not (sweep / "0" / "train_rank0.log").exists() \
        and not (sweep / "1").exists(), r.output[-3000:]
    (row,) = report_rows(sweep)
    assert row["status"] == "FAILED" and "stopped by SIGTERM" in row["error"], row


def test_ctrl_c_while_the_torchrun_launcher_prepares_one_run_is_one_line_and_130(tmp_path):
    """Ctrl-C to ``python train.py launcher=torchrun ...`` before its workers started (the job's check) printed a
    KeyboardInterrupt traceback and no line; one run now ends as a run does, with one line and 130."""
    r = finish(start(["launcher=torchrun", "launcher.nproc_per_node=1", "strategy=ddp",
                      "hydra.launcher.job_check=__main__.sigint_self", f"hydra.sweep.dir={tmp_path / 's'}"],
                     script=FAULTY, cwd=tmp_path), 120)
    ours = [line for line in r.output.splitlines() if line.startswith(("hydratrain: ", "TorchrunLauncher: "))]
    assert r.returncode == 130 and "Traceback" not in r.output and len(ours) == 1, r.output[-3000:]
    assert ours[0].startswith("hydratrain: interrupted: SIGINT before the run's workers started: nothing was "
                              "trained; to go on: "), ours


@pytest.mark.slow  # two ranks train to step 3
def test_a_rank_that_fails_is_the_one_run_s_status_not_the_peer_it_stopped(tmp_path):
    """Rank 1 runs out of memory under ``launcher=torchrun``: rank 0 stops with 5 (another rank failed first), and
    the launch ended with that 5: rank 0 left first (no wait for the failed rank in a sweep's job), and the agent's
    first failure, stamped to the second, ties to the lowest rank. Now rank 1's 6, and its record in the sweep dir."""
    sweep = tmp_path / "s"
    r = run(["launcher=torchrun", "launcher.nproc_per_node=2", "strategy=ddp", "trainer.max_steps=5",
             f"hydra.sweep.dir={sweep}"], script=FAULTY, env={"HT_FAULT": "oom", "HT_FAULT_STEP": "3"}, cwd=tmp_path,
            timeout=300)
    assert r.returncode == 6, r.output[-3000:]
    (row,) = report_rows(sweep)
    assert "rank 1 failed" in row["error"] and "OutOfMemoryError" in row["error"], row


@pytest.mark.slow
@pytest.mark.parametrize("sig,jobs", [(signal.SIGINT, "optim.lr=1e-3,3e-3"), (signal.SIGTERM, "optim.lr=1e-3,3e-3"),
                                      (signal.SIGTERM, "optim.lr=1e-3")])
def test_a_signal_to_the_launching_process_ends_the_sweep(tmp_path, sig, jobs):
    """Ctrl-C or SIGTERM to the launching process while job 0 trains: the agent passes it on to the workers (which
    save on SIGTERM), job 1 never starts, and the sweep ends at once with one line, status 130 or
    checkpoint.preempt_exit_code (it ended with torch's SignalException traceback and status 1, so a batch script
    could not tell a preemption), job 0 recorded as stopped. The same command resumes the sweep. With one job (the
    README's ``python train.py launcher=torchrun ...`` for batch scripts that requeue on 75) the job was the last, and
    the end-of-sweep summary exited 1 first."""
    sweep = tmp_path / "s"
    proc = start([*(["-m"] if "," in jobs else []), "launcher=torchrun", "launcher.nproc_per_node=1", "strategy=ddp",
                  "trainer.max_steps=100000", "trainer.eval_every_n_steps=0", jobs, f"hydra.sweep.dir={sweep}"],
                 cwd=tmp_path)
    deadline = time.time() + 180
    while not (sweep / "0" / "tensorboard").exists():  # job 0's rank 0 is training
        assert proc.poll() is None and time.time() < deadline, finish(proc, 10).output[-3000:]
        time.sleep(0.5)
    os.kill(proc.pid, sig)
    t0 = time.time()
    r = finish(proc, 90)
    assert r.returncode == (130 if sig == signal.SIGINT else 75) and time.time() - t0 < 60, r.output[-3000:]
    if "," in jobs:
        assert f"TorchrunLauncher: sweep stopped: job #0: stopped by {sig.name}" in r.output
        assert ("to resume the sweep (each job continues from its own run dir): "
                f"{shlex.join([*r.cmd[:-1], 'hydra.sweep.dir=s'])} (exit status") in r.output, r.output[-3000:]
    else:  # one run: it ends as a run, with its worker's line (the command that resumes it), said once
        assert "TorchrunLauncher: sweep stopped" not in r.output, r.output[-3000:]
        assert r.output.count("to resume: ") == 1 and "hydra.sweep.dir=s" in r.output, r.output[-3000:]
    assert "sweep job(s) failed" not in r.output, r.output[-3000:]  # the stop's one line, not a failed sweep's
    assert "SignalException" not in r.output and not (sweep / "1").exists()
    (row,) = report_rows(sweep)
    assert row["status"] == "FAILED" and f"stopped by {sig.name}" in row["error"], row
    if sig == signal.SIGTERM:
        assert list((sweep / "0" / "checkpoints").glob("step_*")), "the workers did not save on SIGTERM"
    gone_by = time.time() + 15  # a worker stopped by the launcher may take seconds to exit on a loaded machine
    while time.time() < gone_by:
        try:
            os.killpg(proc.pid, 0)  # the launcher's process group: its workers, if any outlived it
        except ProcessLookupError:
            return
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    raise AssertionError("a worker outlived the interrupted sweep by 15 s")


@pytest.mark.slow  # ~40 s, mostly waiting
def test_node_that_cannot_reach_node0_gives_up_with_a_clear_error(tmp_path):
    r = run(["launcher=torchrun", "strategy=ddp", "launcher.nnodes=2", "launcher.node_rank=1",
             "launcher.nproc_per_node=1", f"launcher.rdzv_endpoint=127.0.0.1:{free_port()}", "launcher.rdzv_timeout=10",
             f"hydra.sweep.dir={tmp_path / 's'}"], cwd=tmp_path, timeout=150)
    rc, out = r.returncode, r.output
    assert rc != 0 and "no rendezvous with all 2 node(s) within hydra.launcher.rdzv_timeout=10 s" in out, out[-3000:]


def test_sweep_inside_each_torchrun_rank(shared_sweep):
    """``torchrun ... train.py -m +testrun=...``: the session's shared sweep (helpers.SHARED_RUNS) is one; every job
    ran on both ranks with its own overrides and completed."""
    rows = report_rows(shared_sweep.dir)
    assert [r["status"] for r in rows] == ["COMPLETED"] * len(SHARED_RUNS), rows
    for (name, overrides), row in zip(SHARED_RUNS.items(), rows):
        hparams = results(shared_sweep.job(name))["hparams"]
        assert f"+testrun={name}" in row["overrides"] and hparams["world_size"] == 2
        assert [hparams["strategy.name"], hparams["precision.name"]] == \
            [o.split("=")[1] for o in overrides if o.startswith(("strategy=", "precision="))]


@pytest.mark.slow  # ~40-70 s on 2 busy cores
def test_elastic_restart_after_a_killed_worker_resumes_from_its_checkpoint(tmp_path):
    """Job 0 (max_restarts=0): rank 1 is SIGKILLed at step 3, the job fails and is reported; job 1
    (max_restarts=1): the agent restarts both workers, which resume from the step-2 checkpoint in the same run dir
    and complete the run."""
    sweep = tmp_path / "sweep"
    r = run(["-m", "launcher=torchrun", "launcher.nproc_per_node=2", "strategy=ddp", "trainer.max_steps=6",
             "checkpoint.every_n_steps=2", "launcher.max_restarts=0,1", f"hydra.sweep.dir={sweep}"], cwd=tmp_path,
            script=FAULTY, env={"HT_FAULT": "kill", "HT_FAULT_STEP": "3", "HT_FAULT_RANK": "1"})
    rc, out = r.returncode, r.output
    rows = report_rows(sweep)
    assert [r["status"] for r in rows] == ["FAILED", "COMPLETED"], (rows, out[-3000:])
    assert "rank 1" in rows[0]["error"] and "SIGKILL" in rows[0]["error"]
    assert (sweep / "1" / "fault_rank1_step3").exists()
    assert results(sweep / "1")["steps"] == 6 and results(sweep / "1")["hparams"]["world_size"] == 2
    log0 = (sweep / "1" / "train_rank0.log").read_text()
    assert "resumed from" in log0 and "step_00000002: step 2 " in log0, log0[-3000:]
    assert rc != 0  # the sweep as a whole reports job 0's failure


# ------------------------------------------------------------------------------------------------ multi-node
def _one_run_dir_with_both_ranks(base: Path) -> Path:
    dirs = sorted(p.parent for p in base.rglob("results.json"))
    assert len(dirs) == 1, dirs
    assert {p.name for p in dirs[0].iterdir()} >= {".hydra", "tensorboard"}
    logs = sorted(p.name for p in dirs[0].glob("train_rank*.log"))
    assert logs == ["train_rank0.log", "train_rank1.log"], logs
    assert results(dirs[0])["hparams"]["world_size"] == 2
    assert "world_size=2 rank=1" in (dirs[0] / "train_rank1.log").read_text()
    return dirs[0]


@pytest.mark.slow  # 2 agents + 2 workers; one node's ranks agreeing on the run dir: the shared sweep (test_train.py)
def test_two_nodes_with_torchrun_cli_share_one_group_and_run_dir(tmp_path):
    """Two torchrun agents (two "nodes" of 1 rank each) and no hydra.run.dir: both ranks agree on the time-stamped
    run dir through the rendezvous store."""
    port = free_port()
    procs = [start(["strategy=ddp"], cwd=tmp_path, torchrun=["--nnodes", "2", "--node_rank", str(r),
                                                            "--nproc_per_node", "1", "--rdzv_backend", "c10d",
                                                            "--rdzv_endpoint", f"127.0.0.1:{port}"]) for r in (0, 1)]
    for p in procs:
        finish(p, 240).ok()
    _one_run_dir_with_both_ranks(tmp_path / "outputs")


@pytest.mark.slow  # ~40-70 s on 2 busy cores
def test_two_nodes_with_the_launcher_share_one_group_and_run_dir(tmp_path):
    port = free_port()
    procs = [start(["launcher=torchrun", "launcher.nnodes=2", f"launcher.node_rank={r}", "launcher.nproc_per_node=1",
                    f"launcher.rdzv_endpoint=127.0.0.1:{port}", "strategy=ddp"], cwd=tmp_path) for r in (0, 1)]
    for p in procs:
        finish(p, 240).ok()
    _one_run_dir_with_both_ranks(tmp_path / "multirun")


# ------------------------------------------------------------------------------------------------ submitit
@pytest.mark.slow  # a sibling of it runs by default; CI runs this too (default suite near 4 minutes)
@requires("slurm")
def test_submitit_local_runs_the_default_config_as_two_tasks_of_one_run(tmp_path, cache_dir):
    sweep = tmp_path / "sweep"
    run(["launcher=submitit_local", *SHORT, f"hydra.sweep.dir={sweep}"], fast=False, cwd=tmp_path, timeout=400,
        env={"HYDRATRAIN_CACHE": str(cache_dir)}).ok()
    _is_the_default_config_run(_one_run_dir_with_both_ranks(sweep), 2)
    assert report_rows(sweep)[0]["status"] == "COMPLETED"


@pytest.mark.slow  # ~10 s: one job that stops in its checks
@requires("slurm")
def test_submitit_local_job_error_reaches_the_console_as_its_one_line(tmp_path):
    """submitit pickles the job's exception back to the launching process: the ConfigError's own line is printed,
    not a TypeError from unpickling it."""
    r = run(["launcher=submitit_local", "strategy=ddp", "trainer.max_steps=3", "optim.lr=-1",
             f"hydra.sweep.dir={tmp_path / 'sweep'}"], cwd=tmp_path, timeout=300)
    assert r.returncode != 0 and "optim.lr=-1.0: must be finite and > 0" in r.output, r.output[-3000:]
    assert "TypeError" not in r.output and "Traceback" not in r.output, r.output[-3000:]


# ------------------------------------------------------------------------------------------------ optuna
@pytest.mark.slow  # 4 trials x 2 ranks (~20 s); the local search (in-process) and the basic sweeper's torchrun jobs
# cover its parts in the default selection
@requires("optuna")
def test_optuna_torchrun_search_goes_on_past_failed_trials(tmp_path):
    """Optuna + torchrun launcher (2 ranks): a config error on a sampled value (trial 2 with the preset's seed,
    rejected by the job check in the launcher), a crashed rank (job 0), a diverged run (job 3); the study still runs
    all 4 trials."""
    sweep = tmp_path / "sweep"
    r = run(["+hparams_search=lr_optuna", "hydra.sweeper.n_trials=4", "launcher=torchrun", "launcher.nproc_per_node=2",
             "strategy=ddp", "trainer.max_steps=4", "optim.weight_decay=interval(-0.2,0.2)",
             f"hydra.sweep.dir={sweep}"], cwd=tmp_path, timeout=400, script=FAULTY,
            env={"HT_FAULT_JOBS": "0:kill,3:raise"})
    check_optuna_search(r.returncode, r.output, sweep, 4, {0: "kill", 3: "raise"},
                        ["ConfigError", "SIGKILL", "FloatingPointError"])


# ------------------------------------------------------------------------------------------------------ slow
@pytest.mark.slow
def test_a_sweep_of_precision_by_strategy_completes_every_job_on_two_ranks(tmp_path):
    sweep = tmp_path / "sweep"
    run(["-m", "launcher=torchrun", "launcher.nproc_per_node=2", "precision=fp32,bf16", "strategy=ddp,fsdp",
         "trainer.max_steps=4", f"hydra.sweep.dir={sweep}"], cwd=tmp_path, timeout=900).ok()
    rows = report_rows(sweep)
    assert len(rows) == 4 and all(r["status"] == "COMPLETED" for r in rows)
    assert len(hparams_runs(sweep)) == 4
    # the report's chart, drawn at the sweep's end when matplotlib is installed (the report extra)
    assert (sweep / "sweep_report.png").exists() == (not why_missing("report"))
    if (sweep / "sweep_report.png").exists():
        import matplotlib.image  # (the report extra)

        assert matplotlib.image.imread(sweep / "sweep_report.png").size > 0
        assert "](sweep_report.png)" in (sweep / "sweep_report.md").read_text()


def test_plugin_is_discovered_from_a_normal_install(tmp_path):
    """Editable installs can hide namespace plugins from Hydra's scan: check a wheel, imported without site .pth."""
    import site
    import zipfile

    source = tmp_path / "source"  # a build writes build/ and *.egg-info into the tree it builds: a copy, not the clone
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", ".ci-venv", ".venv", "build", "*.egg-info",
                                                                 "outputs", "multirun", "runs", "__pycache__"))
    sh([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(source)],
       tmp_path).ok()
    wheel = next(tmp_path.glob("hydratrain-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "hydra_plugins/hydratrain_launcher/torchrun_launcher.py" in names
    assert "hydra_plugins/__init__.py" not in names
    zipfile.ZipFile(wheel).extractall(tmp_path / "installed")
    r = sh([sys.executable, "-S", "-c", "import hydratrain, hydra_plugins.hydratrain_launcher as p; "
            "print(p.__file__); from hydra.core.plugins import Plugins; from hydra.plugins.launcher import "
            "Launcher; print([c.__name__ for c in Plugins.instance().discover(Launcher)])"], tmp_path, timeout=120,
           env={"PYTHONPATH": f"{tmp_path / 'installed'}:{site.getsitepackages()[0]}"})
    rc, out = r.returncode, r.output
    assert rc == 0 and "TorchrunLauncher" in out and str(tmp_path / "installed") in out, out
