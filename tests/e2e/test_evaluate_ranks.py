"""Evaluating a trained run: a run trained on 2 gloo ranks under FSDP keeps, exports and tests its best checkpoint by
accuracy (rank 0 exports it alone, while the other rank waits: no collective between them), which reproduces the
value recorded for it, and the test split's figures are the same on 1 rank in this process and on 2 ranks
(mode=eval)."""
from __future__ import annotations

import json
import math

import pytest

from helpers import results, run

OWN = ["--config-dir", "my_conf", "+experiment=spirals", "device=cpu", "precision=fp32", "logger.peak_flops=1e11",
       "trainer.progress_bar=false", "data.n=600", "+data.test_fraction=0.2"]


@pytest.mark.slow  # (30 s here: a training run and an evaluation on 2 torchrun ranks, one in this process)
def test_a_runs_best_checkpoint_evaluates_alike_on_one_and_two_ranks(cli, own):
    trained = run([*OWN, "strategy=fsdp", "trainer.max_steps=12", "trainer.eval_every_n_steps=3",
                   "checkpoint.monitor=eval/accuracy", "checkpoint.mode=max", "checkpoint.save_top_k=2",
                   "trainer.test_after_fit=true", "distributed.collective_timeout_s=60"], own / "run", nproc=2,
                  cwd=own, fast=False, timeout=150)
    assert trained.returncode == 0, trained.output[-3000:]
    assert (own / "run" / "best" / "model.safetensors").is_file() and results(own / "run")["best"]
    best = json.loads((own / "run" / "best_checkpoints.json").read_text())["best"][0]
    tested = results(own / "run")["test_metrics"]  # at the end of the run, on the best weights
    assert set(tested) == {"loss", "accuracy"} and f"testing the best weights (step {best['step']})" in trained.output

    one = cli([*OWN, "strategy=single", "mode=eval", f"checkpoint.resume_from={own / 'run'}"], own / "one",
              fast=False)
    assert one.returncode == 0, one.output[-3000:]
    assert "data position remapped" not in one.output  # (trained on 2 ranks: nothing trains here, nothing remaps)
    two = run([*OWN, "strategy=fsdp", "mode=eval", f"checkpoint.resume_from={own / 'run'}"], own / "two", nproc=2,
              cwd=own, fast=False).ok()
    first, second = (json.loads((own / d / "eval_results.json").read_text()) for d in ("one", "two"))
    assert first["step"] == second["step"] == best["step"] and (first["world_size"], second["world_size"]) == (1, 2)
    assert first["eval"]["accuracy"] == best["value"]  # the best checkpoint reproduces its recorded value
    for split in ("eval", "test"):
        for name, value in first[split].items():
            assert math.isclose(second[split][name], value, rel_tol=0, abs_tol=1e-6), (split, name, two.output[-2000:])
    assert all(math.isclose(first["test"][k], v, abs_tol=1e-6) for k, v in tested.items())
    assert not (own / "one" / "checkpoints").exists() and not (own / "two" / "model.safetensors").exists()
