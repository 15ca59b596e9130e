"""The ray launcher plugin without a cluster: it knows no app and imports no Ray when Hydra scans it, its config
node works for any app, launcher=ray maps the user-facing keys onto it, and bad values are one-line errors."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hydra import compose as hydra_compose
from hydra import initialize_config_module
from hydra.core.global_hydra import GlobalHydra

from helpers import requires
from hydratrain.config.validate import validate
from hydratrain.errors import ConfigError


@pytest.mark.slow  # a fresh interpreter scanning Hydra's plugins
def test_plugin_scan_imports_neither_the_app_nor_ray():
    code = ("import sys; sys.modules['hydratrain'] = None\n"
            "import hydra_plugins.hydratrain_launcher.ray_config, hydra_plugins.hydratrain_launcher.ray_launcher\n"
            "assert 'ray' not in sys.modules, 'the scanned modules must not import ray'\n"
            "import hydra_plugins.hydratrain_launcher._ray_core\n"
            "print('ok', [m for m in sys.modules if m.startswith('hydratrain')])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "ok ['hydratrain']" in proc.stdout, proc.stderr[-3000:]


def test_config_node_has_defaults_for_any_app():
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(version_base="1.3", config_module="hydra.test_utils.configs"):
            cfg = hydra_compose("compose", overrides=["hydra/launcher=ray"], return_hydra_config=True)
    finally:
        GlobalHydra.instance().clear()
    node = cfg.hydra.launcher
    assert node._target_ == "hydra_plugins.hydratrain_launcher.ray_launcher.RayLauncher"
    assert (node.num_workers, dict(node.resources_per_worker), node.use_gpu, node.address, node.max_failures,
            node.job_check, node.worker_setup) == (1, {"CPU": 1.0}, False, None, 0, None, None)


def test_launcher_ray_maps_its_keys_onto_the_plugin(compose):
    cfg = compose(["launcher=ray", "launcher.num_workers=4", "launcher.max_failures=2",
                   "launcher.address=head:6379", "strategy=hsdp", "strategy.shard_size=2"], return_hydra_config=True)
    node = cfg.hydra.launcher
    assert (node.num_workers, node.max_failures, node.address) == (4, 2, "head:6379")
    assert node.job_check == "hydratrain.config.validate.validate" and cfg.hydra.mode.name == "MULTIRUN"
    task = compose(["launcher=ray", "launcher.num_workers=4", "strategy=hsdp", "strategy.shard_size=2"])
    validate(task)


@pytest.mark.parametrize("overrides,message", [
    (["launcher.num_workers=0"], "launcher.num_workers=0: must be > 0"),
    (["launcher.max_failures=-2"], "launcher.max_failures=-2: must be >= 0, or -1 for unlimited"),
    (["launcher.resources_per_worker.CPU=-1"], "launcher.resources_per_worker.CPU=-1.0: must be >= 0"),
    (["strategy=single"], "strategy.name='single': runs one process but launcher=ray starts 2"),
    (["strategy=hsdp", "strategy.shard_size=3"], "strategy.shard_size=3: must divide the 2 ranks launcher=ray"),
])
def test_bad_ray_values_are_one_line_errors(compose, overrides, message):
    with pytest.raises(ConfigError) as err:
        validate(compose(["launcher=ray", *overrides]))
    assert str(err.value).startswith(message) and "\n" not in str(err.value), str(err.value)


def test_forwarded_env_and_worker_error_lines():
    from hydra_plugins.hydratrain_launcher._ray_core import forwarded_env, worker_error_line

    env = {"HYDRATRAIN_CACHE": "/c", "HYDRATRAIN_DATA_DIR": "/d", "WORKSPACE": "/w", "HOME": "/root"}
    assert forwarded_env(["HYDRATRAIN_*", "WORKSPACE"], env) == {k: env[k] for k in list(env)[:3]}
    wrapped = ("ray::RayTrainWorker.run() (pid=1, ip=10.0.0.1)\nTraceback (most recent call last):\n"
               '  File "x.py", line 3, in f\n    raise RuntimeError("boom: at step 3")\n'
               "RuntimeError: boom: at step 3")
    assert worker_error_line(RuntimeError(wrapped)) == "RuntimeError: boom: at step 3"
    assert worker_error_line(ValueError("plain words")) == "ValueError: plain words"


@requires("ray")
def test_a_local_cluster_gets_cpus_for_one_job_and_the_forwarded_env(monkeypatch):
    import ray
    from omegaconf import OmegaConf

    from hydra_plugins.hydratrain_launcher import _ray_core

    calls = []
    monkeypatch.delenv("HYDRATRAIN_STAMP", raising=False)  # an earlier in-process run may have exported one
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    monkeypatch.setenv("HYDRATRAIN_DATA_DIR", "/d")
    settings = {"address": None, "num_workers": 3, "resources_per_worker": OmegaConf.create({"CPU": 2.0}),
                "forward_env": OmegaConf.create(["HYDRATRAIN_*"]),
                "init_kwargs": OmegaConf.create({"runtime_env": {"env_vars": {"A": "1"}}})}
    assert _ray_core.connect(settings) is True
    assert calls[-1]["num_cpus"] >= 6 and calls[-1]["runtime_env"]["env_vars"] == {"HYDRATRAIN_DATA_DIR": "/d",
                                                                                     "A": "1"}
    assert _ray_core.connect({**settings, "address": "head:6379"}) is False and calls[-1]["address"] == "head:6379"


@requires("ray")
def test_a_local_cluster_fits_the_sweeps_biggest_job(monkeypatch):
    """-m launcher=ray launcher.num_workers=3,1: the cluster was sized from the sweep-level value (the default's
    2 workers), so on a 2-core machine Ray waited for job 0's third CPU forever."""
    from types import SimpleNamespace

    import ray
    from omegaconf import OmegaConf

    from hydra_plugins.hydratrain_launcher import _ray_core

    def job(overrides):
        workers = int(next(o.split("=")[1] for o in overrides if o.startswith("launcher.num_workers=")))
        if workers < 0:
            raise ValueError("does not compose")
        return OmegaConf.create({"hydra": {"launcher": {"num_workers": workers, "resources_per_worker": {"CPU": 1}}}})

    launcher = SimpleNamespace(settings={"num_workers": 2, "resources_per_worker": {"CPU": 1.0}}, config=None,
                               hydra_context=SimpleNamespace(config_loader=SimpleNamespace(
                                   load_sweep_config=lambda config, overrides: job(overrides))))
    sweep = [["launcher.num_workers=3"], ["launcher.num_workers=1"], ["launcher.num_workers=-1"]]
    assert _ray_core._most_cpus(launcher, sweep) == 3
    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert _ray_core.connect({"address": None, "num_workers": 2}, cpus=3) and calls[-1]["num_cpus"] == 3
