"""hydratrain entry point.

    python train.py                                            # one process (default: gpt_tiny, fsdp, precision=auto)
    torchrun --standalone --nproc_per_node 2 train.py strategy=ddp precision=fp32
    python train.py +experiment=gpt_small_fsdp optim.lr=3e-4
    python train.py --cfg job                                  # print the composed config, and check it as a run would
"""
from hydratrain.checkpoint.preemption import early_guard
from hydratrain.dist.launch import note_launcher

if __name__ == "__main__":  # (not when imported: a process that imports train.py would ignore SIGTERM for good)
    early_guard()  # a SIGTERM while Hydra composes is recorded, and ends the launch as preempted once a run starts
    note_launcher()  # torchrun's agent, while it lives: its command resumes the run, and its death stops this rank
import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from hydratrain.cli import with_config_checks  # noqa: E402
from hydratrain.config import register_configs  # noqa: E402
from hydratrain.dist.run_dir import register_resolvers  # noqa: E402

register_configs()
register_resolvers()


@with_config_checks  # --cfg job: the printed config gets the run's checks (exit 2 and its one line when one fails)
@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def train(cfg: DictConfig) -> float:
    from hydratrain.run import main  # (after composing: torch's ~2 s are not paid by --help and --cfg)

    return main(cfg).objective  # trainer.objective (eval/loss by default): what a sweeper optimises


if __name__ == "__main__":
    train()
