"""Checks of the ``hydra.launcher`` settings of one job.

Kept out of ``config.py``: Hydra's plugin scan executes that module again when it is already imported, which would
give its classes new identities (an ``except LauncherConfigError`` elsewhere would then miss); modules starting with
``_`` are not scanned.
"""
from __future__ import annotations

import copyreg
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import TorchrunLauncherConf

START_METHODS = ("spawn", "forkserver", "fork")


class LauncherConfigError(ValueError):
    """A ``hydra.launcher`` value is invalid. ``str(err)`` is one line: ``hydra.launcher.<key>=<value>: <why>``."""

    def __init__(self, key: str, value: object, why: str):
        self.key, self.value, self.why = f"hydra.launcher.{key}", value, why
        super().__init__(f"{self.key}={value!r}: {why}")

    def __reduce__(self):
        """Pickle as the message and the attributes (``__init__`` cannot be called again with the message alone)."""
        return copyreg.__newobj__, (type(self), *self.args), self.__dict__


def check_settings(conf: TorchrunLauncherConf) -> None:
    """Check one job's resolved settings. Raises :class:`LauncherConfigError` naming the first bad key."""
    for key in ("nproc_per_node", "nnodes", "rdzv_timeout"):
        if getattr(conf, key) < 1:
            raise LauncherConfigError(key, getattr(conf, key), "must be >= 1")
    if conf.max_restarts < 0:
        raise LauncherConfigError("max_restarts", conf.max_restarts, "must be >= 0")
    if not conf.monitor_interval > 0:
        raise LauncherConfigError("monitor_interval", conf.monitor_interval, "must be > 0 (seconds)")
    if conf.start_method not in START_METHODS:
        raise LauncherConfigError("start_method", conf.start_method, "allowed: " + ", ".join(START_METHODS))
    if not 0 <= conf.node_rank < conf.nnodes:
        raise LauncherConfigError("node_rank", conf.node_rank, f"must be in [0, nnodes={conf.nnodes})")
    endpoint = conf.rdzv_endpoint
    if endpoint is not None:
        host, _, port = str(endpoint).rpartition(":")
        if not host or not port.isdigit() or not 0 <= int(port) < 65536:
            raise LauncherConfigError("rdzv_endpoint", endpoint, "must be HOST:PORT with a port in 0-65535")
    if conf.nnodes > 1 and (endpoint is None or str(endpoint).endswith(":0")):
        raise LauncherConfigError("rdzv_endpoint", endpoint,
                                  f"nnodes={conf.nnodes} needs node 0's HOST:PORT, the same on every node")


def check_ray_settings(conf) -> None:
    """Check one job's resolved ``hydra.launcher`` settings of the ray launcher (a ``RayLauncherConf``). Raises
    :class:`LauncherConfigError` naming the first bad key."""
    if conf.num_workers < 1:
        raise LauncherConfigError("num_workers", conf.num_workers, "must be >= 1")
    if conf.max_failures < -1:
        raise LauncherConfigError("max_failures", conf.max_failures, "must be >= 0, or -1 for unlimited")
    for name, amount in (conf.resources_per_worker or {}).items():
        if amount is None or amount < 0:
            raise LauncherConfigError(f"resources_per_worker.{name}", amount, "must be >= 0")
