"""``main(cfg)``: validate -> init distributed -> build data, model, optimizer -> ``Trainer.fit`` -> always tear down.

``train.py`` is a thin ``@hydra.main`` wrapper around :func:`main`; tests call :func:`main` with a composed config.
"""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig, OmegaConf

from hydratrain.config import ConfigError, validate
from hydratrain.distributed import DistInfo, barrier, distributed, quiet_non_main_console

log = logging.getLogger("hydratrain")


def build_model(cfg: DictConfig, info: DistInfo):
    """The GPT of ``cfg.model``, parallelized per ``cfg.strategy``. Returns (model, raw GPT, summary line).

    ``model.init_device``: ``meta`` (or ``auto`` with strategy=fsdp and a model of over 100M parameters) builds
    without storage so only shards are ever allocated.
    """
    import torch

    from hydratrain.models.gpt import GPT, GPTConfig
    from hydratrain.parallelize import parallelize

    fields = {k: cfg.model[k] for k in GPTConfig.__dataclass_fields__}
    gcfg = GPTConfig(**fields)
    with torch.device("meta"):
        n_params = GPT(gcfg).num_params()
    on_meta = cfg.model.init_device == "meta" or (
        cfg.model.init_device == "auto" and cfg.strategy.name == "fsdp" and n_params > 100e6)
    build_device = torch.device("meta") if on_meta else (
        info.device if cfg.model.init_device in ("auto", info.device.type) else torch.device(cfg.model.init_device))
    with build_device:
        raw = GPT(gcfg)
    model, summary = parallelize(raw, cfg, info.device, on_meta)
    return model, raw, n_params, summary


def build_data(cfg: DictConfig, info: DistInfo):
    """Train and val :class:`~hydratrain.data.ShardedBatches` for this rank (local rank 0 builds caches first)."""
    from hydratrain.data import ShardedBatches, TokenDataset, load_splits

    launch_dir = Path(os.getcwd())
    kwargs = dict(data_cfg=cfg.data, vocab_size=cfg.model.vocab_size, launch_dir=launch_dir,
                  progress=info.is_main and cfg.trainer.progress_bar)
    splits = load_splits(**kwargs) if info.local_rank == 0 else None
    barrier()
    if splits is None:
        splits = load_splits(**kwargs)
    out = []
    for split in ("train", "val"):
        try:
            out.append(ShardedBatches(TokenDataset(splits[split], cfg.data.seq_len), cfg.data.batch_size, info.rank,
                                      info.world_size, seed=cfg.trainer.seed, shuffle=split == "train",
                                      device=info.device))
        except ValueError as err:  # too little data for seq_len x batch_size x world_size
            raise ConfigError("data", cfg.data.name, f"{split} split ({len(splits[split])} tokens): {err}") from None
    return tuple(out)


def hparams_of(cfg: DictConfig, world_size: int) -> dict:
    """The flat hyper-parameters written once per run to TensorBoard's hparams table."""
    keys = ["model.name", "model.d_model", "model.n_layer", "data.name", "data.seq_len", "data.batch_size",
            "strategy.name", "precision.name", "wrap_policy.name", "optim.lr", "optim.weight_decay",
            "scheduler.name", "trainer.max_steps", "trainer.grad_accum_steps", "trainer.seed",
            "activation_checkpointing"]
    out = {k: OmegaConf.select(cfg, k) for k in keys}
    out["world_size"] = world_size
    out.update(_override_hparams(cfg))
    return {k: ("null" if v is None else v) for k, v in out.items()}


def _override_hparams(cfg: DictConfig) -> dict:
    """This Hydra job's command-line overrides as ``{key: value}`` (so any swept key is an hparams column); the
    config's typed value for leaf keys (``optim.lr`` -> 0.001), the chosen option for groups (``strategy`` -> ddp)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return {}
    out = {}
    for item in HydraConfig.get().overrides.task:
        key, sep, value = str(item).partition("=")
        key = key.lstrip("+")
        if sep and not key.startswith(("hydra.", "~")):
            typed = OmegaConf.select(cfg, key, default=None)
            out[key] = typed if isinstance(typed, (int, float, str, bool)) else value
    return out


def run_dir_of(cfg: DictConfig) -> Path:
    """Hydra's output dir for this job (the current dir when called without Hydra)."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir)
    return Path(os.getcwd())


