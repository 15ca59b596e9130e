"""``hydra/launcher=ray``: every Hydra job is one Ray Train ``TorchTrainer`` run of ``hydra.launcher.num_workers``
workers."""
from __future__ import annotations

from typing import Optional, Sequence

from hydra.core.utils import JobReturn
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig


class RayLauncher(Launcher):
    """Runs the jobs of a sweep one after another, each as a Ray Train ``TorchTrainer`` whose workers run the task
    function through Hydra's ``run_job`` on the job's own config; a completed job's result is world rank 0's
    :class:`JobReturn`. Connects to ``address`` (or starts a local cluster) once per sweep. The keyword arguments are
    the fields of :class:`~hydra_plugins.hydratrain_launcher.ray_config.RayLauncherConf`; per-job fields are read
    again from each job's composed config. See ``_ray_core.launch``.
    """

    def __init__(self, stop_on_failure: bool = False, **settings) -> None:
        self.stop_on_failure = stop_on_failure
        self.settings = settings  # this sweep's values; each job reads its own per-job fields
        self.config: Optional[DictConfig] = None
        self.task_function: Optional[TaskFunction] = None
        self.hydra_context: Optional[HydraContext] = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config, self.hydra_context, self.task_function = config, hydra_context, task_function

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        """Run each job; returns one :class:`JobReturn` per job run (fewer when ``stop_on_failure`` ends the sweep
        at a failed job). A job that failed is returned with status FAILED, its exception as the return value."""
        from . import _ray_core

        return _ray_core.launch(self, job_overrides, initial_job_idx)
