"""Config of the ``ray`` launcher: the node ``hydra.launcher``, stored in Hydra's group ``hydra/launcher``.

Per-job fields (``num_workers``, ``resources_per_worker``, ``use_gpu``, ``backend``, ``max_failures``) are read again
from each job's own composed config, so a sweep over an app key that they point at gives each job its own value. The
cluster fields (``address``, ``init_kwargs``, ``forward_env``) are the sweep's: one connection serves every job.
Importing this module does not import Ray (Hydra's plugin scan imports it).

    pip install "ray[train]"
    python my_app.py -m hydra/launcher=ray hydra.launcher.num_workers=2 a=1,2
"""
# no "from __future__ import annotations": Hydra's plugin scan runs this module outside sys.modules, where
# dataclasses cannot resolve string annotations (and OmegaConf needs the real types)
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore


@dataclass
class RayLauncherConf:
    """Settings of :class:`~hydra_plugins.hydratrain_launcher.ray_launcher.RayLauncher`."""

    _target_: str = "hydra_plugins.hydratrain_launcher.ray_launcher.RayLauncher"
    # --- per job: Ray Train's ScalingConfig, TorchConfig and FailureConfig
    num_workers: int = 1  # training workers (ranks) of each job, placed anywhere in the cluster
    resources_per_worker: Dict[str, float] = field(default_factory=lambda: {"CPU": 1.0})  # Ray resources per rank
    use_gpu: bool = False  # give each worker a GPU (Ray sets CUDA_VISIBLE_DEVICES); nccl becomes the default backend
    backend: Optional[str] = None  # torch.distributed backend of the group Ray Train creates; null: nccl/gloo
    max_failures: int = 0  # restarts of a job's workers after a failure (-1: unlimited); the job must resume itself
    # --- per sweep: the cluster
    address: Optional[str] = None  # HOST:6379, ray://HOST:10001 or auto; null: start a local cluster for the sweep
    init_kwargs: Dict[str, Any] = field(default_factory=dict)  # more ray.init() arguments (e.g. num_cpus)
    # environment variables copied from the launching process into every worker (names, or prefixes ending in *)
    forward_env: List[str] = field(default_factory=list)
    storage_path: Optional[str] = None  # where Ray Train keeps its run state; null: <sweep dir>/.ray
    stop_on_failure: bool = False  # true: a failed job ends the sweep; false: record it and run the next job
    # Dotted paths of the app's hooks: job_check(cfg) in the launching process on each job's config before any
    # worker starts (an exception fails that job); worker_setup() in each worker before the job runs (e.g. to
    # register the OmegaConf resolvers its config uses). null: none.
    job_check: Optional[str] = None
    worker_setup: Optional[str] = None


ConfigStore.instance().store(group="hydra/launcher", name="ray", node=RayLauncherConf, provider="hydratrain_launcher")
