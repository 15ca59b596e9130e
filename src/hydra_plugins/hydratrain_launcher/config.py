"""Config of the ``torchrun`` launcher, stored in Hydra's group ``hydra/launcher``.

The per-job settings (``nproc_per_node``, ``nnodes``, ``node_rank``, ``rdzv_endpoint``, ``rdzv_timeout``,
``max_restarts``) are read from each job's own ``launcher.*`` keys (``conf/launcher/torchrun.yaml``), so a sweep can
vary them; this node holds only the plugin's knobs.
"""
from dataclasses import dataclass

from hydra.core.config_store import ConfigStore


@dataclass
class TorchrunLauncherConf:
    _target_: str = "hydra_plugins.hydratrain_launcher.torchrun_launcher.TorchrunLauncher"
    stop_on_failure: bool = False  # true: a failed job ends the sweep; false: report it and run the next job
    monitor_interval: float = 0.5  # seconds between the agent's checks of its workers
    start_method: str = "spawn"  # how the agent starts workers: spawn | forkserver | fork


ConfigStore.instance().store(group="hydra/launcher", name="torchrun", node=TorchrunLauncherConf,
                             provider="hydratrain_launcher")
