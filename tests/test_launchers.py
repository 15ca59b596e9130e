"""Launchers and sweeps: the torchrun launcher plugin, sweeps inside torchrun ranks, ports, sweep report and
TensorBoard hparams, Optuna, multi-node, submitit, elastic restarts. Every run is a tiny model on 2 gloo ranks."""
from __future__ import annotations

import os
import signal
import socket
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from _launch_utils import (FAIL_TASK, FAST, ROOT, TRAIN, finish, free_port, hparams_runs, report_rows, results, run,
                           start, torchrun, train)


# ------------------------------------------------------------------------------------------------ config
def _compose(overrides):
    from hydratrain.config import register_configs
    from hydratrain.dist.run_dir import register_resolvers

    register_configs()
    register_resolvers()
    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
        return compose("train", overrides=overrides, return_hydra_config=True)


@pytest.mark.parametrize("overrides, key", [
    (["launcher=submitit_local", "launcher.gpus_per_node=2", "launcher.tasks_per_node=1"], "launcher.tasks_per_node"),
    (["launcher=slurm", "launcher.gpus_per_node=8", "launcher.tasks_per_node=4"], "launcher.tasks_per_node"),
    (["launcher=torchrun", "launcher.nnodes=2"], "launcher.rdzv_endpoint"),
    (["launcher=torchrun", "launcher.nnodes=2", "launcher.node_rank=2", "launcher.rdzv_endpoint=h:1"],
     "launcher.node_rank"),
    (["launcher=torchrun", "launcher.rdzv_endpoint=nohostport"], "launcher.rdzv_endpoint"),
    (["launcher=torchrun", "strategy=single"], "strategy.name"),
    (["launcher=torchrun", "launcher.max_restarts=-1"], "launcher.max_restarts"),
])
def test_bad_launcher_config_is_one_line_error_naming_the_key(overrides, key):
    from hydratrain.config import ConfigError, validate

    cfg = _compose(overrides)
    with pytest.raises(ConfigError) as err:
        validate(cfg)  # the checks main() runs before any process group
    assert err.value.key == key and "\n" not in str(err.value)


def test_presets_select_the_hydra_launcher_and_multirun():
    for name, target in [("torchrun", "hydratrain_launcher.torchrun_launcher.TorchrunLauncher"),
                         ("slurm", "hydra_submitit_launcher.submitit_launcher.SlurmLauncher"),
                         ("submitit_local", "hydra_submitit_launcher.submitit_launcher.LocalLauncher")]:
        cfg = _compose([f"launcher={name}", "launcher.gpus_per_node=4"] if name == "slurm" else [f"launcher={name}"])
        assert cfg.hydra.launcher._target_.endswith(target)
        assert str(cfg.hydra.mode) == "RunMode.MULTIRUN"
        assert cfg.launcher.name == name
    # the user-facing launcher.* keys are mapped onto the plugin's own node, which knows no hydratrain
    torchrun = _compose(["launcher=torchrun", "launcher.nproc_per_node=3", "launcher.nnodes=2", "launcher.node_rank=1",
                         "launcher.rdzv_endpoint=h:29500", "launcher.rdzv_timeout=30", "launcher.max_restarts=2"])
    h = torchrun.hydra.launcher
    assert (h.nproc_per_node, h.nnodes, h.node_rank, h.rdzv_endpoint, h.rdzv_timeout, h.max_restarts) == \
        (3, 2, 1, "h:29500", 30, 2)
    assert h.job_check == "hydratrain.config.validate"
    slurm = _compose(["launcher=slurm", "launcher.nodes=2", "launcher.gpus_per_node=4", "launcher.partition=gpu",
                      "launcher.account=acct", "launcher.timeout_min=30"])
    h = slurm.hydra.launcher
    assert (h.nodes, h.tasks_per_node, h.gpus_per_node, h.partition, h.account, h.timeout_min) == \
        (2, 4, 4, "gpu", "acct", 30)


