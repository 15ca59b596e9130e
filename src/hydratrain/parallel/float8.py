"""``precision=fp8``: torchao's float8 training (``torchao.float8``) on the model's ``nn.Linear`` layers, inside a
bf16 run (autocast or FSDP's ``MixedPrecisionPolicy`` as ``precision=bf16``).

:func:`convert` swaps the chosen layers for torchao's ``Float8Linear`` (``convert_to_float8_training`` with a
``module_filter_fn``) before activation checkpointing, compile and any wrapper (torchtitan's order). Each forward
casts the layer's input and weight to float8 with dynamic scales, and each backward its output gradient, and runs
the gemms in float8 (``torch._scaled_mm``); the weight itself stays a parameter of its own dtype, so the optimizer,
the checkpoints (same names, same dtypes) and a resume under ``precision=bf16`` are as without float8.

Which layers convert (:func:`why_kept`), in this order:

1. a weight tied to another module (a head sharing the embedding) stays: the embedding lookup cannot use a float8
   cast, and FSDP's float8 all-gather wraps the weight in a parameter of its own, which would untie it;
2. a layer whose ``in_features`` or ``out_features`` is not a multiple of 16 stays: ``torch._scaled_mm`` needs both;
3. with ``precision.fp8_size_rule=true`` (default) a layer too small to gain stays, by torchao's own rule for the
   recipe (``torchao.float8._auto_filter_for_recipe``, from its H100 microbenchmarks of a linear's forward and
   backward against bf16, casts included): tensorwise keeps a layer with ``in_features <= 4096`` and
   ``out_features <= 1024``; rowwise keeps ``out <= 2048``, ``in <= 1024``, or ``out <= 4096`` with ``in <= 2048``.
   Below those sizes the casts and amax reductions cost more than the float8 gemm saves. llama_1b (2048 wide, GQA
   8 x 64 keys and values, SwiGLU 8192): tensorwise converts wq, wo, w1, w2, w3 of each block (80 layers) and keeps
   wk and wv (2048 -> 512) and the tied head. ``fp8_size_rule=false`` converts every layer rules 1-2 allow (tests of
   the path on tiny models, a GPU whose break-even differs).

Recipes (``precision.fp8_recipe``): ``tensorwise`` (default; one scale per tensor, the fastest: 1.25x bf16 for
Llama-3 8B on 8 H100s in torchao's benchmark) and ``rowwise`` (one scale per row, power-of-2 scales; more accurate
with outliers, 1.10x there). Under FSDP2 with ``tensorwise`` on CUDA the weights are all-gathered in float8
(``enable_fsdp_float8_all_gather``: half the bytes of bf16), and torchao's scales for that cast are computed for all
weights in one all-reduce after each optimizer step (:func:`precompute_scales_after_each_step`). gloo has no float8
dtype, so on a CPU (``precision.fp8_emulate``) the weights gather in bf16. Such a weight is a DTensor over torchao's
``WeightWithDynamicFloat8CastTensor``; state dicts and the EMA's copies take the plain tensor inside it
(:func:`plain`), so checkpoints and safetensors files hold what a bf16 run's hold.

A device computes float8 from CUDA compute capability 8.9 (Ada: L4, L40; Hopper: H100, H200; Blackwell): elsewhere
the run stops with one config error (:func:`device_problem`) unless ``precision.fp8_emulate=true``, torchao's
emulation (``Float8LinearConfig(emulate=True)``: the same casts, the gemm in high precision), which runs anywhere,
slowly: for debugging and the CPU tests.
"""
from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from hydratrain.errors import ConfigError

INSTALL = "pip install -e '.[lowbit]'"
NEEDS = "needs a GPU of compute capability 8.9+ (H100, L4, ...)"
MIN_CAPABILITY = (8, 9)


def _torchao_float8() -> Any:
    # (an optional extra, imported only by a run that chooses precision=fp8)
    try:
        import torchao.float8 as float8
    except ImportError:
        raise ConfigError("precision", "fp8", f"needs torchao, which is not installed: {INSTALL}") from None
    return float8


