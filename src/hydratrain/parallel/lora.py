"""LoRA adapters (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models") through ``peft``
(extra ``[peft]``), on any ``nn.Module`` with named Linear layers.

``+peft=lora`` wraps the built model with ``peft.get_peft_model`` (its ``LoraConfig``: ``peft.r``, ``peft.alpha``,
``peft.dropout``, ``peft.target_modules``; null: peft's default for the architecture, read from the model's
``config.model_type``) after the build and before the strategy wraps it. peft freezes every base parameter
(``requires_grad=False``) and adds ``lora_A``/``lora_B`` beside each targeted layer, so:

- the optimizer sees only the adapters (:func:`hydratrain.optim.build_optimizer` takes trainable parameters only), and
  no gradient or optimizer state exists for the base;
- FSDP2 shards base and adapters alike: ``fully_shard`` takes frozen and trainable parameters in one unit (it
  reduce-scatters the gradients that exist), so the units are the model's own blocks;
- a checkpoint holds the trainable parameters only (:func:`trainable_only`); the base comes from the model's own
  init again (``model.pretrained``) on resume.

peft renames what it wraps: ``base_model.model.`` before every name and ``base_layer.`` inside each adapted layer.
A model with the per-parameter init protocol (``init_param_``) keeps it (:func:`_keep_init_protocol`): each base
parameter is asked by its own name with its own name's generator, so a meta build reads ``model.pretrained`` (or
draws the same values) as it does without LoRA; each adapter gets peft's default init, ``lora_A`` Kaiming-uniform
(a = sqrt 5, as ``nn.Linear``), ``lora_B`` zero, so training starts from the base's own function.
"""
from __future__ import annotations

import copy
import math
import warnings
from typing import Any

import torch
from torch import nn

from hydratrain.config.settings import LoraSettings
from hydratrain.errors import ConfigError
from hydratrain.parallel.init import param_seed
from hydratrain.protocols import has_init_param

INSTALL = "pip install -e '.[peft]'"
PREFIX = "base_model.model."  # what peft's wrappers put before each name of the model


def _peft():
    # (an optional extra: imported only by a run that names peft)
    try:
        import peft
    except ImportError:
        raise ConfigError("peft", "lora", f"needs peft, which is not installed: {INSTALL}") from None
    return peft


def lora_config(settings: LoraSettings) -> Any:
    """``peft.LoraConfig`` of ``settings``."""
    peft = _peft()
    targets = list(settings.target_modules) if settings.target_modules is not None else None
    return peft.LoraConfig(r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                           target_modules=targets)


def linear_names(model: nn.Module) -> list[str]:
    """The last parts of the names of ``model``'s Linear layers, once each, in order: what ``peft.target_modules``
    may name."""
    return list(dict.fromkeys(n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)))


def apply(model: nn.Module, settings: LoraSettings) -> nn.Module:
    """``model`` wrapped by ``peft.get_peft_model`` with the LoRA of ``settings`` (the base frozen, adapters on the
    target modules, on ``model``'s device: meta included). Returns the ``PeftModel``. Raises :class:`ConfigError`
    naming ``peft.target_modules`` when peft finds none of them in the model (or has no default for it)."""
    peft = _peft()
    config = lora_config(settings)
    try:
        with warnings.catch_warnings():  # (peft asks transformers >= 5 a deprecated question; nothing to act on)
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            wrapped = peft.get_peft_model(model, config)
    except ValueError as err:  # peft: "Target modules {...} not found in the base model", or no default
        targets = list(settings.target_modules) if settings.target_modules is not None else None
        first = (str(err).strip().splitlines() or [""])[0][:200]
        raise ConfigError("peft.target_modules", targets, f"{first}; the model's Linear layers: "
                          f"{', '.join(linear_names(model)[:12]) or 'none'}") from None
    _keep_init_protocol(wrapped, model)
    return wrapped


def check(meta_model: nn.Module, settings: LoraSettings) -> None:
    """What :func:`apply` would refuse, on a copy of a model built on meta (the model itself is left as it is).
    Raises :class:`ConfigError`."""
    apply(copy.deepcopy(meta_model), settings)


def base_name(name: str) -> str:
    """A parameter's name in the model peft wrapped: without ``base_model.model.`` and ``base_layer.``."""
    return name.removeprefix(PREFIX).replace(".base_layer.", ".")


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def _keep_init_protocol(wrapped: nn.Module, base: nn.Module) -> None:
    """Give ``wrapped`` an ``init_param_`` when ``base`` has one (see the module docstring); other protocols reach
    the base through peft's attribute forwarding (``init_weights``) or its modules (``reset_parameters``)."""
    if not has_init_param(base):
        return
    own = base.init_param_

    def init_param_(name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        plain = base_name(name)
        if not is_adapter(plain):
            own(plain, tensor, _renamed(generator, name, plain, tensor.device))
            return
        with torch.no_grad():
            if ".lora_B." in plain:
                tensor.zero_()
            else:  # peft's default (init_lora_weights=True) is nn.Linear's: kaiming_uniform_(a=sqrt(5))
                nn.init.kaiming_uniform_(tensor, a=math.sqrt(5), generator=generator)

    wrapped.init_param_ = init_param_  # type: ignore[assignment]  # (an instance's hook: the core asks the model)


def _renamed(generator: torch.Generator, name: str, plain: str, device: torch.device) -> torch.Generator:
    """The generator :func:`~hydratrain.parallel.init.param_seed` gives ``plain`` in the run whose generator for
    ``name`` is ``generator`` (the seed's name term swapped), so a base parameter draws what it draws without LoRA."""
    seed = (generator.initial_seed() - param_seed(0, name) + param_seed(0, plain)) % (2**63 - 1)
    return torch.Generator(device=device).manual_seed(seed)


def trainable_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def merged(peft_model: nn.Module) -> nn.Module:
    """The base model with each adapter merged into its layer (``merge_and_unload``): the trained model without
    peft's wrappers, under its own parameter names."""
    return peft_model.merge_and_unload()  # type: ignore[operator]  # (a PeftModel's)
