"""The torchrun launcher plugin's config, in this process: Hydra discovers it, its node has defaults for any app, a
bad setting is a one-line error naming its hydra.launcher key. (Sweeps through it: tests/e2e/test_torchrun_plugin.py.)
"""
from __future__ import annotations

import pytest
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.core.plugins import Plugins
from hydra.plugins.launcher import Launcher

from hydra_plugins.hydratrain_launcher._checks import LauncherConfigError, check_settings
from hydra_plugins.hydratrain_launcher.config import TorchrunLauncherConf
from hydra_plugins.hydratrain_launcher.torchrun_launcher import TorchrunLauncher


def test_discovery():
    assert TorchrunLauncher.__name__ in [c.__name__ for c in Plugins.instance().discover(Launcher)]


def test_config_node_has_defaults_for_any_app():
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(version_base="1.3", config_module="hydra.test_utils.configs"):
            cfg = compose("compose", overrides=["hydra/launcher=torchrun"], return_hydra_config=True)
    finally:
        GlobalHydra.instance().clear()
    node = cfg.hydra.launcher
    assert node._target_ == "hydra_plugins.hydratrain_launcher.torchrun_launcher.TorchrunLauncher"
    assert (node.nproc_per_node, node.nnodes, node.node_rank, node.rdzv_endpoint, node.max_restarts,
            node.job_check, node.stop_on_failure) == (1, 1, 0, None, 0, None, False)


@pytest.mark.parametrize("change, key", [
    ({"nproc_per_node": 0}, "hydra.launcher.nproc_per_node"),
    ({"nnodes": 0}, "hydra.launcher.nnodes"),
    ({"rdzv_timeout": 0}, "hydra.launcher.rdzv_timeout"),
    ({"max_restarts": -1}, "hydra.launcher.max_restarts"),
    ({"monitor_interval": 0.0}, "hydra.launcher.monitor_interval"),
    ({"start_method": "thread"}, "hydra.launcher.start_method"),
    ({"nnodes": 2, "node_rank": 2, "rdzv_endpoint": "h:1"}, "hydra.launcher.node_rank"),
    ({"rdzv_endpoint": "nohostport"}, "hydra.launcher.rdzv_endpoint"),
    ({"nnodes": 2}, "hydra.launcher.rdzv_endpoint"),
    ({"nnodes": 2, "rdzv_endpoint": "h:0"}, "hydra.launcher.rdzv_endpoint"),
])
def test_bad_setting_is_one_line_error_naming_the_key(change, key):
    check_settings(TorchrunLauncherConf())
    with pytest.raises(LauncherConfigError) as err:
        check_settings(TorchrunLauncherConf(**change))
    assert err.value.key == key and str(err.value).startswith(key + "=") and "\n" not in str(err.value)