def test_plugin_is_discovered(tmp_path):
    rc, out = run([sys.executable, TRAIN, "--info", "plugins"], tmp_path, timeout=120)
    assert rc == 0 and "TorchrunLauncher" in out, out


# ------------------------------------------------------------------------------------------ torchrun launcher
def test_torchrun_launcher_sweep_runs_each_job_on_two_fresh_ranks(tmp_path):
    sweep = tmp_path / "sweep"
    rc, out = train(["-m", "launcher=torchrun", "launcher.nproc_per_node=2", "strategy=ddp,fsdp",
                     f"hydra.sweep.dir={sweep}"], tmp_path, timeout=240)
    assert rc == 0, out[-4000:]
    for job in ("0", "1"):
        res = results(sweep / job)
        assert res["hparams"]["world_size"] == 2 and res["steps"] == 10
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
    assert sorted(sessions) == ["0/tensorboard", "1/tensorboard"]
    assert all(b"strategy.name" in s for s in sessions.values())


def test_failed_jobs_are_reported_and_the_sweep_goes_on_basic_torchrun(tmp_path):
    """Basic sweeper + torchrun launcher, 4 jobs (nproc 1, 2) x (max_steps -1, 3): the -1 jobs fail the app's job
    check before any worker starts; job 3's rank 1 dies (a crashed rank); job 1 runs on its own 1 rank."""
    sweep = tmp_path / "goes_on"
    rc, out = train(["-m", "launcher=torchrun", "strategy=ddp", "launcher.nproc_per_node=1,2", "trainer.max_steps=-1,3",
                     f"hydra.sweep.dir={sweep}"], tmp_path, timeout=300, script=FAIL_TASK,
                    env={"HYDRATRAIN_TEST_FAIL": "3:kill"})
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


def test_failed_jobs_are_reported_and_the_sweep_goes_on_basic_local(tmp_path):
    """Basic sweeper + local launcher (jobs in-process): a config error and a diverged run (the task raising)."""
    sweep = tmp_path / "local"
    rc, out = train(["-m", "strategy=single", "trainer.max_steps=-1,3,4", f"hydra.sweep.dir={sweep}"], tmp_path,
                    timeout=300, script=FAIL_TASK, env={"HYDRATRAIN_TEST_FAIL": "2:raise"})
    assert rc != 0
    rows = report_rows(sweep)
    assert [r["status"] for r in rows] == ["FAILED", "COMPLETED", "FAILED"], (rows, out[-3000:])
    assert rows[0]["error"] == "ConfigError: trainer.max_steps=-1: must be finite and > 0"
    assert rows[2]["error"] == "FloatingPointError: loss diverged (test)"
    assert results(sweep / "1")["steps"] == 3


def test_stop_on_failure_ends_the_sweep(tmp_path):
    sweep = tmp_path / "stops"
    rc, out = train(["-m", "launcher=torchrun", "launcher.nproc_per_node=1", "strategy=ddp",
                     "hydra.launcher.stop_on_failure=true", "trainer.max_steps=-1,3", f"hydra.sweep.dir={sweep}"],
                    tmp_path, timeout=240)
    assert rc != 0 and [r["status"] for r in report_rows(sweep)] == ["FAILED"]
    assert not (sweep / "1").exists()


@pytest.mark.slow  # ~40-70 s on 2 busy cores
def test_two_sweeps_at_once_get_their_own_ports(tmp_path):
    procs = [start([sys.executable, TRAIN, "+debug=fast", "precision=fp32", "device=cpu", "logger.peak_flops=1e11",
                    "launcher=torchrun", "launcher.nproc_per_node=2", "strategy=ddp",
                    f"hydra.sweep.dir={tmp_path / name}"], tmp_path) for name in ("a", "b")]
    outs = [finish(p, 300) for p in procs]
    for (rc, out), name in zip(outs, "ab"):
        assert rc == 0, out[-3000:]
        assert results(tmp_path / name / "0")["hparams"]["world_size"] == 2


