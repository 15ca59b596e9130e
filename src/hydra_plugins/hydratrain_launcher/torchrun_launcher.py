"""``hydra/launcher=torchrun``: every Hydra job is one elastic launch of ``launcher.nproc_per_node`` workers."""
from __future__ import annotations

import logging
from typing import Optional, Sequence

from hydra.core.utils import JobReturn
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig

log = logging.getLogger(__name__)


class TorchrunLauncher(Launcher):
    """Runs each job of a sweep, one after another, as ``nproc_per_node`` workers started by
    ``torch.distributed.launcher.api.elastic_launch`` (torchrun's engine). Workers run the task function on the job's
    own config (never ``sys.argv``); the job's result is rank 0's return value. See ``_core.launch``.
    """

    def __init__(self, stop_on_failure: bool = False, monitor_interval: float = 0.5,
                 start_method: str = "spawn") -> None:
        self.stop_on_failure = stop_on_failure
        self.monitor_interval = monitor_interval
        self.start_method = start_method
        self.config: Optional[DictConfig] = None
        self.task_function: Optional[TaskFunction] = None
        self.hydra_context: Optional[HydraContext] = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config, self.hydra_context, self.task_function = config, hydra_context, task_function

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from . import _core

        return _core.launch(self, job_overrides, initial_job_idx)
