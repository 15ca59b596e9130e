"""Precision presets -> autocast context, FSDP2 ``MixedPrecisionPolicy`` and ``GradScaler``.

- fp32: everything float32.
- bf16: bfloat16 compute, float32 master weights, optimizer state and gradient reduction. No scaler.
- auto: bf16 where the device computes it natively (CUDA with bf16 support; a CPU with AVX512-BF16 or AMX), else
  fp32. On a CPU without native bf16 (AVX2 only), bf16 matmuls run ~10x slower than fp32 (measured: 11 vs 103
  GFLOP/s on the build machine's AMD EPYC), so auto picks fp32 there. The choice is logged.
- fp16: float16 compute, float32 master weights, dynamic loss scaling with ``torch.amp.GradScaler``. Gradients are
  reduced across ranks before the scaler looks for infs (DDP all-reduce, FSDP reduce-scatter), and the inf check
  over FSDP's sharded DTensor gradients is reduced across ranks, so every rank makes the same skip decision.

Under ``strategy=fsdp`` parameters are cast by FSDP (``MixedPrecisionPolicy(param_dtype=compute_dtype,
reduce_dtype=...)``); under ``single``/``ddp`` ``torch.autocast`` casts per op.
"""
from __future__ import annotations

import contextlib
from typing import ContextManager, Optional

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_of(name: str) -> torch.dtype:
    return DTYPES[name]


def cpu_has_native_bf16() -> bool:
    """True when /proc/cpuinfo lists avx512_bf16 or amx_bf16 (Linux); False elsewhere."""
    try:
        with open("/proc/cpuinfo") as fh:
            flags = fh.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_auto(precision_cfg, device_kind: str) -> str:
    """For ``precision=auto``, set ``compute_dtype`` to bfloat16 or float32 (see module docstring) in place.

    ``device_kind`` is the run's ``device`` key (auto | cpu | cuda). Returns the preset it stands for: bf16 | fp32.
    """
    on_cuda = device_kind == "cuda" or (device_kind == "auto" and torch.cuda.is_available())
    fast_bf16 = torch.cuda.is_bf16_supported() if on_cuda else cpu_has_native_bf16()
    choice = "bf16" if fast_bf16 else "fp32"
    precision_cfg.compute_dtype = "bfloat16" if fast_bf16 else "float32"
    return choice


def autocast_context(precision_cfg, device: torch.device, strategy: str) -> ContextManager:
    """``torch.autocast`` for single/ddp when compute is not fp32; a no-op for fp32 or FSDP (which casts params)."""
    dtype = dtype_of(precision_cfg.compute_dtype)
    if dtype == torch.float32 or strategy == "fsdp":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def mixed_precision_policy(precision_cfg):
    """FSDP2 ``MixedPrecisionPolicy``: params gathered in the compute dtype, gradients reduced in ``reduce_dtype``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    compute = dtype_of(precision_cfg.compute_dtype)
    return MixedPrecisionPolicy(param_dtype=None if compute == torch.float32 else compute,
                                reduce_dtype=dtype_of(precision_cfg.reduce_dtype), output_dtype=None)


def grad_scaler(precision_cfg, device: torch.device) -> Optional[torch.amp.GradScaler]:
    """A ``torch.amp.GradScaler`` for fp16 (``precision.grad_scaler=true``), else None."""
    if not precision_cfg.grad_scaler:
        return None
    return torch.amp.GradScaler(device.type, init_scale=precision_cfg.init_scale)