def test_ctrl_c_ends_the_sweep(tmp_path):
    """SIGINT to the launching process while job 0 trains: its workers are stopped, job 1 never starts, the sweep
    exits non-zero at once instead of recording job 0 as failed and going on."""
    sweep = tmp_path / "s"
    proc = start([sys.executable, TRAIN, "-m", *FAST, "launcher=torchrun", "launcher.nproc_per_node=1",
                  "strategy=ddp", "trainer.max_steps=100000", "trainer.eval_every_n_steps=0", "optim.lr=1e-3,3e-3",
                  f"hydra.sweep.dir={sweep}"], tmp_path)
    deadline = time.time() + 180
    while not (sweep / "0" / "tensorboard").exists():  # job 0's rank 0 is training
        assert proc.poll() is None and time.time() < deadline, finish(proc, 10)[1][-3000:]
        time.sleep(0.5)
    os.kill(proc.pid, signal.SIGINT)
    t0 = time.time()
    rc, out = finish(proc, 90)
    assert rc != 0 and time.time() - t0 < 60, out[-3000:]
    assert not (sweep / "1").exists()
    assert not (sweep / "0" / "status.json").exists()  # interrupted, not a failed job
    time.sleep(2)
    try:
        os.killpg(proc.pid, 0)  # the launcher's process group: its workers, if any outlived it
    except ProcessLookupError:
        return
    os.killpg(proc.pid, signal.SIGKILL)
    raise AssertionError("a worker outlived the interrupted sweep")


