"""Asynchronous checkpoint saves: how long a save stops the training loop, synchronous against
``checkpoint.async_save=true``.

    python bench/async_save.py                                 # GPT of gpt_small's size (85M), fp32, 7 saves each
    python bench/async_save.py --d-model 512 --layers 8 --saves 3

One process builds two jobs of the same model (``hydratrain.run.build``, ``strategy=single``, CPU, synthetic data),
one per mode, and alternates them round by round, so a drift of the machine's load touches both. A round trains one
step, then saves it with the job's ``CheckpointManager.save``, which is what the loop waits for at a save step:
synchronous, the whole write; asynchronous, the state's copy into host memory (the staging) and the start of DCP's
background write. The async job's write is then waited for (``wait``: that figure is the rest of the write, the loop
running meanwhile in a real run), so each async save starts with none in flight, as with saves further apart than a
write takes. The table gives the median over the saves (min and max) and blocked async / blocked sync, which
``checkpoint.async_save`` promises to keep at or under 0.20 for a save of a second or more.

On the 2-core build machine (load average 2-3 from other jobs): synchronous 1.727 s (1.307-3.431), async 0.132 s
(0.117-0.382), 0.076; in a run beside heavier load, 3.374 s against 1.842 s (0.546): the copy is bound by memory
bandwidth, which other processes share.
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from hydratrain.config import register_configs
from hydratrain.dist.env import DistInfo
from hydratrain.dist.run_dir import register_resolvers
from hydratrain.optim import state_bytes
from hydratrain.parallel.build import build_strategy
from hydratrain.run import build

CONF = Path(__file__).resolve().parents[1] / "conf"


def _job(run_dir: Path, d_model: int, layers: int, async_save: bool):
    overrides = ["+debug=fast_gpt", "strategy=single", "precision=fp32", "device=cpu", "logger.tensorboard=false",
                 "logger.peak_flops=1e12", f"model.d_model={d_model}", f"model.n_layer={layers}",
                 f"model.n_head={max(1, d_model // 64)}", "data.batch_size=1", "checkpoint.keep_last=1",
                 f"checkpoint.async_save={str(async_save).lower()}"]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    return build(cfg, build_strategy(cfg), DistInfo(device=torch.device("cpu")), run_dir, run_dir)


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--saves", type=int, default=7, help="saves per mode (the median is taken; at least 3)")
    parser.add_argument("--out", help="where the checkpoints go (default: a temporary dir, removed at the end)")
    args = parser.parse_args()
    if args.saves < 3:
        parser.error("--saves must be at least 3 (the figures are medians)")
    register_configs()
    register_resolvers()
    out = Path(args.out or tempfile.mkdtemp(prefix="async_save_bench-"))
    try:
        jobs = {mode: _job(out / mode, args.d_model, args.layers, mode == "async") for mode in ("sync", "async")}
        batches = {mode: iter(job.trainer.train_batches) for mode, job in jobs.items()}
        blocked: dict[str, list[float]] = {"sync": [], "async": []}
        written: list[float] = []
        for step in range(1, args.saves + 1):
            for mode, job in jobs.items():
                job.trainer.train_step(batches[mode])
                job.trainer.progress.step = step
                t0 = time.perf_counter()
                job.checkpoints.save(step)
                blocked[mode].append(time.perf_counter() - t0)
                if mode == "async":
                    job.checkpoints.wait()
                    written.append(time.perf_counter() - t0)
        trainer = jobs["sync"].trainer
        params = sum(p.numel() for p in trainer.model.parameters())
        state_mb = (params * 4 + state_bytes(trainer.optimizer)) / 1e6
        ratio = statistics.median(blocked["async"]) / statistics.median(blocked["sync"])
        print(f"GPT d_model={args.d_model} n_layer={args.layers}: {params / 1e6:.1f}M parameters, {state_mb:.0f} MB "
              f"of model and optimizer state; {args.saves} saves per mode; {torch.get_num_threads()} threads")
        print("| mode | loop blocked per save, s: median (min-max) | save written after, s |")
        print("|---|---|---|")
        print(f"| synchronous | {_spread(blocked['sync'])} | (the same) |")
        print(f"| async_save=true | {_spread(blocked['async'])} | {_spread(written)} |")
        print(f"blocked async / blocked sync: {ratio:.3f} (target <= 0.20)")
        if statistics.median(blocked["sync"]) < 1.0:
            print("note: the synchronous save took under 1 s here: the target is stated for saves of 1 s or more "
                  "(raise --d-model or --layers)")
    finally:
        if not args.out:
            shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
