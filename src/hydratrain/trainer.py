"""The training loop: gradient accumulation, clipping, loss scaling, lr schedule, eval, logging, final outputs.

One optimizer step = ``trainer.grad_accum_steps`` micro-batches of ``data.batch_size`` samples on every rank, i.e.
``grad_accum_steps * batch_size * seq_len * world_size`` tokens. Gradient sync runs only on the last micro-batch
(DDP ``no_sync``; FSDP2 ``set_requires_gradient_sync``).
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hydratrain.data import ShardedBatches
from hydratrain.distributed import DistInfo
from hydratrain.metrics import TensorBoardLogger, Throughput, peak_memory_bytes
from hydratrain.parallelize import unwrap
from hydratrain.precision import autocast_context

log = logging.getLogger(__name__)


@dataclass
class TrainState:
    """Counters that define where a run is: optimizer ``step`` done and fp16 steps skipped by the scaler."""

    step: int = 0
    skipped_steps: int = 0
    first_loss: float = math.nan  # train loss of step 1 (kept across resumes)


@dataclass
class FitResult:
    """Final figures of a run (rank-0 view, all reduced across ranks)."""

    steps: int = 0  # the step the run ended at
    steps_this_launch: int = 0  # steps trained by this launch (fewer than ``steps`` after a resume)
    first_loss: float = math.nan  # train loss of step 1
    train_loss: float = math.nan  # mean train loss of the last logging window
    eval_loss: float = math.nan
    eval_perplexity: float = math.nan
    tokens_per_sec: float = math.nan  # mean over the run, excluding the first step (start-up, compile)
    mfu: float = math.nan
    peak_memory_bytes: int = 0  # max over ranks
    skipped_steps: int = 0
    seconds: float = 0.0
    preempted: bool = False  # stopped early by SIGTERM after saving a checkpoint (no final eval)


def all_reduce_mean(values: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over ranks (in place when a process group exists)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
        values /= dist.get_world_size()
    return values


def all_reduce_max(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


class Trainer:
    """Runs ``fit()`` for a parallelized model. All ranks construct it and call every method together."""

    def __init__(self, cfg, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler, scaler,
                 train_batches: ShardedBatches, val_batches: ShardedBatches, dist_info: DistInfo, run_dir: Path,
                 flops_per_token: float, peak_flops: float):
        self.cfg, self.model, self.optimizer, self.scheduler, self.scaler = cfg, model, optimizer, scheduler, scaler
        self.train_batches, self.val_batches, self.info, self.run_dir = train_batches, val_batches, dist_info, run_dir
        self.device = dist_info.device
        self.state = TrainState()
        self.tb = TensorBoardLogger(run_dir / "tensorboard", cfg.logger.tensorboard and dist_info.is_main)
        self.autocast = autocast_context(cfg.precision, self.device, cfg.strategy.name)
        self.tokens_per_step = (cfg.trainer.grad_accum_steps * cfg.data.batch_size * cfg.data.seq_len
                                * dist_info.world_size)
        self.throughput = Throughput(flops_per_token, peak_flops * dist_info.world_size)
        self.max_steps = self.total_steps(cfg.trainer, train_batches.batches_per_epoch)
        # Sum of this rank's step losses since the last log line and their count (restored on resume, so a resumed
        # run logs the same window means as an uninterrupted one).
        self.window_loss = torch.zeros((), device=self.device)
        self.window_steps = 0
        self.checkpointer = None  # a hydratrain.checkpoint.Checkpointer: after_step()/at_end() hooks

    @staticmethod
    def total_steps(trainer_cfg, batches_per_epoch: int) -> int:
        """Optimizer steps the run will take: ``max_steps`` capped by ``max_epochs`` worth of micro-batches."""
        steps = []
        if trainer_cfg.max_steps is not None:
            steps.append(trainer_cfg.max_steps)
        if trainer_cfg.max_epochs is not None:
            steps.append(trainer_cfg.max_epochs * batches_per_epoch // trainer_cfg.grad_accum_steps)
        return max(0, min(steps))

    # ----------------------------------------------------------------------------------------------- steps
    def _grad_sync(self, enabled: bool):
        """Context that turns gradient sync on/off for this micro-batch (DDP no_sync / FSDP2 flag)."""
        if hasattr(self.model, "set_requires_gradient_sync"):  # FSDP2
            self.model.set_requires_gradient_sync(enabled)
            return contextlib.nullcontext()
        if isinstance(self.model, nn.parallel.DistributedDataParallel) and not enabled:
            return self.model.no_sync()
        return contextlib.nullcontext()

    def loss_of(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy (nats/token) of a micro-batch ``x, y`` of shape ``(B, T)``."""
        with self.autocast:
            logits = self.model(x)
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())

    def train_step(self, batches) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """One optimizer step over ``grad_accum_steps`` micro-batches.

        Returns (mean loss over the micro-batches, pre-clipping global grad norm, whether the step was skipped
        because the fp16 scaler found inf/nan gradients).
        """
        accum = self.cfg.trainer.grad_accum_steps
        total = torch.zeros((), device=self.device)
        for micro in range(accum):
            x, y = next(batches)
            with self._grad_sync(micro == accum - 1):
                loss = self.loss_of(x, y)
                scaled = loss / accum
                (self.scaler.scale(scaled) if self.scaler else scaled).backward()
            total += loss.detach()
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        grad_norm = self.clip_gradients()
        skipped = False
        if self.scaler:
            scale_before = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            skipped = self.scaler.get_scale() < scale_before  # the scale drops exactly when the step was skipped
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return total / accum, grad_norm, skipped

    def clip_gradients(self) -> torch.Tensor:
        """Global L2 norm of all gradients (across ranks and FSDP shards); clip to ``trainer.grad_clip`` if > 0."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
        if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor partial norm -> reduce over the mesh
            norm = norm.full_tensor()
        if self.cfg.trainer.grad_clip > 0:
            torch.nn.utils.clip_grads_with_norm_(params, self.cfg.trainer.grad_clip, norm)
        return norm

    # ------------------------------------------------------------------------------------------------ eval
    @torch.no_grad()
    def evaluate(self) -> tuple[float, float]:
        """(mean loss, perplexity) over ``trainer.eval_batches`` val micro-batches per rank, synced over ranks.

        Uses torchmetrics ``MeanMetric`` (token-weighted loss) and ``text.Perplexity``; every rank calls compute().
        """
        from torchmetrics import MeanMetric
        from torchmetrics.text import Perplexity

        mean_loss = MeanMetric().to(self.device)
        perplexity = Perplexity().to(self.device)
        self.model.eval()
        n = self.cfg.trainer.eval_batches or self.val_batches.batches_per_epoch
        self.val_batches.state.epoch, self.val_batches.state.batch_in_epoch = 0, 0
        batches = iter(self.val_batches)
        for _ in range(min(n, self.val_batches.batches_per_epoch)):
            x, y = next(batches)
            with self.autocast:
                logits = self.model(x).float()
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            mean_loss.update(loss, weight=y.numel())
            perplexity.update(logits, y)
        self.model.train()
        return mean_loss.compute().item(), perplexity.compute().item()

    # ------------------------------------------------------------------------------------------------- fit
    def fit(self) -> FitResult:
        """Train until ``max_steps``/``max_epochs``; eval every ``eval_every_n_steps`` and at the end; write outputs."""
        cfg, result = self.cfg.trainer, FitResult()
        log.info("training for %d steps: %d tokens/step (grad_accum_steps=%d x batch_size=%d x seq_len=%d x "
                 "world_size=%d), %d micro-batches per epoch per rank", self.max_steps, self.tokens_per_step,
                 cfg.grad_accum_steps, self.cfg.data.batch_size, self.cfg.data.seq_len, self.info.world_size,
                 self.train_batches.batches_per_epoch)
        bar, quiet_logs = None, contextlib.ExitStack()
        if self.info.is_main and cfg.progress_bar:
            from tqdm.auto import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            # disable=None: no bar when stderr is not a terminal (logs, pipes); the log lines carry progress there
            bar = tqdm(total=self.max_steps, initial=self.state.step, desc="train", unit="step", dynamic_ncols=True,
                       mininterval=1.0, disable=None)
            quiet_logs.enter_context(logging_redirect_tqdm())  # log lines above the bar, not glued onto it
        batches = iter(self.train_batches)
        t_start, tps_sum, mfu_sum, n_rates = time.perf_counter(), 0.0, 0.0, 0
        first = self.state.step + 1  # this launch's first step (> 1 after a resume)
        self.model.train()
        while self.state.step < self.max_steps:
            loss, grad_norm, skipped = self.train_step(batches)
            self.state.step += 1
            self.state.skipped_steps += int(skipped)
            self.window_loss += loss
            self.window_steps += 1
            self.throughput.add(self.tokens_per_step)
            step = self.state.step
            if bar:
                bar.update(1)
            if step == first:
                self.throughput.read()  # drop start-up (allocations, compile) from the rate
            if step == 1 or step % cfg.log_every_n_steps == 0 or step == self.max_steps:
                stats = all_reduce_mean(torch.stack([self.window_loss / self.window_steps, grad_norm.float()]))
                train_loss, norm = stats.tolist()
                tps, mfu = self.throughput.read() if step > first else (math.nan, math.nan)
                if step == 1:
                    self.state.first_loss = train_loss
                scalars = {"train/loss": train_loss, "train/lr": self.scheduler.get_last_lr()[0],
                           "train/grad_norm": norm, "mem/peak": peak_memory_bytes(self.device)}
                if step > first:
                    scalars.update({"perf/tokens_per_sec": tps, "perf/mfu": mfu})
                    tps_sum, mfu_sum, n_rates = tps_sum + tps, mfu_sum + mfu, n_rates + 1
                if self.scaler:
                    scalars.update({"train/loss_scale": self.scaler.get_scale(),
                                    "train/skipped_steps": self.state.skipped_steps})
                self.tb.scalars(scalars, step)
                result.train_loss = train_loss
                msg = (f"step {step}/{self.max_steps} loss {train_loss:.4f} lr {scalars['train/lr']:.2e} "
                       f"grad_norm {norm:.3f}" + (f" tokens/s {tps:,.0f} mfu {mfu:.2%}" if step > first else ""))
                if self.scaler:
                    msg += f" loss_scale {self.scaler.get_scale():.0f} skipped {self.state.skipped_steps}"
                log.info(msg)
                if bar:
                    bar.set_postfix(loss=f"{train_loss:.3f}", refresh=False)
                self.window_loss.zero_()
                self.window_steps = 0
            if cfg.eval_every_n_steps and step % cfg.eval_every_n_steps == 0 and step < self.max_steps:
                self._eval_and_log(step)
                self.throughput.read()  # keep eval time out of tokens/s
            if self.checkpointer is not None and self.checkpointer.after_step(self):
                result.preempted = True
                break
        if bar:
            bar.close()
            quiet_logs.close()
        result.steps = self.state.step
        result.steps_this_launch = self.state.step - first + 1
        result.first_loss = self.state.first_loss
        result.skipped_steps = self.state.skipped_steps
        if result.preempted:
            return result
        if self.checkpointer is not None:
            self.checkpointer.at_end(self)
        result.eval_loss, result.eval_perplexity = self._eval_and_log(self.state.step)
        result.seconds = time.perf_counter() - t_start
        result.tokens_per_sec = tps_sum / n_rates if n_rates else math.nan
        result.mfu = mfu_sum / n_rates if n_rates else math.nan
        result.peak_memory_bytes = int(all_reduce_max(peak_memory_bytes(self.device), self.device))
        result.skipped_steps = self.state.skipped_steps
        return result

    def _eval_and_log(self, step: int) -> tuple[float, float]:
        loss, ppl = self.evaluate()
        self.tb.scalars({"eval/loss": loss, "eval/perplexity": ppl}, step)
        log.info("eval at step %d: loss %.4f perplexity %.3f", step, loss, ppl)
        return loss, ppl

    # --------------------------------------------------------------------------------------------- outputs
    def finish(self, result: FitResult, hparams: dict) -> None:
        """Write hparams + final metrics to TensorBoard and ``results.json`` (rank 0), then close the writer."""
        metrics = {"train_loss": result.train_loss, "eval_loss": result.eval_loss,
                   "eval_perplexity": result.eval_perplexity, "tokens_per_sec": result.tokens_per_sec,
                   "mfu": result.mfu, "peak_memory_bytes": float(result.peak_memory_bytes)}
        self.tb.hparams(hparams, metrics, result.steps)
        self.tb.close()
        if self.info.is_main:
            payload = {**result.__dict__, "hparams": hparams}
            tmp = self.run_dir / f".results.json.tmp{os.getpid()}"
            payload = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in payload.items()}
            tmp.write_text(json.dumps(payload, indent=1, default=str, allow_nan=False))
            os.replace(tmp, self.run_dir / "results.json")

    def save_weights(self, path: Path) -> Optional[Path]:
        """Gather the full (unsharded) weights on rank 0 and write them to ``path`` as safetensors, atomically.

        Every rank must call (FSDP all-gathers). Keys are the model's own parameter names (no DDP/AC/compile
        prefixes). Returns ``path`` on rank 0, None elsewhere.
        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not self.info.is_main:
            return None
        from hydratrain.export import write_safetensors

        state = {k: v.clone() for k, v in state.items()}  # tied weights share storage; safetensors wants one each
        return write_safetensors(state, path, {"format": "pt", "producer": "hydratrain"})

    @torch.no_grad()
    def sample(self, prompt: bytes, n_tokens: int, temperature: float = 0.8, top_k: int = 40) -> str:
        """Generate ``n_tokens`` bytes after ``prompt`` (byte-level vocab); every rank calls, rank 0's draws win.

        Each token is drawn on rank 0 from the top-k softmax at ``temperature`` and broadcast, so sharded (FSDP)
        forwards stay in lockstep. Returns the decoded text (prompt included) on every rank.
        """
        model = unwrap(self.model)
        model.eval()
        max_len = model.cfg.max_seq_len
        idx = torch.tensor([list(prompt)], dtype=torch.long, device=self.device)
        gen = torch.Generator(device="cpu").manual_seed(self.cfg.trainer.seed)
        for _ in range(n_tokens):
            with self.autocast:
                logits = model(idx[:, -max_len:])[0, -1].float().cpu()
            vals, ids = torch.topk(logits / temperature, min(top_k, logits.numel()))
            nxt = ids[torch.multinomial(torch.softmax(vals, -1), 1, generator=gen)].to(self.device).view(1, 1)
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.broadcast(nxt, src=0)
            idx = torch.cat([idx, nxt], dim=1)
        model.train()
        return bytes(t % 256 for t in idx[0].tolist()).decode("utf-8", errors="replace")