def test_port_that_cannot_be_had_is_a_clear_error_not_a_hang(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t0 = time.time()
        rc, out = train(["launcher=torchrun", "strategy=ddp", f"launcher.rdzv_endpoint=127.0.0.1:{port}",
                         f"hydra.sweep.dir={tmp_path / 's'}"], tmp_path, timeout=120)
    assert rc != 0 and time.time() - t0 < 60
    assert f"hydra.launcher.rdzv_endpoint=127.0.0.1:{port}: node 0 cannot host the rendezvous store" in out, out[-3000:]
    assert report_rows(tmp_path / "s")[0]["status"] == "FAILED"


@pytest.mark.slow  # ~40 s, mostly waiting
def test_node_that_cannot_reach_node0_gives_up_with_a_clear_error(tmp_path):
    rc, out = train(["launcher=torchrun", "strategy=ddp", "launcher.nnodes=2", "launcher.node_rank=1",
                     "launcher.nproc_per_node=1", f"launcher.rdzv_endpoint=127.0.0.1:{free_port()}",
                     "launcher.rdzv_timeout=10", f"hydra.sweep.dir={tmp_path / 's'}"], tmp_path, timeout=150)
    assert rc != 0 and "no rendezvous with all 2 node(s) within hydra.launcher.rdzv_timeout=10 s" in out, out[-3000:]


def test_sweep_inside_each_torchrun_rank(tmp_path):
    sweep = tmp_path / "sweep"
    rc, out = finish(torchrun(["--standalone", "--nproc_per_node", "2"],
                              ["-m", "strategy=ddp", "optim.lr=1e-3,3e-3", f"hydra.sweep.dir={sweep}"], tmp_path), 240)
    assert rc == 0, out[-4000:]
    assert [results(sweep / j)["hparams"]["optim.lr"] for j in "01"] == [1e-3, 3e-3]
    assert all(results(sweep / j)["hparams"]["world_size"] == 2 for j in "01")
    assert [r["status"] for r in report_rows(sweep)] == ["COMPLETED", "COMPLETED"]


@pytest.mark.slow  # ~40-70 s on 2 busy cores
def test_elastic_restart_after_a_killed_worker_resumes_from_its_checkpoint(tmp_path, monkeypatch):
    """Job 0 (max_restarts=0): rank 1 is SIGKILLed at step 3, the job fails and is reported; job 1
    (max_restarts=1): the agent restarts both workers, which resume from the step-2 checkpoint in the same run dir
    and complete the run."""
    for key, value in {"HT_FAULT": "kill", "HT_FAULT_STEP": "3", "HT_FAULT_RANK": "1"}.items():
        monkeypatch.setenv(key, value)
    sweep = tmp_path / "sweep"
    rc, out = train(["-m", "launcher=torchrun", "launcher.nproc_per_node=2", "strategy=ddp", "trainer.max_steps=6",
                     "checkpoint.every_n_steps=2", "launcher.max_restarts=0,1", f"hydra.sweep.dir={sweep}"],
                    tmp_path, timeout=300, script=str(ROOT / "tests" / "scripts" / "faulty_train.py"))
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
    logs = sorted(p.name for p in dirs[0].glob("train_rank*.log"))
    assert logs == ["train_rank0.log", "train_rank1.log"], logs
    assert results(dirs[0])["hparams"]["world_size"] == 2
    assert "world_size=2 rank=1" in (dirs[0] / "train_rank1.log").read_text()
    return dirs[0]


def test_two_nodes_with_torchrun_cli_share_one_group_and_run_dir(tmp_path):
    port = free_port()
    procs = [torchrun(["--nnodes", "2", "--node_rank", str(r), "--nproc_per_node", "1", "--rdzv_backend", "c10d",
                       "--rdzv_endpoint", f"127.0.0.1:{port}"], ["strategy=ddp"], tmp_path) for r in (0, 1)]
    for p in procs:
        rc, out = finish(p, 240)
        assert rc == 0, out[-3000:]
    _one_run_dir_with_both_ranks(tmp_path / "outputs")


@pytest.mark.slow  # ~40-70 s on 2 busy cores
def test_two_nodes_with_the_launcher_share_one_group_and_run_dir(tmp_path):
    port = free_port()
    procs = [start([sys.executable, TRAIN, "+debug=fast", "precision=fp32", "device=cpu", "logger.peak_flops=1e11",
                    "launcher=torchrun", "launcher.nnodes=2", f"launcher.node_rank={r}", "launcher.nproc_per_node=1",
                    f"launcher.rdzv_endpoint=127.0.0.1:{port}", "strategy=ddp"], tmp_path) for r in (0, 1)]
    for p in procs:
        rc, out = finish(p, 240)
        assert rc == 0, out[-3000:]
    _one_run_dir_with_both_ranks(tmp_path / "multirun")


# ----------------------------------------------------------------------------------------- submitit, optuna
def test_submitit_local_runs_two_tasks_as_one_run(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    sweep = tmp_path / "sweep"
    rc, out = train(["launcher=submitit_local", "strategy=ddp", f"hydra.sweep.dir={sweep}"], tmp_path, timeout=240)
    assert rc == 0, out[-3000:]
    _one_run_dir_with_both_ranks(sweep)
    assert report_rows(sweep)[0]["status"] == "COMPLETED"


def test_submitit_gpu_task_mismatch_fails_before_submitting(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    rc, out = train(["launcher=submitit_local", "launcher.gpus_per_node=2", "launcher.tasks_per_node=1",
                     f"hydra.sweep.dir={tmp_path / 's'}"], tmp_path, timeout=120)
    assert rc != 0
    assert "config error: launcher.tasks_per_node=1: must equal launcher.gpus_per_node=2" in out
    assert not (tmp_path / "s" / ".submitit").exists()


def test_optuna_search_three_trials_minimises_eval_loss(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    sweep = tmp_path / "sweep"
    rc, out = train(["+hparams_search=lr_optuna", "hydra.sweeper.n_trials=3", "strategy=single",
                     f"hydra.sweep.dir={sweep}"], tmp_path, timeout=240)
    assert rc == 0, out[-3000:]
    rows = report_rows(sweep)
    assert len(rows) == 3 and all(r["status"] == "COMPLETED" for r in rows)
    best = min(float(r["eval_loss"]) for r in rows)
    assert f"Best value: {best:.4f}"[:16] in out
    assert all("optim.lr=" in r["overrides"] for r in rows)


def _expected_optuna_rows(rows, fail_plan):
    """What each trial of a search over ``optim.weight_decay=interval(-0.2,0.2)`` must have come to: a config error
    for a sampled negative decay (under torchrun the launcher's job check rejects it before the test twin's planned
    failure can happen), else the planned failure, else completed. Returns [(status, part of the error)]."""
    out = []
    for num, r in enumerate(rows):
        decay = float(r["overrides"].split("optim.weight_decay=")[1].split()[0])
        torchrun = "launcher=torchrun" in r["overrides"]
        if decay < 0 and (torchrun or num not in fail_plan):
            out.append(("FAILED", f"ConfigError: optim.weight_decay={decay!r}: must be finite and >= 0"))
        elif fail_plan.get(num) == "kill":
            out.append(("FAILED", f"LaunchError: job #{num}: rank 1 failed"))
        elif fail_plan.get(num) == "raise":
            out.append(("FAILED", "FloatingPointError: loss diverged (test)"))
        else:
            out.append(("COMPLETED", ""))
    return out


def _check_optuna_search(rc, out, sweep, n_trials, fail_plan, kinds):
    """The search ran all its trials; each row is what :func:`_expected_optuna_rows` says; the failures include each
    of ``kinds``; Optuna's best value is the best completed eval loss; the sweep exits 1 naming a failed job."""
    rows = report_rows(sweep)
    assert len(rows) == n_trials, (rows, out[-3000:])
    expected = _expected_optuna_rows(rows, fail_plan)
    assert all(r["status"] == status and part in r["error"] for r, (status, part) in zip(rows, expected)), \
        ([(r["status"], r["error"]) for r in rows], expected)
    errors = " ".join(r["error"] for r in rows)
    assert all(k in errors for k in kinds) and ("COMPLETED", "") in expected, expected  # the seed samples both signs
    best = min(float(r["eval_loss"]) for r in rows if r["status"] == "COMPLETED")
    assert f"Best value: {best:.4f}"[:16] in out
    failed = sum(status == "FAILED" for status, _ in expected)
    assert rc == 1 and f"hydratrain: {failed} sweep job(s) failed" in out, out[-2000:]


def test_optuna_local_search_goes_on_past_failed_trials(tmp_path):
    """Optuna + local launcher: trials that sample an invalid weight decay fail with a config error (with the
    preset's seed, trial 2 does), trial 3 diverges (raises); the study still runs all 5 trials."""
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    sweep = tmp_path / "sweep"
    plan = {3: "raise"}
    rc, out = train(["+hparams_search=lr_optuna", "hydra.sweeper.n_trials=5", "strategy=single",
                     "optim.weight_decay=interval(-0.2,0.2)", f"hydra.sweep.dir={sweep}"], tmp_path, timeout=300,
                    script=FAIL_TASK, env={"HYDRATRAIN_TEST_FAIL": "3:raise"})
    _check_optuna_search(rc, out, sweep, 5, plan, ["ConfigError", "FloatingPointError"])


def test_optuna_torchrun_search_goes_on_past_failed_trials(tmp_path):
    """Optuna + torchrun launcher (2 ranks): a config error on a sampled value (trial 2 with the preset's seed,
    rejected by the job check in the launcher), a crashed rank (job 0), a diverged run (job 3); the study still runs
    all 4 trials."""
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    sweep = tmp_path / "sweep"
    plan = {0: "kill", 3: "raise"}
    rc, out = train(["+hparams_search=lr_optuna", "hydra.sweeper.n_trials=4", "launcher=torchrun",
                     "launcher.nproc_per_node=2", "strategy=ddp", "trainer.max_steps=4",
                     "optim.weight_decay=interval(-0.2,0.2)", f"hydra.sweep.dir={sweep}"], tmp_path, timeout=400,
                    script=FAIL_TASK, env={"HYDRATRAIN_TEST_FAIL": "0:kill,3:raise"})
    _check_optuna_search(rc, out, sweep, 4, plan, ["ConfigError", "SIGKILL", "FloatingPointError"])


# ------------------------------------------------------------------------------------ the default config
# the default config (data=python_stdlib, model=gpt_tiny, strategy=fsdp, precision=auto), only made short
SHORT = ["trainer.max_steps=3", "data.batch_size=2", "data.seq_len=64", "trainer.eval_samples=8",
         "trainer.sample_tokens=0"]


@pytest.mark.parametrize("launcher, world_size", [("local", 1), ("torchrun", 2), ("submitit_local", 2)])
def test_every_launcher_runs_the_default_config(launcher, world_size, tmp_path, cache_dir):
    """No precision= override: precision=auto is resolved by each rank (never written into the config), so the
    config every launcher hands its ranks passes the checks as composed."""
    if launcher == "submitit_local":
        pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    out_dir = tmp_path / "out"
    dir_key = "hydra.run.dir" if launcher == "local" else "hydra.sweep.dir"
    rc, out = train([f"launcher={launcher}", *SHORT, f"{dir_key}={out_dir}"], tmp_path, timeout=400, fast=[],
                    env={"HYDRATRAIN_CACHE": str(cache_dir)})
    assert rc == 0, out[-4000:]
    run_dirs = sorted(p.parent for p in out_dir.rglob("results.json"))
    assert len(run_dirs) == 1, run_dirs
    res = results(run_dirs[0])
    assert res["steps"] == 3 and res["hparams"]["world_size"] == world_size
    assert res["hparams"]["precision.name"] == "auto" and res["hparams"]["data.name"] == "python_stdlib"
    saved = OmegaConf.load(run_dirs[0] / ".hydra" / "config.yaml")
    assert (saved.precision.name, saved.strategy.name) == ("auto", "fsdp")


# ------------------------------------------------------------------------------------------------------ slow
@pytest.mark.slow
def test_issue_sweep_precision_by_strategy(tmp_path):
    sweep = tmp_path / "sweep"
    rc, out = train(["-m", "launcher=torchrun", "launcher.nproc_per_node=2", "precision=fp32,bf16",
                     "strategy=ddp,fsdp", "trainer.max_steps=4", f"hydra.sweep.dir={sweep}"], tmp_path, timeout=900)
    assert rc == 0, out[-3000:]
    rows = report_rows(sweep)
    assert len(rows) == 4 and all(r["status"] == "COMPLETED" for r in rows)
    assert len(hparams_runs(sweep)) == 4


def test_plugin_is_discovered_from_a_normal_install(tmp_path):
    """Editable installs can hide namespace plugins from Hydra's scan: check a wheel, imported without site .pth."""
    import site
    import zipfile

    rc, out = run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path),
                   str(ROOT)], tmp_path, timeout=300)
    assert rc == 0, out[-3000:]
    wheel = next(tmp_path.glob("hydratrain-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "hydra_plugins/hydratrain_launcher/torchrun_launcher.py" in names
    assert "hydra_plugins/__init__.py" not in names
    zipfile.ZipFile(wheel).extractall(tmp_path / "installed")
    env = dict(__import__("os").environ, PYTHONPATH=f"{tmp_path / 'installed'}:{site.getsitepackages()[0]}")
    rc, out = run([sys.executable, "-S", "-c", "import hydratrain, hydra_plugins.hydratrain_launcher as p; "
                   "print(p.__file__); from hydra.core.plugins import Plugins; from hydra.plugins.launcher import "
                   "Launcher; print([c.__name__ for c in Plugins.instance().discover(Launcher)])"], tmp_path,
                  timeout=120, env=env)
    assert rc == 0 and "TorchrunLauncher" in out and str(tmp_path / "installed") in out, out
