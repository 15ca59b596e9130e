"""Throughput, MFU and memory figures, and the rank-0 TensorBoard writer.

MFU (model FLOPs utilisation, PaLM, Chowdhery et al. 2022, appendix B) = achieved model FLOP/s / peak FLOP/s, where
achieved = tokens/s x FLOPs per token (6*N + 12*L*H*Q*T, see ``GPT.flops_per_token``) and peak is the per-device peak
times world_size. Peak: ``logger.peak_flops`` if set, else a table of dense bf16/fp16 tensor-core peaks for known
GPUs (vendor datasheets), else a matmul measured on this device in the compute dtype (CPU).
"""
from __future__ import annotations

import logging
import resource
import sys
import time
from pathlib import Path
from typing import Mapping, Optional

import torch

log = logging.getLogger(__name__)

# Dense (no sparsity) peak FLOP/s per GPU for bf16/fp16 tensor cores, from NVIDIA datasheets.
GPU_PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12, "V100": 125e12,
                  "L4": 121e12, "4090": 165e12, "3090": 71e12}


def measure_matmul_flops(device: torch.device, dtype: torch.dtype, m: int = 2048, n: int = 512,
                         budget_s: float = 0.5, min_iters: int = 3) -> float:
    """FLOP/s of ``F.linear`` on ``(m, n) x (n, n)`` in ``dtype`` on ``device`` (the kernels a model's Linear layers
    use) with this process's thread count: the best of repeated timed runs of ``2*m*n*n`` FLOPs, for about
    ``budget_s`` seconds (at least ``min_iters`` runs), so a moment of contention from other processes does not
    lower the peak much. Sustained contention still does: MFU on a shared CPU is indicative only."""
    a = torch.randn(m, n, device=device).to(dtype)
    w = torch.randn(n, n, device=device).to(dtype)
    best, iters, start = float("inf"), 0, time.perf_counter()
    torch.nn.functional.linear(a, w)  # warm-up
    while iters < min_iters or time.perf_counter() - start < budget_s:
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.nn.functional.linear(a, w)
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
        iters += 1
    return 2 * m * n * n / best


def peak_flops(device: torch.device, dtype: torch.dtype, configured: Optional[float]) -> float:
    """Peak FLOP/s of one device (see module docstring)."""
    if configured:
        return float(configured)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, value in GPU_PEAK_FLOPS.items():
            if key in name:
                return value if dtype != torch.float32 else value / 2  # tf32 dense peak is half of bf16's
    flops = measure_matmul_flops(device, dtype)
    log.info("peak FLOP/s for MFU: measured %.1f GFLOP/s (%s matmul on %s); set logger.peak_flops to override",
             flops / 1e9, dtype, device)
    return flops


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this rank in bytes: ``torch.cuda.max_memory_allocated`` on CUDA, else the process's max RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


class Throughput:
    """Tokens/s and MFU over the steps since the last :meth:`read` (all ranks' tokens together)."""

    def __init__(self, flops_per_token: float, peak_flops_total: float):
        self.flops_per_token, self.peak = flops_per_token, peak_flops_total
        self.tokens = 0
        self.t0 = time.perf_counter()

    def add(self, tokens: int) -> None:
        self.tokens += tokens

    def read(self) -> tuple[float, float]:
        """(tokens_per_sec, mfu in [0, 1]) since the previous read; resets the window."""
        now = time.perf_counter()
        tps = self.tokens / max(now - self.t0, 1e-9)
        self.tokens, self.t0 = 0, now
        return tps, tps * self.flops_per_token / self.peak


class TensorBoardLogger:
    """Rank 0's ``SummaryWriter`` at ``<run_dir>/tensorboard``; on other ranks (or when disabled) every call is a no-op.

    Hparams are written once, into the same event file as the scalars (``SummaryWriter.add_hparams`` would make a
    time-stamped sub-directory per call), so a sweep reads as one table with one row per run.
    """

    def __init__(self, log_dir: Path, enabled: bool):
        self.writer = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(log_dir))

    def scalars(self, values: Mapping[str, float], step: int) -> None:
        if self.writer:
            for tag, value in values.items():
                self.writer.add_scalar(tag, value, step)

    def purge_after(self, step: int) -> None:
        """Mark the events of steps after ``step`` stale (TensorBoard drops them when it loads the run)."""
        if self.writer:
            from tensorboard.compat.proto.event_pb2 import Event, SessionLog

            self.writer.file_writer.add_event(Event(step=step + 1, session_log=SessionLog(status=SessionLog.START)))

    def text(self, tag: str, text: str, step: int) -> None:
        if self.writer:
            self.writer.add_text(tag, text, step)

    def hparams(self, hparams: Mapping[str, object], metrics: Mapping[str, float], step: int) -> None:
        """One hparams row: ``hparams`` (flat, str/int/float/bool) against final ``metrics`` (scalars ``hparam/*``)."""
        if not self.writer:
            return
        from torch.utils.tensorboard.summary import hparams as hparams_summary

        clean = {k: (v if isinstance(v, (int, float, str, bool)) else str(v)) for k, v in hparams.items()}
        metric_tags = {f"hparam/{k}": v for k, v in metrics.items()}
        for summary in hparams_summary(clean, metric_tags):
            self.writer.file_writer.add_summary(summary)
        self.scalars(metric_tags, step)

    def close(self) -> None:
        if self.writer:
            self.writer.close()