def device_problem(device_type: str, emulate: bool) -> Optional[str]:
    """Why ``precision=fp8`` cannot run on the run's devices (``device_type``: ``cuda`` or ``cpu``, as the
    ``device`` key resolves), or None: CUDA compute capability 8.9+ on every visible GPU, or ``emulate``. Reads the
    capability (which initialises CUDA in this process) only on CUDA."""
    if emulate:
        return None
    if device_type != "cuda":
        return (f"{NEEDS}; this device is the CPU (precision.fp8_emulate=true runs torchao's emulation, slowly, for "
                "debugging)")
    for i in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(i)
        if (major, minor) < MIN_CAPABILITY:
            return f"{NEEDS}; this device is {torch.cuda.get_device_name(i)} (compute capability {major}.{minor})"
    return None


def check(name: str, emulate: bool, device_type: str) -> None:
    """For ``precision.name`` ``name``: raise :class:`ConfigError` naming ``precision`` when fp8 cannot run on
    ``device_type`` or torchao is missing."""
    if name != "fp8":
        return
    why = device_problem(device_type, emulate)
    if why:
        raise ConfigError("precision", "fp8", why)
    _torchao_float8()


@dataclass(frozen=True)
class Float8:
    """The ``precision=fp8`` settings: ``recipe`` (tensorwise | rowwise), ``emulate`` (torchao's emulation),
    ``size_rule`` (torchao's per-recipe rule keeps layers too small to gain)."""

    recipe: str = "tensorwise"
    emulate: bool = False
    size_rule: bool = True

    def linear_config(self, all_gather: bool) -> Any:
        """torchao's ``Float8LinearConfig`` of the recipe, with emulation and FSDP float8 all-gather as asked."""
        base = _torchao_float8().Float8LinearConfig.from_recipe_name(self.recipe)
        return dataclasses.replace(base, emulate=self.emulate, enable_fsdp_float8_all_gather=all_gather)

    def all_gather(self, shards_parameters: bool, device: torch.device) -> bool:
        """Whether FSDP all-gathers the converted weights in float8: a sharding strategy, the tensorwise recipe
        (torchao supports no other), on CUDA (gloo has no float8 dtype)."""
        return shards_parameters and self.recipe == "tensorwise" and device.type == "cuda"


def why_kept(module: nn.Linear, name: str, float8: Float8, tied: set, size_filter: Any) -> Optional[str]:
    """Why the Linear ``module`` (named ``name``) stays in high precision (the module docstring's rules), or None
    when it converts. ``tied``: ids of the parameters held by more than one module; ``size_filter``: torchao's
    ``module_filter_fn`` for the recipe (None without ``size_rule``)."""
    if id(module.weight) in tied:
        return "tied to another module"
    if module.in_features % 16 or module.out_features % 16:
        return "dims not multiples of 16"
    if size_filter is not None and not size_filter(module, name):
        return "too small to gain"
    return None


@dataclass(frozen=True)
class Conversion:
    """What :func:`convert` did: the converted layers' names, the kept ones' by reason, and the setting."""

    float8: Float8
    converted: tuple
    kept: dict  # reason -> names
    all_gather: bool

    def describe(self) -> str:
        """One line for the start-up log: counts and a few names."""
        total = len(self.converted) + sum(len(v) for v in self.kept.values())
        head = (f"float8 {self.float8.recipe}{' (emulated)' if self.float8.emulate else ''}: {len(self.converted)} "
                f"of {total} Linear layers converted")
        kept = "; ".join(f"{len(names)} {why} ({_few(names)})" for why, names in self.kept.items())
        gather = ", float8 all-gather" if self.all_gather else ""
        return head + gather + (f"; kept in bf16: {kept}" if kept else "")


