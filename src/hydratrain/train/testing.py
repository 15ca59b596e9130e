"""The test split, and evaluating a checkpoint without training.

    python train.py ... trainer.test_after_fit=true              # test the best (else the last) weights at the end
    python train.py ... mode=eval checkpoint.resume_from=RUN_DIR  # its best checkpoint, else its latest
    python train.py ... mode=eval model.init_from=model.safetensors

A data factory may return a ``test`` dataset beside ``train`` and ``val``; every sample of it is evaluated, once
each at any world size (as the eval set is). ``test/<metric>`` goes to TensorBoard and ``test_metrics`` to
``results.json``. ``mode=eval`` builds the run as for training (any strategy and world size), loads the weights,
evaluates the val split (``eval/*``, the run's ``trainer.eval_samples``) and the test split (``test/*``), and writes
``eval_results.json`` in its run dir; it trains nothing and writes no checkpoint.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Callable, Optional

from hydratrain.dist.collectives import barrier
from hydratrain.train.outputs import model_record
from hydratrain.train.progress import FitResult

log = logging.getLogger("hydratrain.eval")

RESULTS = "eval_results.json"


def evaluate_split(job: Any, batches: Any, prefix: str) -> dict:
    """``{"<prefix>/<name>": value}`` of the job's model on ``batches`` (every rank calls), logged in one line."""
    trainer = job.trainer
    job.strategy.sync_buffers(job.model)
    values = trainer.evaluator.on(batches).evaluate(job.model, trainer.autocast)
    log.info("%s: %s", prefix, " ".join(f"{name} {value:.6g}" for name, value in values.items()))
    return {f"{prefix}/{name}": value for name, value in values.items()}


def tester(job: Any, run_dir: Path) -> Optional[Callable[[Any], None]]:
    """For ``trainer.test_after_fit``: what :func:`hydratrain.train.outputs.write_outputs` calls after writing the
    last weights: loads the best weights (``best/model.safetensors``, when ``checkpoint.monitor`` kept some), tests
    them and puts ``test_metrics`` in the result and ``test/*`` in TensorBoard. None when the data has no test
    split (a config error when the job was built)."""
    if not job.cfg.trainer.test_after_fit or job.test_batches is None:
        return None

    def test(result: Any) -> None:
        from hydratrain.checkpoint.io import init_from_file  # (start-up: torch.distributed.checkpoint, ~0.3 s)

        barrier()  # rank 0 wrote best/model.safetensors at the end of fit
        best = run_dir / "best" / "model.safetensors"
        if best.is_file():
            init_from_file(job.model, best, model_record(job.cfg, job.vocab_size))
        which = f"the best weights (step {result.best['step']})" if best.is_file() and result.best else \
            "the last weights"
        log.info("testing %s on the test split", which)
        values = evaluate_split(job, job.test_batches, "test")
        job.step_logger.trackers.scalars(values, result.steps)
        result.test_metrics = {k.removeprefix("test/"): v for k, v in values.items()}

    return test


def evaluate_only(job: Any, run_dir: Path, source: Optional[Path], step: int, info: Any) -> FitResult:
    """``mode=eval``: the val and test splits' figures of the loaded weights (``source``: the checkpoint or file
    they came from; ``step``: its step), as ``eval/*`` and ``test/*`` in TensorBoard and ``eval_results.json``
    (rank 0). Returns a :class:`FitResult` whose ``objective`` is ``trainer.objective`` on the val split."""
    values = evaluate_split(job, job.trainer.evaluator.batches, "eval")
    if job.test_batches is not None:
        values.update(evaluate_split(job, job.test_batches, "test"))
    job.step_logger.trackers.scalars(values, step)
    job.step_logger.trackers.close()
    evals = {k.removeprefix("eval/"): v for k, v in values.items() if k.startswith("eval/")}
    tests = {k.removeprefix("test/"): v for k, v in values.items() if k.startswith("test/")}
    objective = job.cfg.trainer.objective
    result = FitResult(steps=step, steps_this_launch=0, eval_loss=evals.get("loss", float("nan")),
                       eval_perplexity=evals.get("perplexity", float("nan")),
                       eval_metrics={k: v for k, v in evals.items() if k not in ("loss", "perplexity")},
                       objective=values.get(objective, float("nan")), test_metrics=tests)
    if info.is_main:
        record = {"source": str(source) if source is not None else None, "step": step, "world_size": info.world_size,
                  "eval": evals, "test": tests, "objective": {objective: result.objective}}
        tmp = run_dir / f".{RESULTS}.tmp"
        tmp.write_text(json.dumps(record, indent=1, allow_nan=True) + "\n")
        os.replace(tmp, run_dir / RESULTS)
        log.info("evaluated %s (step %d) on %d rank(s): %s", source, step, info.world_size, run_dir / RESULTS)
    return result
