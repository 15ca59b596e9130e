"""Build a job from ``train.py``-style overrides (plain python, or under torchrun) and print, on rank 0, one JSON line:
a fingerprint of every full weight, the 2-D weights whose row blocks (one per rank) repeat, the loss of the first
train micro-batch and the eval loss. Used by the meta-init and eval-coverage tests (which call :func:`probe` in
their own process for the single-process reference).

    python tests/scripts/probe_model.py strategy=single data.batch_size=8
    torchrun --standalone --nproc_per_node 3 tests/scripts/probe_model.py strategy=fsdp model.init_device=meta
"""
import hashlib
import json
import sys
import tempfile
from pathlib import Path
from typing import Optional, Sequence

import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from hydratrain.config import register_configs
from hydratrain.dist.process_group import process_group
from hydratrain.dist.run_dir import register_resolvers
from hydratrain.parallel.build import build_strategy
from hydratrain.run import build


def probe(overrides: Sequence[str]) -> Optional[dict]:
    """The fingerprint of the job ``overrides`` build (on rank 0; None on the other ranks)."""
    register_configs()
    register_resolvers()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[2] / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=["+debug=fast_gpt", "precision=fp32", "device=cpu", "logger.tensorboard=false",
                                          "logger.peak_flops=1e12", *overrides])
    GlobalHydra.instance().clear()
    strategy = build_strategy(cfg)
    with process_group("cpu", None, strategy.needs_process_group) as info, tempfile.TemporaryDirectory() as tmp:
        job = build(cfg, strategy, info, Path(tmp), Path.cwd())
        batch = next(iter(job.trainer.train_batches))
        with torch.no_grad():
            first_loss = job.trainer.loss_of(batch).item()
        eval_loss = job.trainer.evaluator.evaluate(job.model, job.trainer.autocast)["loss"]
        full = get_model_state_dict(job.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not info.is_main:
            return None
        repeated = [k for k, v in full.items() if v.ndim == 2 and len(v) % 2 == 0
                    and torch.equal(v[: len(v) // 2], v[len(v) // 2:])]
        return {"world_size": info.world_size, "first_loss": first_loss, "eval_loss": eval_loss,
                "n_tensors": len(full), "repeated_blocks": repeated,
                "tied": job.raw.lm_head.weight is job.raw.tok_emb.weight,
                "n_params": sum(p.numel() for p in job.raw.parameters()),
                "sha": {k: hashlib.sha256(v.contiguous().numpy().tobytes()).hexdigest()[:16]
                        for k, v in sorted(full.items())}}


if __name__ == "__main__":
    result = probe(sys.argv[1:])
    if result is not None:
        print(json.dumps(result), flush=True)
