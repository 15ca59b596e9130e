"""Launcher presets, in this process: each selects its Hydra launcher and multirun and maps the user's launcher.* keys
onto the plugin's own node; bad launcher values are one-line errors naming the key; Hydra finds the plugin."""
from __future__ import annotations

import os

import pytest

from helpers import requires
from hydratrain.config.validate import validate
from hydratrain.errors import ConfigError


@pytest.mark.parametrize("overrides, key", [
    pytest.param(["launcher=submitit_local", "launcher.gpus_per_node=2", "launcher.tasks_per_node=1"],
                 "launcher.tasks_per_node", marks=requires("slurm")),
    pytest.param(["launcher=slurm", "launcher.gpus_per_node=8", "launcher.tasks_per_node=4"], "launcher.tasks_per_node",
                 marks=requires("slurm")),
    (["launcher=torchrun", "launcher.nnodes=2"], "launcher.rdzv_endpoint"),
    (["launcher=torchrun", "launcher.nnodes=2", "launcher.node_rank=2", "launcher.rdzv_endpoint=h:1"],
     "launcher.node_rank"),
    (["launcher=torchrun", "launcher.rdzv_endpoint=nohostport"], "launcher.rdzv_endpoint"),
    (["launcher=torchrun", "strategy=single"], "strategy.name"),
    (["launcher=torchrun", "launcher.max_restarts=-1"], "launcher.max_restarts"),
    pytest.param(["launcher=submitit_local", "launcher.nodes=2"], "launcher.nodes",  # was submitit's traceback
                 marks=requires("slurm")),
])
def test_bad_launcher_config_is_one_line_error_naming_the_key(compose, overrides, key):
    cfg = compose(overrides, return_hydra_config=True)
    with pytest.raises(ConfigError) as err:
        validate(cfg)  # the checks main() runs before any process group
    assert err.value.key == key and "\n" not in str(err.value)


@requires("slurm")
def test_slurm_needs_sbatch_and_srun_only_where_it_submits(compose, tmp_path, monkeypatch):
    """The process that submits needs SLURM's commands on PATH; a job's own checks (on a compute node) do not."""
    from hydratrain.config.launcher import validate_launcher

    cfg = compose(["launcher=slurm", "launcher.gpus_per_node=2"], return_hydra_config=True)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ConfigError) as err:
        validate_launcher(cfg.launcher, submitting=True)
    assert err.value.key == "launcher" and "sbatch and srun are not on PATH" in str(err.value)
    assert "submitit_local" in str(err.value) and "\n" not in str(err.value)
    validate_launcher(cfg.launcher)  # a job's check
    for name in ("sbatch", "srun"):  # a machine with SLURM (fakes that are never run)
        (tmp_path / name).write_text("#!/bin/sh\nexit 1\n")
        (tmp_path / name).chmod(0o755)
    validate_launcher(cfg.launcher, submitting=True)
    validate_launcher(compose(["launcher=submitit_local"]).launcher, submitting=True)


@pytest.mark.parametrize("name", ["torchrun", pytest.param("submitit_local", marks=requires("slurm")), "ray"])
def test_a_launcher_started_inside_torchrun_is_refused_where_it_would_submit(compose, monkeypatch, name):
    """torchrun ... train.py launcher=torchrun: each outer rank started the same jobs, and one of them failed with a
    misleading "run dir in use by another job"; a sweep inside each rank (launcher=local) stays allowed."""
    from hydratrain.config.launcher import validate_launcher

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    with pytest.raises(ConfigError) as err:
        validate_launcher(compose([f"launcher={name}"]).launcher, submitting=True)
    assert err.value.key == "launcher" and "this process is already one rank of 2 (torchrun)" in str(err.value)
    assert f"python train.py -m launcher={name}" in str(err.value)
    validate_launcher(compose([f"launcher={name}"]).launcher)  # a job's own check, inside the workers it starts
    validate_launcher(compose([]).launcher, submitting=True)


@requires("slurm")
def test_presets_select_the_hydra_launcher_and_multirun(compose):
    for name, target in [("torchrun", "hydratrain_launcher.torchrun_launcher.TorchrunLauncher"),
                         ("slurm", "hydratrain_launcher.slurm_launcher.SlurmLauncher"),  # submitit's, subclassed
                         ("submitit_local", "hydra_submitit_launcher.submitit_launcher.LocalLauncher")]:
        cfg = compose([f"launcher={name}", "launcher.gpus_per_node=4"] if name == "slurm" else [f"launcher={name}"],
                      return_hydra_config=True)
        assert cfg.hydra.launcher._target_.endswith(target)
        assert str(cfg.hydra.mode) == "RunMode.MULTIRUN"
        assert cfg.launcher.name == name
    # the user-facing launcher.* keys are mapped onto the plugin's own node, which knows no hydratrain
    torchrun = compose(["launcher=torchrun", "launcher.nproc_per_node=3", "launcher.nnodes=2", "launcher.node_rank=1",
                        "launcher.rdzv_endpoint=h:29500", "launcher.rdzv_timeout=30", "launcher.max_restarts=2"],
                       return_hydra_config=True)
    h = torchrun.hydra.launcher
    assert (h.nproc_per_node, h.nnodes, h.node_rank, h.rdzv_endpoint, h.rdzv_timeout, h.max_restarts) == \
        (3, 2, 1, "h:29500", 30, 2)
    assert h.job_check == "hydratrain.config.validate.validate"
    slurm = compose(["launcher=slurm", "launcher.nodes=2", "launcher.gpus_per_node=4", "launcher.partition=gpu",
                     "launcher.account=acct", "launcher.timeout_min=30"], return_hydra_config=True)
    h = slurm.hydra.launcher
    assert (h.nodes, h.tasks_per_node, h.gpus_per_node, h.partition, h.account, h.timeout_min) == \
        (2, 4, 4, "gpu", "acct", 30)


def test_plugin_is_discovered(cli):
    r = cli(["--info", "plugins"], fast=False)
    assert r.returncode == 0 and "TorchrunLauncher" in r.output, r.output


@requires("slurm")
def test_a_submission_sbatch_refuses_is_one_line(cli, tmp_path, monkeypatch):
    """An unknown partition or account: sbatch refuses at submission, which was a 39-line submitit traceback.
    A stand-in sbatch fails as a real one does, with its one line on stderr."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("sbatch", "srun"):
        (bin_dir / name).write_text("#!/bin/sh\necho 'sbatch: error: invalid partition specified: nosuch' >&2\n"
                                    "exit 1\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    r = cli(["launcher=slurm", "launcher.gpus_per_node=2", "launcher.partition=nosuch",
             f"hydra.sweep.dir={tmp_path / 'sweep'}"], fast=True)
    assert r.returncode == 1, r.output[-3000:]
    assert ("SlurmLauncher: sbatch refused the sweep's 1 job(s): sbatch: error: invalid partition specified: nosuch; "
            "nothing was queued") in r.err, r.output[-3000:]
    assert "Traceback" not in r.output and "CalledProcessError" not in r.output
