"""Number formats, resolved once per run from the ``precision`` config and the device: :class:`Precision`.

- fp32: everything float32 (on CUDA, float32 matmuls may use TF32 tensor cores: ``precision.tf32``).
- bf16: bfloat16 compute; float32 master weights, optimizer state and gradient reduction. No scaler.
- fp16: float16 compute, float32 master weights, dynamic loss scaling with ``torch.amp.GradScaler``. Gradients are
  reduced across ranks before the scaler looks for infs (DDP all-reduce, FSDP reduce-scatter), and the inf check
  over FSDP's sharded gradients is reduced across ranks, so every rank makes the same skip decision.
- fp8: bf16 as above, plus torchao's float8 training on the model's Linear layers (:mod:`hydratrain.parallel.float8`:
  which layers, the recipe, FSDP's float8 all-gather); the strategy converts them (``Strategy.parallelize``).
- auto: bf16 where the device computes it natively -- a CUDA device with native bf16
  (``torch.cuda.is_bf16_supported(including_emulation=False)``: not V100/T4, which only emulate it), or a CPU with
  AVX512-BF16 or AMX -- else fp32. On an AVX2-only CPU bf16 matmuls run ~10x slower than fp32 (measured 11 vs 103
  GFLOP/s on an AMD EPYC core), so auto picks fp32 there.

Resolving never writes into the config: :meth:`Precision.resolve` returns a new frozen object. Where the cast happens
(FSDP's ``MixedPrecisionPolicy`` or ``torch.autocast``) is the strategy's decision
(``hydratrain.parallel.strategy``).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import ContextManager, Optional

import torch

from hydratrain.metrics import matmul_flops
from hydratrain.parallel.float8 import Float8

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PRESET_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# fp8 computes in bf16 what its float8 gemms do not (activations, norms, attention, the layers kept in bf16)
AS_PRESET = {"fp8": "bf16"}
# A precision whose matmuls run this many times slower than those of the preset ``auto`` picks is a slow path worth a
# warning (fp16 on a CPU without native fp16: ~100x; bf16 on an AVX2-only CPU: ~10x; fp32 without TF32 on an A100:
# 16x). fp32 against native bf16 (3.8-4.6x on an AVX512-BF16 CPU, 2x against TF32 on a GPU) stays below it.
SLOW_FACTOR = 5.0


def cpu_has_native_bf16() -> bool:
    """True when /proc/cpuinfo lists avx512_bf16 or amx_bf16 (Linux); False elsewhere."""
    try:
        with open("/proc/cpuinfo") as fh:
            flags = fh.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` computes bf16 matmuls natively (call after ``torch.cuda.set_device``)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    return cpu_has_native_bf16()


def auto_preset(device: torch.device) -> str:
    """The preset ``precision=auto`` resolves to on ``device``: bf16 where it is native, else fp32."""
    return "bf16" if native_bf16(device) else "fp32"


@dataclass(frozen=True)
class Precision:
    """The run's number formats.

    Attributes:
        name: the resolved preset, ``fp32`` | ``bf16`` | ``fp16`` | ``fp8`` (never ``auto``).
        requested: the configured ``precision.name`` (may be ``auto``).
        compute_dtype: dtype of matmuls and activations.
        reduce_dtype: dtype of the cross-rank gradient reduction.
        use_scaler: dynamic loss scaling (fp16 only).
        init_scale: the scaler's first scale; growth_interval: clean steps before it doubles.
        tf32: float32 matmuls may use TF32 (CUDA only).
        fsdp_autocast: FSDP's forward runs under ``torch.autocast`` too (``precision.fsdp_autocast``).
        float8: ``precision=fp8``'s settings (:class:`~hydratrain.parallel.float8.Float8`); None for the others.
    """

    name: str
    requested: str
    compute_dtype: torch.dtype
    reduce_dtype: torch.dtype
    use_scaler: bool = False
    init_scale: float = 65536.0
    growth_interval: int = 2000
    tf32: bool = False
    fsdp_autocast: bool = False
    float8: Optional[Float8] = None

    @classmethod
    def resolve(cls, cfg, device: torch.device) -> "Precision":
        """The :class:`Precision` for the ``precision`` config node ``cfg`` on ``device`` (``auto`` made concrete).
        Reads ``cfg`` only."""
        requested = str(cfg.name)
        name = requested if requested != "auto" else auto_preset(device)
        return cls(name=name, requested=requested, compute_dtype=PRESET_DTYPE[AS_PRESET.get(name, name)],
                   reduce_dtype=DTYPES[str(cfg.reduce_dtype)], use_scaler=name == "fp16",
                   init_scale=float(cfg.get("init_scale", 65536.0)),
                   growth_interval=int(cfg.get("growth_interval", 2000)),
                   tf32=bool(cfg.tf32) and device.type == "cuda" and name == "fp32",
                   fsdp_autocast=bool(cfg.get("fsdp_autocast", False)),
                   float8=Float8(str(cfg.fp8_recipe), bool(cfg.fp8_emulate), bool(cfg.fp8_size_rule))
                   if name == "fp8" else None)

    def describe(self) -> str:
        """One line for the log: ``precision=auto -> bf16 (compute bfloat16, reduce float32)``."""
        head = f"precision={self.requested}" + (f" -> {self.name}" if self.requested != self.name else "")
        extra = ", TF32 matmuls" if self.tf32 else ""
        if self.float8 is not None:
            extra += (f", float8 matmuls ({self.float8.recipe} scaling"
                      f"{', emulated' if self.float8.emulate else ''})")
        return (f"{head} (compute {str(self.compute_dtype).removeprefix('torch.')}, reduce "
                f"{str(self.reduce_dtype).removeprefix('torch.')}{', grad scaler' if self.use_scaler else ''}{extra})")

    def slow_path(self, device: torch.device, cache_dir: Optional[Path] = None) -> Optional[str]:
        """A one-line warning when this precision's matmuls run at least :data:`SLOW_FACTOR` times slower on
        ``device`` than those of the preset ``precision=auto`` picks there, with the measured factor; else None.

        The rates are the ones MFU uses (:func:`hydratrain.metrics.matmul_flops`): on CPU the matmul measured
        per machine and dtype and cached, on CUDA the datasheet peak of the device (measured when the table has
        none, e.g. bf16 on a V100, which only emulates it). Costs nothing when this is the preset auto picks."""
        faster = auto_preset(device)
        if faster == self.name:
            return None
        tf32 = device.type == "cuda" and faster == "fp32"  # auto's fp32 uses TF32 on CUDA (precision.tf32: true)
        mine, _ = matmul_flops(device, self.compute_dtype, self.tf32, cache_dir)
        best, where = matmul_flops(device, PRESET_DTYPE[faster], tf32, cache_dir)
        if not (mine > 0 and best / mine >= SLOW_FACTOR):
            return None
        what = f"{device.type.upper()} " + ("without native fp16" if self.name == "fp16" and device.type == "cpu" else
                                            "without native bf16" if self.compute_dtype == torch.bfloat16 else "")
        return (f"precision={self.name} is a slow path on this {what.strip()}: its {_short(self.compute_dtype)} "
                f"matmuls run {best / mine:.0f}x slower than {_short(PRESET_DTYPE[faster])} ({mine / 1e9:,.1f} vs "
                f"{best / 1e9:,.1f} GFLOP/s, {where}); precision={faster} (what precision=auto picks here) is faster")

    def apply_backend_flags(self) -> None:
        """Set the process-wide CUDA matmul/conv flags this precision implies (TF32 for fp32 when ``tf32``), with
        torch's ``fp32_precision`` API (mixing it with the older ``allow_tf32`` flags is an error in torch 2.9+)."""
        if torch.cuda.is_available():
            mode = "tf32" if self.tf32 else "ieee"
            torch.backends.cuda.matmul.fp32_precision = mode
            torch.backends.cudnn.conv.fp32_precision = mode  # type: ignore[attr-defined]  # torch 2.9+, no stub

    def autocast(self, device: torch.device) -> ContextManager:
        """``torch.autocast`` to the compute dtype (a no-op for fp32). For strategies that do not cast parameters."""
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=self.compute_dtype)

    def mixed_precision_policy(self):
        """FSDP2 ``MixedPrecisionPolicy``: params gathered in the compute dtype, gradients reduced in reduce_dtype."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=None if self.compute_dtype == torch.float32 else self.compute_dtype,
                                    reduce_dtype=self.reduce_dtype, output_dtype=None)

    def float32_policy(self):
        """FSDP2 ``MixedPrecisionPolicy`` of a module that computes in float32 inside a lower-precision model
        (BatchNorm, whose running statistics are float32 buffers that its kernel will not mix with low-precision
        weights; FSDP1 kept it in float32 by default for the same reason): float32 parameters, inputs cast to float32,
        outputs cast back to the compute dtype so the next layer gets what the others do."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=self.reduce_dtype,
                                    output_dtype=self.compute_dtype, cast_forward_inputs=True)

    def grad_scaler(self, device: torch.device) -> torch.amp.GradScaler:
        """A ``torch.amp.GradScaler``, enabled only for fp16: always present, so callers need no branches (disabled,
        its ``scale`` returns the loss, ``step`` calls ``optimizer.step`` and ``get_scale`` is 1.0)."""
        return torch.amp.GradScaler(device.type, init_scale=self.init_scale, growth_interval=self.growth_interval,
                                    enabled=self.use_scaler)


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def float32_modules(model: "torch.nn.Module") -> list:
    """The modules of ``model`` (not itself) that FSDP keeps in float32 inside a lower-precision model, each its own
    unit (:meth:`Precision.float32_policy`), because their forward combines their
    parameters with float32 state that a low-precision weight cannot meet: BatchNorm with affine parameters (its
    running statistics; FSDP1 kept it in float32 by default), and a module whose weight is computed from its
    parameters (``torch.nn.utils.parametrize``: ``spectral_norm``'s power-iteration vectors, ``orthogonal``'s base;
    the older hook-based ``torch.nn.utils.spectral_norm`` too). Under autocast (DDP) these work as they are."""
    from torch.nn.modules.batchnorm import _BatchNorm
    from torch.nn.utils import parametrize
    from torch.nn.utils.spectral_norm import SpectralNorm

    def kept(m) -> bool:
        if isinstance(m, _BatchNorm):
            return any(p is not None for p in m._parameters.values())
        return parametrize.is_parametrized(m) or any(isinstance(h, SpectralNorm) for h in m._forward_pre_hooks.values())

    return [m for m in model.modules() if m is not model and kept(m)]
