"""``hydra/launcher=torchrun``: every Hydra job is one elastic launch of ``hydra.launcher.nproc_per_node`` workers."""
from __future__ import annotations

from typing import Optional, Sequence

from hydra.core.utils import JobReturn
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig


class TorchrunLauncher(Launcher):
    """Runs the jobs of a sweep one after another, each as ``nproc_per_node`` workers started by
    ``torch.distributed.launcher.api.elastic_launch`` (torchrun's engine). Workers run the task function through
    Hydra's ``run_job`` on the job's own config (never by re-running ``sys.argv``); a completed job's result is
    global rank 0's :class:`JobReturn`. The keyword arguments are the fields of
    :class:`~hydra_plugins.hydratrain_launcher.config.TorchrunLauncherConf`; per-job fields are read again from each
    job's composed config. See ``_core.launch``.
    """

    def __init__(self, stop_on_failure: bool = False, **job_settings) -> None:
        self.stop_on_failure = stop_on_failure
        self.job_settings = job_settings  # this sweep's defaults; each job reads its own hydra.launcher
        self.config: Optional[DictConfig] = None
        self.task_function: Optional[TaskFunction] = None
        self.hydra_context: Optional[HydraContext] = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config, self.hydra_context, self.task_function = config, hydra_context, task_function

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        """Run each job; returns one :class:`JobReturn` per job run (fewer when ``stop_on_failure`` ends the sweep
        at a failed job). A job that failed is returned with status FAILED, its exception as the return value."""
        from . import _core

        return _core.launch(self, job_overrides, initial_job_idx)
