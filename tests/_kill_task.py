"""A train.py twin for the elastic-restart test: on the first attempt, rank 1 SIGKILLs itself at step 3."""
import os
import signal
from pathlib import Path

import hydra

from hydratrain.config import register_configs
from hydratrain.distributed import register_resolvers

register_configs()
register_resolvers()


@hydra.main(version_base="1.3", config_path=str(Path(__file__).resolve().parents[1] / "conf"), config_name="train")
def task(cfg) -> float:
    from hydratrain import trainer
    from hydratrain.run import main

    if os.environ.get("RANK") == "1" and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
        step = trainer.Trainer.train_step

        def dying_step(self, batches):
            if self.state.step == 3:
                (self.run_dir / "rank1_killed_at_step3").touch()
                os.kill(os.getpid(), signal.SIGKILL)
            return step(self, batches)

        trainer.Trainer.train_step = dying_step
    return main(cfg).eval_loss


if __name__ == "__main__":
    task()
