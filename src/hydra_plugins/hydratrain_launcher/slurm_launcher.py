"""``launcher=slurm``: hydra-submitit-launcher's ``SlurmLauncher``, with sbatch's refusal of the jobs as one line.

sbatch refuses a job at submission (an unknown partition or account, a QOS or time limit) with one line on its
stderr; submitit raises it as a ``FailedJobError`` from a ``CalledProcessError``, which Hydra would print as a
39-line traceback with sbatch's line at its bottom. Without the ``[slurm]`` extra nothing is defined here
(``launcher=slurm`` then says the extra is missing).
"""
from __future__ import annotations

import subprocess

try:
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher as _SubmititSlurmLauncher
except ImportError:
    _SubmititSlurmLauncher = None

if _SubmititSlurmLauncher is not None:

    class SlurmLauncher(_SubmititSlurmLauncher):
        """hydra-submitit-launcher's SLURM launcher; a submission sbatch refuses raises ``LaunchError`` with
        sbatch's own message (Hydra prints its one line), nothing queued. A job that fails after it started is
        reported as before."""

        def launch(self, job_overrides, initial_job_idx):
            try:
                return super().launch(job_overrides, initial_job_idx)
            except Exception as err:
                if type(err).__name__ != "FailedJobError" or not isinstance(err.__cause__,
                                                                           subprocess.CalledProcessError):
                    raise
                from ._core import LaunchError

                said = [line.strip() for line in str(err).splitlines() if line.strip()]
                raise LaunchError(f"SlurmLauncher: sbatch refused the sweep's {len(job_overrides)} job(s): "
                                  f"{said[-1] if said else 'it printed nothing'}; nothing was queued (see "
                                  "launcher.partition, launcher.account, launcher.timeout_min)") from None
