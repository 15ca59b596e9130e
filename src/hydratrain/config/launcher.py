"""The ``launcher`` group: one schema per option, its checks, which need nothing but that node
(:func:`validate_launcher`: the sweep callback runs it before anything is submitted), and how many ranks a launcher
starts (:func:`launched_processes`). No torch import."""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from typing import ClassVar, Dict, Optional

from omegaconf import MISSING, DictConfig

from hydratrain.config.values import Option
from hydratrain.errors import ConfigError


class LauncherName(Option):
    local = "local"
    torchrun = "torchrun"
    slurm = "slurm"
    submitit_local = "submitit_local"
    ray = "ray"


@dataclass
class LauncherConfig:
    """Who starts the processes (see docs/launching.md). The keys of each option are the
    user-facing ones; ``conf/launcher/<option>.yaml`` maps them onto the Hydra launcher plugin's ``hydra.launcher``."""

    option: ClassVar[Optional[LauncherName]] = None
    name: LauncherName = MISSING


@dataclass
class LocalLauncher(LauncherConfig):
    """You start the processes: ``python train.py`` or ``torchrun ... train.py``."""

    option: ClassVar[LauncherName] = LauncherName.local
    name: LauncherName = LauncherName.local


@dataclass
class TorchrunLauncher(LauncherConfig):
    """hydratrain's Hydra launcher plugin: every job is one elastic launch (torchrun's engine)."""

    option: ClassVar[LauncherName] = LauncherName.torchrun
    name: LauncherName = LauncherName.torchrun
    nproc_per_node: int = 2  # workers (ranks) per node
    nnodes: int = 1  # nodes; > 1 needs rdzv_endpoint and one launch per node with its node_rank
    node_rank: int = 0  # this node's index in [0, nnodes); node 0 hosts the rendezvous store
    rdzv_endpoint: Optional[str] = None  # HOST:PORT of node 0's rendezvous store; null = a free port per job
    rdzv_timeout: int = 600  # seconds to wait for all nodes to join a job's rendezvous
    max_restarts: int = 0  # times the agent restarts all workers of a job after one fails


@dataclass
class SubmititLauncher(LauncherConfig):
    """hydra-submitit-launcher (extra ``[slurm]``): one task, i.e. one rank, per GPU."""

    nodes: int = 1  # nodes per job
    tasks_per_node: int = 1  # ranks per node; must equal gpus_per_node when gpus_per_node > 0
    gpus_per_node: int = 0  # GPUs per node (0: CPU-only tasks)
    cpus_per_task: Optional[int] = None  # null = submitit's default
    timeout_min: int = 60  # job time limit, minutes


@dataclass
class SlurmLauncher(SubmititLauncher):
    option: ClassVar[LauncherName] = LauncherName.slurm
    name: LauncherName = LauncherName.slurm
    gpus_per_node: int = 8
    tasks_per_node: int = 8
    partition: Optional[str] = None  # SLURM partition; null = the cluster's default
    account: Optional[str] = None  # SLURM account to charge; null = your default


@dataclass
class SubmititLocalLauncher(SubmititLauncher):
    option: ClassVar[LauncherName] = LauncherName.submitit_local
    name: LauncherName = LauncherName.submitit_local
    tasks_per_node: int = 2


@dataclass
class RayLauncher(LauncherConfig):
    """hydratrain's Ray launcher plugin (extra ``[ray]``): every job is one Ray Train ``TorchTrainer`` run."""

    option: ClassVar[LauncherName] = LauncherName.ray
    name: LauncherName = LauncherName.ray
    num_workers: int = 2  # workers (ranks) per job, anywhere in the cluster
    resources_per_worker: Dict[str, float] = field(default_factory=lambda: {"CPU": 1.0})  # Ray resources per rank
    use_gpu: bool = False  # one GPU per worker (unless resources_per_worker says otherwise); nccl instead of gloo
    backend: Optional[str] = None  # backend of the process group Ray Train makes; null = nccl with use_gpu, else gloo
    address: Optional[str] = None  # an existing cluster (HOST:6379, ray://HOST:10001, auto); null = a local one
    max_failures: int = 0  # restarts of a job's workers after a failure, each resuming from the latest checkpoint