def preflight(cfg: DictConfig) -> None:
    """All checks that need no process group: :func:`validate`, the launch environment, and data paths.

    Raises :class:`ConfigError`.
    """
    from hydratrain.distributed import env_rank_info

    validate(cfg)
    if cfg.precision.name == "auto":
        from hydratrain.precision import resolve_auto

        choice = resolve_auto(cfg.precision, cfg.device)
        log.info("precision=auto -> %s compute (%s)", choice, cfg.precision.compute_dtype)
    import torch
    import torch.distributed as dist

    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device", "cuda", "torch sees no CUDA device here; allowed: auto, cpu")
    if cfg.strategy.backend == "nccl" and not (dist.is_available() and dist.is_nccl_available()):
        raise ConfigError("strategy.backend", "nccl", "this torch has no NCCL; allowed here: gloo (or null)")
    world_size = env_rank_info()[2]
    if cfg.strategy.name == "single" and world_size > 1:
        raise ConfigError("strategy.name", "single", f"runs one process but WORLD_SIZE={world_size}; "
                          "allowed under torchrun: ddp, fsdp")
    if cfg.data.name == "text_files":
        from hydratrain.data import expand_paths

        try:
            expand_paths(list(cfg.data.paths), Path(os.getcwd()))
        except FileNotFoundError as err:
            raise ConfigError("data.paths", list(cfg.data.paths), str(err).split(": ", 1)[1]) from None
    for key in ("model.init_from", "checkpoint.resume_from"):
        value = OmegaConf.select(cfg, key)
        if value and not (Path(os.getcwd()) / Path(value).expanduser()).exists():
            raise ConfigError(key, value, f"no such path (relative paths are resolved against {os.getcwd()})")


def main(cfg: DictConfig, run_dir: Optional[Path] = None):
    """Train per ``cfg`` (a composed :class:`~hydratrain.config.TrainConfig`). Returns the :class:`FitResult`.

    A bad config prints ``hydratrain: config error: <key>=<value>: <why>`` and exits with status 2 before any
    process group is created.
    """
    from hydratrain.checkpoint import EXIT_CHECKPOINT_ERROR, CheckpointError, find_resume

    try:
        preflight(cfg)
        run_dir = Path(run_dir) if run_dir is not None else run_dir_of(cfg)
        resume = find_resume(cfg, run_dir, Path(os.getcwd()))
        need_group = cfg.strategy.name in ("ddp", "fsdp")
        with distributed(cfg.device, cfg.strategy.backend, need_group) as info:
            quiet_non_main_console(info.rank)
            result = _train(cfg, info, run_dir, resume)
    except (ConfigError, CheckpointError) as err:
        kind = "config" if isinstance(err, ConfigError) else "checkpoint"
        print(f"hydratrain: {kind} error: {err}", file=sys.stderr)
        if _in_multirun():
            raise  # Hydra records the job as failed and the sweep goes on
        raise SystemExit(2 if kind == "config" else EXIT_CHECKPOINT_ERROR) from None
    if result.preempted:
        raise SystemExit(cfg.checkpoint.preempt_exit_code)
    return result


