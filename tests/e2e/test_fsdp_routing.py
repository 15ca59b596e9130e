"""Under FSDP, ranks that run different modules in a step (top-1 MoE routing, an expert with no rows on some rank)
end with one config error on every rank naming the modules, at step 1 before any mismatched gather or
reduce-scatter, instead of a hang until distributed.collective_timeout_s (experts as FSDP units, wrap_policy=auto)
or a gloo "collective mismatch" abort (wrap_policy=none); a module skipped on every rank alike still trains."""
from __future__ import annotations

import pytest

from helpers import own_launch_dir, results, run

BASE = ["--config-dir", "my_conf", "+experiment=spirals", "device=cpu", "precision=fp32", "strategy=fsdp",
        "trainer.progress_bar=false", "data.n=256", "data.batch_size=16", "trainer.eval_every_n_steps=0",
        "trainer.eval_samples=0", "trainer.log_every_n_steps=1", "trainer.max_steps=3",
        "model._target_=mypkg.routed.Routed", "distributed.collective_timeout_s=30",
        "distributed.failure_timeout_s=10"]

# rank r runs the experts listed for it (a stand-in for top-1 routing that left an expert no rows on a rank)
ROUTED = """
import os

import torch
from torch import nn


class Expert(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return torch.relu(self.fc(x))


class Routed(nn.Module):
    def __init__(self, width: int = 16, depth: int = 3, num_classes: int = 3, skip: str = "rank"):
        super().__init__()
        self.skip = skip
        self.inp = nn.Linear(2, width)
        self.experts = nn.ModuleList(Expert(width) for _ in range(depth))
        self.head = nn.Linear(width, num_classes)

    def forward(self, x):
        h = self.inp(x)
        rank = int(os.environ.get("RANK", "0"))
        for e, expert in enumerate(self.experts):
            skipped = e == 1 + rank if self.skip == "rank" else e == 1  # "all": every rank skips expert 1
            if not (self.training and skipped):
                h = h + expert(h)
        return self.head(h)
"""


def _launch_dir(tmp_path):
    return own_launch_dir(tmp_path / "launch", routed=ROUTED)


@pytest.mark.slow  # three 2-rank launches, about 90 s
def test_fsdp_ranks_running_different_modules_stop_with_one_line_at_step_1(tmp_path):
    launch = _launch_dir(tmp_path)
    fix = "use strategy=ddp strategy.find_unused_parameters=true, or make every module run every step"
    # experts as FSDP units: rank 0 runs experts 0 and 2 where rank 1 runs 0 and 1; found before the gather
    r = run([*BASE, "wrap_policy=auto", f"hydra.run.dir={tmp_path / 'auto'}"], nproc=2, cwd=launch, fast=False,
            timeout=120)
    assert r.returncode != 0
    assert "config error: strategy='fsdp': the ranks ran different modules in step 1: where some ran FSDP unit " \
           "experts.1, others ran experts.2" in r.output, r.output[-3000:]
    assert fix in r.output and "Timed out" not in r.output and "refused the first batch" not in r.output
    # one unit (the root) holding every expert: the modules that ran on some ranks only are named
    r = run([*BASE, "wrap_policy=none", f"hydra.run.dir={tmp_path / 'none'}"], nproc=2, cwd=launch, fast=False,
            timeout=120)
    assert r.returncode != 0
    assert "config error: strategy='fsdp': experts.1.fc, experts.2.fc ran on some ranks and not on others in " \
           "step 1" in r.output, r.output[-3000:]
    assert fix in r.output and "collective mismatch" not in r.output
    # the same expert skipped on every rank (LayerDrop drawn alike): trains
    r = run([*BASE, "wrap_policy=auto", "+model.skip=all", f"hydra.run.dir={tmp_path / 'alike'}"], nproc=2,
            cwd=launch, fast=False, timeout=120)
    assert r.returncode == 0, r.output[-3000:]
    assert results(tmp_path / "alike")["steps"] == 3