def launched_processes(launcher: DictConfig) -> int:
    """How many ranks the ``launcher`` option starts per job (1 for ``local``: torchrun's count is not known here)."""
    if "nproc_per_node" in launcher:
        return launcher.nproc_per_node * launcher.nnodes
    if "tasks_per_node" in launcher:
        return launcher.tasks_per_node * launcher.nodes
    if "num_workers" in launcher:
        return launcher.num_workers
    return 1


def missing_slurm_commands() -> list:
    """SLURM's commands that ``launcher=slurm`` needs and this machine's PATH lacks: ``sbatch`` (submitit submits
    with it) and ``srun`` (submitit's SLURM executor refuses to start without it)."""
    return [c for c in ("sbatch", "srun") if shutil.which(c) is None]


def validate_launcher(launcher: DictConfig, submitting: bool = False) -> None:
    """Check the ``launcher`` group alone (the sweep callback calls it before anything is submitted).

    Raises :class:`ConfigError` naming the key, e.g. a GPUs-per-node / tasks-per-node mismatch for SLURM. With
    ``submitting`` (the process that submits, not a job) also what that machine needs: SLURM's commands on PATH for
    ``launcher=slurm``.
    """
    missing = missing_slurm_commands() if submitting and launcher.get("name") == "slurm" else []
    if missing:
        raise ConfigError("launcher", "slurm", f"needs SLURM, but {' and '.join(missing)} "
                          f"{'is' if len(missing) == 1 else 'are'} not on PATH here; allowed here: local, torchrun, "
                          "submitit_local (the same submitit path as local processes), ray")
    name = launcher.get("name")
    inside = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("WORLD_SIZE", "1") not in ("", "0", "1")
    if submitting and name not in (None, "local") and inside:
        raise ConfigError("launcher", name, f"starts processes of its own, but this process is already one rank of "
                          f"{os.environ.get('WORLD_SIZE', '?')} (torchrun): run python train.py -m launcher={name} "
                          "... without torchrun, or keep torchrun with launcher=local (a sweep inside each rank)")
    for key in ("nproc_per_node", "nnodes", "nodes", "tasks_per_node", "timeout_min", "rdzv_timeout",
                "num_workers"):
        if key in launcher and (launcher[key] is None or launcher[key] <= 0):
            raise ConfigError(f"launcher.{key}", launcher[key], "must be > 0")
    if name == "submitit_local" and launcher.get("nodes", 1) != 1:
        raise ConfigError("launcher.nodes", launcher.nodes, "must be 1: submitit's local executor runs on this "
                          "machine only (more ranks: launcher.tasks_per_node; more nodes: launcher=slurm)")
    for key in ("max_restarts", "gpus_per_node"):
        if key in launcher and (launcher[key] is None or launcher[key] < 0):
            raise ConfigError(f"launcher.{key}", launcher[key], "must be >= 0")
    if "max_failures" in launcher and (launcher.max_failures is None or launcher.max_failures < -1):
        raise ConfigError("launcher.max_failures", launcher.max_failures, "must be >= 0, or -1 for unlimited")
    for name, amount in (launcher.get("resources_per_worker") or {}).items():
        if amount is None or amount < 0:
            raise ConfigError(f"launcher.resources_per_worker.{name}", amount, "must be >= 0")
    if "node_rank" in launcher and not 0 <= launcher.node_rank < launcher.nnodes:
        raise ConfigError("launcher.node_rank", launcher.node_rank,
                          f"must be in [0, launcher.nnodes={launcher.nnodes})")
    endpoint = launcher.get("rdzv_endpoint")
    if endpoint is not None:
        host, _, port = str(endpoint).rpartition(":")
        if not host or not port.isdigit() or not 0 <= int(port) < 65536:
            raise ConfigError("launcher.rdzv_endpoint", endpoint, "must be HOST:PORT (port in 0-65535)")
    if launcher.get("nnodes", 1) > 1 and (endpoint is None or str(endpoint).endswith(":0")):
        raise ConfigError("launcher.rdzv_endpoint", endpoint,
                          f"launcher.nnodes={launcher.nnodes} needs node 0's HOST:PORT, the same on every node")
    if launcher.get("gpus_per_node") and launcher.tasks_per_node != launcher.gpus_per_node:
        raise ConfigError("launcher.tasks_per_node", launcher.tasks_per_node,
                          f"must equal launcher.gpus_per_node={launcher.gpus_per_node} (one task per GPU)")


def check(cfg: DictConfig) -> None:
    validate_launcher(cfg.launcher)