def _in_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def _agree_on_resume(resume: Optional[Path], device) -> None:
    """Raise CheckpointError unless every rank found the same checkpoint step to resume from (-1: none)."""
    import torch
    import torch.distributed as dist

    from hydratrain.checkpoint import CheckpointError, step_of

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    mine = -1 if resume is None else (step_of(resume) or 0)
    t = torch.tensor([mine, -mine], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if t[0].item() != -t[1].item():
        raise CheckpointError(f"ranks found different checkpoints to resume from (this rank: {resume}); is the "
                              "run dir on a filesystem every node shares?")


def _train(cfg: DictConfig, info: DistInfo, run_dir: Path, resume: Optional[Path] = None):
    import random

    import numpy as np
    import torch

    from hydratrain.checkpoint import Checkpointer
    from hydratrain.checkpoint_io import init_from_file
    from hydratrain.metrics import peak_flops
    from hydratrain.optim import build_optimizer, build_scheduler
    from hydratrain.parallelize import local_param_bytes
    from hydratrain.precision import dtype_of, grad_scaler
    from hydratrain.trainer import Trainer

    log.info("run dir %s; rank %d of %d on %s; torch %s", run_dir, info.rank, info.world_size, info.device,
             torch.__version__)
    torch.manual_seed(cfg.trainer.seed)
    # python's and numpy's global RNGs too, so every RNG state a checkpoint holds is reproducible (unseeded, they
    # would start from OS entropy)
    random.seed(cfg.trainer.seed)
    np.random.seed(cfg.trainer.seed % 2**32)
    train_batches, val_batches = build_data(cfg, info)
    model, raw, n_params, summary = build_model(cfg, info)
    log.info("model %s: %.2fM parameters, this rank holds %.2f MB of them; %s", cfg.model.name, n_params / 1e6,
             local_param_bytes(model) / 1e6, summary)
    _agree_on_resume(resume, info.device)
    if cfg.model.init_from and resume is not None:
        log.info("model.init_from=%s not used: resuming from %s", cfg.model.init_from, resume)
    elif cfg.model.init_from:
        init_from_file(model, Path(os.getcwd()) / Path(cfg.model.init_from).expanduser())
    optimizer = build_optimizer(model, cfg.optim)
    total = Trainer.total_steps(cfg.trainer, train_batches.batches_per_epoch)
    if total == 0:
        raise ConfigError("trainer.max_epochs", cfg.trainer.max_epochs,
                          f"gives 0 optimizer steps: an epoch has {train_batches.batches_per_epoch} micro-batches per "
                          f"rank, fewer than trainer.grad_accum_steps={cfg.trainer.grad_accum_steps}")
    scheduler = build_scheduler(optimizer, cfg.scheduler, total)
    compute = dtype_of(cfg.precision.compute_dtype)
    trainer = Trainer(cfg, model, optimizer, scheduler, grad_scaler(cfg.precision, info.device), train_batches,
                      val_batches, info, run_dir, raw.flops_per_token(cfg.data.seq_len),
                      peak_flops(info.device, compute, cfg.logger.peak_flops))
    checkpointer = Checkpointer(cfg, run_dir / "checkpoints", info.device)
    trainer.checkpointer = checkpointer
    try:
        if resume is not None:
            checkpointer.load(trainer, resume)
            if trainer.state.step >= trainer.max_steps:
                log.warning("resumed at step %d, which is already at or past the %d steps this config trains "
                            "(trainer.max_steps / max_epochs): nothing to train, evaluating only",
                            trainer.state.step, trainer.max_steps)
        result = trainer.fit()
    finally:
        checkpointer.close()
    if result.preempted:
        trainer.tb.close()
        return result
    if cfg.trainer.save_weights:
        path = trainer.save_weights(run_dir / "model.safetensors")
        if path:
            log.info("wrote full model weights to %s", path)
    if cfg.trainer.sample_tokens and cfg.model.vocab_size >= 256 and cfg.data.name != "synthetic":
        text = trainer.sample(b"def " if cfg.data.name == "python_stdlib" else b"\n", cfg.trainer.sample_tokens)
        log.info("sample:\n%s", text)
        trainer.tb.text("sample", text, result.steps)
    trainer.finish(result, hparams_of(cfg, info.world_size))
    log.info("done: step %d (%d steps in this launch, %.1f s); train loss %.4f (step 1: %.4f), eval loss %.4f, "
             "perplexity %.2f, %.0f tokens/s, mfu %.2f%%, peak memory %.1f MB, skipped steps %d", result.steps,
             result.steps_this_launch, result.seconds, result.train_loss, result.first_loss, result.eval_loss, result.eval_perplexity, result.tokens_per_sec,
             100 * result.mfu, result.peak_memory_bytes / 1e6, result.skipped_steps)
    return result
