"""A train.py twin for the sweep-failure tests: ``$HYDRATRAIN_TEST_FAIL`` = ``NUM:MODE[,NUM:MODE...]`` makes
Hydra job NUM fail before training. MODE ``raise``: every rank raises FloatingPointError (as a diverged run does);
``kill``: rank 1 SIGKILLs itself (a crashed rank). Other jobs run train.py's task unchanged."""
import os
import signal
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig

from hydratrain.config import register_configs
from hydratrain.dist.run_dir import register_resolvers

register_configs()
register_resolvers()


@hydra.main(version_base="1.3", config_path=str(Path(__file__).resolve().parents[1] / "conf"), config_name="train")
def task(cfg) -> float:
    from hydratrain.run import main

    plan = dict(item.split(":") for item in os.environ.get("HYDRATRAIN_TEST_FAIL", "").split(",") if item)
    mode = plan.get(str(HydraConfig.get().job.num))
    if mode == "raise":
        raise FloatingPointError("loss diverged (test)")
    if mode == "kill" and os.environ.get("RANK") == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    return main(cfg).eval_loss


if __name__ == "__main__":
    task()
