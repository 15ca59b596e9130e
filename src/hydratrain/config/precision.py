"""The ``precision`` group: one schema per option (:mod:`hydratrain.parallel.precision` acts on them) and the
checks of its values against the strategy. No torch import."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from omegaconf import MISSING, DictConfig

from hydratrain.config.strategy import SHARDED, StrategyName
from hydratrain.config.values import Option, Ranges, select
from hydratrain.errors import ConfigError


class PrecisionName(Option):
    auto = "auto"
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"
    fp8 = "fp8"


class Fp8Recipe(Option):
    tensorwise = "tensorwise"
    rowwise = "rowwise"


class DType(Option):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


@dataclass
class PrecisionConfig:
    """Numeric formats (see ``hydratrain.parallel.precision``). Master weights and optimizer state are always fp32;
    the compute dtype follows from ``name`` (auto: bf16 where the device computes it natively, else fp32)."""

    option: ClassVar[Optional[PrecisionName]] = None
    name: PrecisionName = MISSING
    reduce_dtype: DType = DType.float32  # dtype of the gradient reduction across ranks (ddp: a compression hook)
    tf32: bool = True  # CUDA only: let float32 matmuls use TF32 tensor cores (no effect on CPU)
    # strategy=fsdp/hsdp: also run each forward under torch.autocast to the compute dtype, as ddp and single do. FSDP's
    # MixedPrecisionPolicy alone casts the weights and each unit's floating inputs, so a float32 tensor the forward
    # makes itself (x.float() / 255 of uint8 pixels) meets bf16/fp16 weights and fails; autocast casts at each op.
    fsdp_autocast: bool = False


@dataclass
class AutoPrecision(PrecisionConfig):
    option: ClassVar[PrecisionName] = PrecisionName.auto
    name: PrecisionName = PrecisionName.auto


@dataclass
class FP32Precision(PrecisionConfig):
    option: ClassVar[PrecisionName] = PrecisionName.fp32
    name: PrecisionName = PrecisionName.fp32


@dataclass
class BF16Precision(PrecisionConfig):
    option: ClassVar[PrecisionName] = PrecisionName.bf16
    name: PrecisionName = PrecisionName.bf16


@dataclass
class FP16Precision(PrecisionConfig):
    """float16 compute with dynamic loss scaling (``torch.amp.GradScaler``)."""

    option: ClassVar[PrecisionName] = PrecisionName.fp16
    name: PrecisionName = PrecisionName.fp16
    init_scale: float = 65536.0  # the scaler's first scale
    growth_interval: int = 2000  # clean steps before the scale doubles


@dataclass
class FP8Precision(PrecisionConfig):
    """bf16 as ``precision=bf16``, plus torchao's float8 training on the model's Linear layers
    (:mod:`hydratrain.parallel.float8`); needs a GPU of compute capability 8.9+."""

    option: ClassVar[PrecisionName] = PrecisionName.fp8
    name: PrecisionName = PrecisionName.fp8
    fp8_recipe: Fp8Recipe = Fp8Recipe.tensorwise  # scales per tensor (fastest; float8 all-gather under FSDP) or per row
    # torchao's emulation (the casts, then high-precision gemms): runs on any device, slowly; for debugging
    fp8_emulate: bool = False
    # keep the layers too small to gain in bf16 (torchao's per-recipe rule); false: every Linear with dims % 16 == 0
    fp8_size_rule: bool = True


RANGES = Ranges(positive=("precision.init_scale", "precision.growth_interval"))


def check_fsdp_autocast(cfg: DictConfig) -> None:
    strategy = cfg.strategy.name
    if select(cfg, "precision.fsdp_autocast") and strategy not in SHARDED:
        raise ConfigError("precision.fsdp_autocast", True, f"unused with strategy={strategy}, whose forward runs "
                          "under autocast already; allowed with strategy=fsdp or hsdp")


def check_reduce_dtype(cfg: DictConfig) -> None:
    if cfg.strategy.name == StrategyName.single and cfg.precision.reduce_dtype != DType.float32:
        raise ConfigError("precision.reduce_dtype", cfg.precision.reduce_dtype, "strategy=single reduces no "
                          "gradients across ranks; allowed: float32")
