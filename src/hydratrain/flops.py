"""Model FLOPs for MFU, for any model: counted once with ``torch.utils.flop_counter.FlopCounterMode`` on a copy of
the model built on the meta device (no storage, no compute) running one training step (forward, loss, backward) of
an example batch of the real shapes. The counter counts the matrix products and convolutions (attention included)
as the PaLM paper's MFU does (Chowdhery et al. 2022, appendix B); elementwise work is left out there too. A model
with a formula of its own (``flops_per_token(seq_len)``, as hydratrain's GPT: 6N + 12LHQT) keeps it.
"""
from __future__ import annotations

import contextlib
import copy
import logging
import math
from typing import Any, Callable, Optional

import torch
from omegaconf import DictConfig

from hydratrain import components
from hydratrain.config.settings import LoraSettings
from hydratrain.parallel import lora
from hydratrain.protocols import has_flops_per_token
from hydratrain.train.batch import forward, loss_of, rebuilt, rows

log = logging.getLogger(__name__)


def _meta(value: Any) -> Any:
    """``value`` with every tensor replaced by an uninitialised meta tensor of its shape and dtype."""
    if isinstance(value, torch.Tensor):
        return torch.empty(value.shape, dtype=value.dtype, device="meta")
    if isinstance(value, dict):
        return {k: _meta(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return rebuilt(value, [_meta(v) for v in value])
    return value


def counted_flops_per_sample(build_meta: Callable[[], torch.nn.Module], example: Any, loss_fn: Callable) -> float:
    """Training FLOPs (forward and backward) per sample of the model ``build_meta()`` returns (built on meta) on
    ``example`` (a batch; only its shapes and dtypes are used), counted by ``FlopCounterMode``. A forward that reads a
    value on the way (``.item()``, ``if mask.all()``: meta tensors have none) is counted again under
    ``FakeTensorMode``, where libraries that check for tracing (``transformers``) take their value-free path. A loss
    that refuses the outputs is counted as :func:`_stand_in_loss`, and one that is no scalar as its sum (the run's
    checks name either; no warning here repeats it). NaN when the model runs in neither (the run goes on without
    MFU)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode


    n = rows(example)

    def count(mode: Any) -> float:
        model = build_meta()
        loss = copy.deepcopy(loss_fn).to("meta") if isinstance(loss_fn, torch.nn.Module) else loss_fn  # its buffers
        model.train()
        batch = _meta(example)
        with mode:
            batch = _fake(mode, batch) if isinstance(mode, FakeTensorMode) else batch
            with FlopCounterMode(display=False) as counter:
                outputs = forward(model, batch, contextlib.nullcontext())
                try:
                    value = loss_of(outputs, batch, loss)
                except Exception as err:  # noqa: BLE001 (the first step names a loss that refuses the outputs)
                    value = _stand_in_loss(outputs, err)
                if isinstance(value, torch.Tensor) and value.ndim:  # a loss that is no scalar: the check names it
                    value = value.float().sum()  # (the backward through the model is the same)
                value.backward()
        return counter.get_total_flops() / max(n, 1)

    import logging

    quiet = logging.getLogger("torch._subclasses.fake_tensor")  # logs every failed meta kernel with its traceback
    was, quiet.disabled = quiet.disabled, True
    try:
        try:
            return count(contextlib.nullcontext())
        except RuntimeError as err:
            if "meta" not in str(err):
                raise
            return count(FakeTensorMode(allow_non_fake_inputs=True))
    except Exception as err:  # noqa: BLE001 (MFU is a figure, not a reason to stop)
        log.warning("model FLOPs not counted (MFU not logged): the model does not run on the meta device: %s: %s",
                    type(err).__name__, (str(err).strip().splitlines() or [""])[0])
        return math.nan
    finally:
        quiet.disabled = was


def _stand_in_loss(outputs: Any, err: Exception) -> torch.Tensor:
    """The sum of the floating tensors of ``outputs`` that need a gradient, as the loss to count a backward with
    when the run's loss refuses the outputs (a tuple where it takes a tensor): the first training step reports that
    refusal in one line, and the backward through the model, where the counted matrix products are, is the same
    (the loss's own elementwise work is not counted). Raises ``err`` when the outputs have no such tensor."""
    from torch.utils._pytree import tree_leaves

    leaves = [t for t in tree_leaves(outputs) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not leaves:
        raise err
    return sum(t.float().sum() for t in leaves)  # type: ignore[return-value]  # leaves is not empty: never 0


def _fake(mode: Any, value: Any) -> Any:
    """``value`` (meta tensors, in containers) as fake tensors of ``mode``."""
    if isinstance(value, torch.Tensor):
        return mode.from_tensor(value)
    if isinstance(value, dict):
        return {k: _fake(mode, v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return rebuilt(value, [_fake(mode, v) for v in value])
    return value


def model_flops(cfg: DictConfig, raw, train_batches, loss_fn, vocab_size: Optional[int], seq_len: int) -> float:
    """Training FLOPs per item (token for token data, else sample) for MFU: the model's own formula
    (``flops_per_token(seq_len)``) where it has one and the data has tokens (and no ``+peft=lora``), else counted on
    a meta copy of the model (:func:`hydratrain.flops.counted_flops_per_sample`), LoRA's adapters on it when the run
    names them."""
    adapters = LoraSettings.of(cfg)
    if seq_len and has_flops_per_token(raw) and adapters is None:  # (a formula counts every weight as trained)
        return float(raw.flops_per_token(seq_len))

    def build() -> torch.nn.Module:
        model = components.build_model(cfg, "meta", vocab_size, checked=True)
        # with LoRA the counted backward skips the frozen weights' gradients: their layers cost the input's only
        return lora.apply(model, adapters) if adapters is not None else model
    per_sample = counted_flops_per_sample(build, train_batches.example(), loss_fn)
    return per_sample / seq_len if seq_len else per_sample
