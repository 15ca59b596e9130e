"""The job check and a recording Hydra callback of tests/plugin_app (an app unrelated to hydratrain)."""
import json
import os

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback


def check(cfg) -> None:
    """The app's job check: rejects ``fail=check``; ``fail=mutate`` tries to change the (read-only) config."""
    if "hydra" in cfg:
        raise AssertionError("the job check must get the task's config, without the hydra node")
    if cfg.fail == "check":
        raise ValueError("fail=check: rejected by the app's job check")
    if cfg.fail == "mutate":
        cfg.n = 5


class RecordingCallback(Callback):
    """Appends one JSON line per ``on_job_end`` call (process, rank, job, status, error) to ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_job_end(self, config, job_return, **kwargs) -> None:
        hc = HydraConfig.get()
        failed = job_return.status.name == "FAILED"
        record = {"pid": os.getpid(), "rank": os.environ.get("RANK"), "num": hc.job.num,
                  "config_num": config.hydra.job.num, "output_dir": hc.runtime.output_dir,
                  "output_dir_exists": os.path.isdir(hc.runtime.output_dir), "status": job_return.status.name,
                  "error": f"{type(job_return._return_value).__name__}: {job_return._return_value}" if failed else ""}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