def _few(names: list, shown: int = 3) -> str:
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def convert(model: nn.Module, float8: Float8, all_gather: bool) -> Conversion:
    """Swap ``model``'s Linear layers that the rules allow for ``Float8Linear`` in place (on any device, meta
    included); returns what was converted and kept."""
    ao = _torchao_float8()
    tied = {id(p) for p, n in _holders(model).items() if n > 1}
    size_filter = ao._auto_filter_for_recipe(float8.recipe, filter_fqns=[]) if float8.size_rule else None
    converted: list = []
    kept: dict = {}

    def chosen(module: nn.Module, name: str) -> bool:
        if not isinstance(module, nn.Linear):
            return False
        why = why_kept(module, name, float8, tied, size_filter)
        (converted if why is None else kept.setdefault(why, [])).append(name)
        return why is None

    ao.convert_to_float8_training(model, module_filter_fn=chosen, config=float8.linear_config(all_gather))
    if all_gather and converted:
        model._register_state_dict_hook(_plain_weights)
    return Conversion(float8, tuple(converted), kept, all_gather)


def _plain_weights(module: nn.Module, state: dict, prefix: str, local_metadata: Any) -> None:
    """A state-dict hook of a model whose weights FSDP all-gathers in float8: each such weight enters the state dict
    as :func:`plain` gives it, so checkpoints and exported weights hold plain tensors of the parameter's dtype
    (safetensors cannot read the wrapper's storage), and a load into that state dict writes into the parameter."""
    for key, value in state.items():
        state[key] = plain(value)


def _wrapper_type() -> Any:
    """torchao's ``WeightWithDynamicFloat8CastTensor`` (the local shard of a weight FSDP all-gathers in float8), or
    None when ``torchao.float8`` was never imported: then no such weight exists, and torchao need not be there."""
    fsdp_utils = sys.modules.get("torchao.float8.fsdp_utils")
    return getattr(fsdp_utils, "WeightWithDynamicFloat8CastTensor", None)


def plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` without torchao's float8-cast wrapper: a DTensor whose local shard is the wrapper becomes the same DTensor
    over the wrapper's inner tensor (sharing its storage); any other tensor is returned as it is."""
    wrapper = _wrapper_type()
    if wrapper is None or not isinstance(t, DTensor) or not isinstance(t._local_tensor, wrapper):
        return t
    local: Any = t._local_tensor
    return DTensor.from_local(local._tensor, t.device_mesh, t.placements, run_check=False, shape=t.shape,
                              stride=t.stride())


def drop_precomputed_scales(params: list) -> None:
    """Forget torchao's float8 scales precomputed for ``params`` (after the last optimizer step): values copied into
    them since (the EMA's, for its evaluation) have scales of their own, which each float8 all-gather then computes
    (one all-reduce) until the next optimizer step precomputes them again."""
    wrapper = _wrapper_type()
    if wrapper is None:
        return
    for p in params:
        local: Any = p._local_tensor if isinstance(p, DTensor) else None
        if isinstance(local, wrapper):
            local._precomputed_scale = None


def _holders(model: nn.Module) -> dict:
    """{parameter: how many (module, attribute) places hold it}."""
    counts: dict = {}
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None:
                counts[p] = counts.get(p, 0) + 1
    return counts


def precompute_scales_after_each_step(optimizer: torch.optim.Optimizer, model: nn.Module,
                                      conversion: Optional[Conversion]) -> None:
    """With float8 all-gather on (``conversion.all_gather``): after each ``optimizer.step()``, torchao's
    ``precompute_float8_dynamic_scale_for_fsdp`` (the amax of every float8-gathered weight in one all-reduce, so the
    next forward's all-gathers need none of their own). Every rank steps together, so every rank calls. A step the
    non-finite guard or the scaler drops calls no ``step()``: the weights, so the scales, are unchanged."""
    if conversion is None or not conversion.all_gather:
        return
    precompute = _torchao_float8().precompute_float8_dynamic_scale_for_fsdp
    optimizer.register_step_post_hook(lambda *_: precompute(model))
