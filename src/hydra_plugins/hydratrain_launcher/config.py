"""Config of the ``torchrun`` launcher: the node ``hydra.launcher``, stored in Hydra's group ``hydra/launcher``.

Every field is read again from each job's own composed config, so an app can point a field at one of its keys
(``nproc_per_node: ${launcher.nproc_per_node}``) and a sweep over that key gives each job its own value. The defaults
suit any Hydra app: one worker per job on this machine, a free rendezvous port per job.

    python my_app.py -m hydra/launcher=torchrun hydra.launcher.nproc_per_node=2 a=1,2
"""
# no "from __future__ import annotations": Hydra's plugin scan runs this module outside sys.modules, where
# dataclasses cannot resolve string annotations (and OmegaConf needs the real types)
from dataclasses import dataclass, field
from typing import List, Optional

from hydra.core.config_store import ConfigStore


@dataclass
class TorchrunLauncherConf:
    """Settings of :class:`~hydra_plugins.hydratrain_launcher.torchrun_launcher.TorchrunLauncher`."""

    _target_: str = "hydra_plugins.hydratrain_launcher.torchrun_launcher.TorchrunLauncher"
    # --- per job: the elastic agent's settings, as torchrun's flags of the same names
    nproc_per_node: int = 1  # workers (ranks) started on this node for each job
    nnodes: int = 1  # nodes per job; > 1: run the same sweep on every node, each with its node_rank
    node_rank: int = 0  # this node's index in [0, nnodes); node 0 hosts the rendezvous store
    rdzv_endpoint: Optional[str] = None  # HOST:PORT of node 0's store; null: 127.0.0.1 and a free port per job
    rdzv_timeout: int = 600  # seconds to wait for all nodes to join a job's rendezvous
    max_restarts: int = 0  # times the agent restarts all workers of a job after one of them fails
    monitor_interval: float = 0.5  # seconds between the agent's checks of its workers
    start_method: str = "spawn"  # how the agent starts workers: spawn | forkserver | fork
    # --- per sweep
    stop_on_failure: bool = False  # true: a failed job ends the sweep; false: record it and run the next job
    # exit status of the sweep when SIGTERM stops it (SIGINT: 130, other signals 128 + the signal): the agent passes
    # the signal on to the job's workers and waits for them (an app that saves on SIGTERM has saved by then)
    preempt_exit_code: int = 75
    # exit statuses by which a worker says it stopped because another rank failed first: the job's failure is then
    # another worker's, when one failed otherwise (hydratrain: 5)
    secondary_exit_codes: List[int] = field(default_factory=list)
    # Dotted path of the app's check ``f(cfg)``, called in the launcher process on each job's config (as the task
    # function would get it, read-only) before any worker starts; an exception fails that job. null: no check.
    job_check: Optional[str] = None


ConfigStore.instance().store(group="hydra/launcher", name="torchrun", node=TorchrunLauncherConf,
                             provider="hydratrain_launcher")
