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


def _raised(make):
    """The exception ``make`` raises, with the chain Python gives it."""
    try:
        make()
    except Exception as err:
        return err
    raise AssertionError("nothing raised")


def _store_failed(inner: Exception):
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    def make():
        try:
            raise inner
        except RuntimeError as exc:  # as torch's _create_tcp_store wraps it
            raise RendezvousConnectionError("The connection to the C10d store has failed. See inner exception for "
                                            "details.") from exc
    return _raised(make)


def test_a_rendezvous_that_failed_says_why_and_only_a_wait_that_ran_out_is_called_a_timeout():
    """One node, ``ulimit -n 12``: the store could not bind (too many open files) after 1 s, and the job's line was
    "no rendezvous with all 1 node(s) within hydra.launcher.rdzv_timeout=600 s (is node 0 running the same
    sweep?)" without the inner error."""
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

    from hydra_plugins.hydratrain_launcher._core import rendezvous_failure

    no_files = _store_failed(dist.DistNetworkError("The server socket has failed to bind. port: 0, useIpv6: 0, code: "
                                                   "-24, name: EMFILE, message: too many open files\nframe #0: ..."))
    line = rendezvous_failure(0, TorchrunLauncherConf(), no_files)
    assert line == ("job #0: hydra.launcher.rdzv_endpoint=None: the rendezvous of 1 node(s) failed: "
                    "RendezvousConnectionError: The connection to the C10d store has failed. See inner exception for "
                    "details.; caused by DistNetworkError: The server socket has failed to bind. port: 0, useIpv6: 0, "
                    "code: -24, name: EMFILE, message: too many open files")
    # node 1 waiting for node 0's store: a timeout, and the other node is asked after
    two = {"nnodes": 2, "rdzv_endpoint": "n0:29400", "rdzv_timeout": 60}
    unreachable = _store_failed(dist.DistNetworkError("The client socket has timed out after 60000ms while trying to "
                                                      "connect to (n0, 29400)."))
    line = rendezvous_failure(3, TorchrunLauncherConf(**two, node_rank=1), unreachable)
    assert line.startswith("job #3: hydra.launcher.rdzv_endpoint=n0:29400: no rendezvous with all 2 node(s) within "
                           "hydra.launcher.rdzv_timeout=60 s (is node 0 running the same sweep?): "
                           "RendezvousConnectionError: "), line
    assert line.endswith("; caused by DistNetworkError: The client socket has timed out after 60000ms while trying to "
                         "connect to (n0, 29400)."), line
    # node 0 waiting for the others
    line = rendezvous_failure(3, TorchrunLauncherConf(**two), RendezvousTimeoutError())
    assert line == ("job #3: hydra.launcher.rdzv_endpoint=n0:29400: no rendezvous with all 2 node(s) within "
                    "hydra.launcher.rdzv_timeout=60 s (are the other nodes running the same sweep?): "
                    "RendezvousTimeoutError")
    assert "running the same sweep" not in rendezvous_failure(0, TorchrunLauncherConf(), RendezvousTimeoutError())


def test_a_one_line_error_names_the_errors_behind_it():
    from hydra_plugins.hydratrain_launcher._core import _one_line

    def chained():
        try:
            try:
                raise OSError(24, "Too many open files")
            except OSError:
                raise RuntimeError("store: see inner exception\nsecond line")  # noqa: B904 (the implicit __context__)
        except RuntimeError as exc:
            raise ValueError("wrapped: store: see inner exception") from exc

    assert _one_line(_raised(chained)) == ("ValueError: wrapped: store: see inner exception; caused by OSError: "
                                           "[Errno 24] Too many open files")  # the repeated message once

    def suppressed():
        try:
            raise OSError("hidden")
        except OSError:
            raise KeyError("k") from None

    assert _one_line(_raised(suppressed)) == "KeyError: 'k'"
