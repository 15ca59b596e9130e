"""The ``model`` group: hydratrain's keys of every model node (:class:`ModelKeys`; the rest of the node is the
model's own keywords, checked with the components in :mod:`hydratrain.config.validate`) and their checks. No torch
import."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

from omegaconf import DictConfig

from hydratrain.config.values import select
from hydratrain.errors import ConfigError


@dataclass
class ModelKeys:
    """Keys of every model node, your own included: hydratrain's, not passed to the constructor."""

    init_device: str = "auto"  # auto | meta | cpu | cuda (auto: meta under fsdp/hsdp for a model with an init protocol)
    init_from: Optional[str] = None  # a .safetensors file of full weights to start from (fine-tuning)


MODEL_KEYS = tuple(f.name for f in fields(ModelKeys))


def check_init_device(cfg: DictConfig) -> None:
    """``model.init_device=cuda`` on a run whose ``device`` is the CPU."""
    if select(cfg, "model.init_device") == "cuda" and cfg.device == "cpu":
        raise ConfigError("model.init_device", "cuda", "the run's device is cpu; allowed: auto, meta, cpu")


def check_init_from(cfg: DictConfig) -> None:
    """``model.init_from`` is a .safetensors file (an empty one is refused before, with the other paths)."""
    init_from = select(cfg, "model.init_from")
    if init_from is not None and not str(init_from).endswith(".safetensors"):
        raise ConfigError("model.init_from", init_from, "must be a .safetensors file (python -m hydratrain.export "
                          "CHECKPOINT_DIR OUT.safetensors makes one)")
