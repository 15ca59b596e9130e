"""How a batch meets the model and the loss (the batch contract, for any model):

- a tuple or list ``(inputs, targets)``: ``outputs = model(inputs)``, ``loss = loss_fn(outputs, targets)``;
- a dict: ``outputs = model(**batch)``; an output with a non-None ``loss`` (an attribute, Hugging Face style, or a
  dict key) is the loss, else ``loss_fn(outputs, batch["labels"])``.

``outputs`` reach the loss and the metrics as the model returns them, except that an output object or dict with
``logits`` gives its logits (:func:`prediction`). The forward runs inside the strategy's autocast region, the loss
outside it (the built-in losses compute in float32).

A loss that is a mean over the targets it does not ignore (:func:`item_counter`) weighs each micro-batch by that
count, so an optimizer step's loss is the mean over all its targets, whatever the accumulation and world size.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, ContextManager, Iterable, Mapping, Optional

import torch
from torch import nn


def rebuilt(value: Any, items: Any) -> Any:
    """A list or tuple of ``value``'s type holding ``items``: a namedtuple takes them as separate arguments, a plain
    tuple or list (or a subclass of one) as one iterable."""
    return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)


def targets_of(batch: Any) -> Any:
    """The targets of ``batch``: the second item of a pair, ``labels`` of a dict (None when absent)."""
    if isinstance(batch, Mapping):
        return batch.get("labels")
    return batch[1]


def forward(model: nn.Module, batch: Any, autocast: ContextManager) -> Any:
    """``model`` applied to ``batch`` (see the module docstring) inside ``autocast``."""
    with autocast:
        if isinstance(batch, Mapping):
            return model(**batch)
        return model(batch[0])


def builtin_loss(outputs: Any) -> Optional[torch.Tensor]:
    """The loss the model computed itself (``outputs.loss`` or ``outputs["loss"]``), or None."""
    if isinstance(outputs, Mapping):
        return outputs.get("loss")
    return getattr(outputs, "loss", None) if not isinstance(outputs, torch.Tensor) else None


def prediction(outputs: Any) -> Any:
    """What the loss and the metrics are given: ``outputs.logits`` (or ``["logits"]``) when present, else the
    outputs as returned."""
    if isinstance(outputs, Mapping):
        return outputs.get("logits", outputs)
    logits = getattr(outputs, "logits", None) if not isinstance(outputs, torch.Tensor) else None
    return logits if logits is not None else outputs


def unseen_outputs(outputs: Any) -> list:
    """The names of the tensors of ``outputs`` that neither the loss nor the metrics get: every entry beside
    ``logits`` of an output dict or object (a dataclass, Hugging Face's ``ModelOutput``) that has no ``loss`` of its
    own (an ``aux_loss`` the loss node never sees); [] otherwise."""
    import dataclasses

    if isinstance(outputs, torch.Tensor) or builtin_loss(outputs) is not None or prediction(outputs) is outputs:
        return []
    if isinstance(outputs, Mapping):
        items: Iterable[tuple[Any, Any]] = outputs.items()
    elif dataclasses.is_dataclass(outputs):
        items = ((f.name, getattr(outputs, f.name)) for f in dataclasses.fields(outputs))
    else:
        return []
    return [str(k) for k, v in items if k != "logits" and isinstance(v, torch.Tensor)]


def loss_of(outputs: Any, batch: Any, loss_fn: Callable) -> torch.Tensor:
    """The 0-d loss of ``outputs`` for ``batch``: the model's own (:func:`builtin_loss`), else
    ``loss_fn(prediction(outputs), targets_of(batch))`` with bf16/fp16 predictions cast to float32 first: the loss
    runs outside the autocast region, where ``torch.nn.CrossEntropyLoss`` would compute in bf16 (3 significant
    digits) what autocast's policy computes in float32."""
    own = builtin_loss(outputs)
    loss = own if own is not None else loss_fn(upcast(prediction(outputs)), zero_weight_ignored(loss_fn,
                                                                                             targets_of(batch)))
    if isinstance(loss, torch.Tensor) and loss.dim() > 0 and loss.numel() == 1:
        return loss.reshape(())  # a (1,) mean (a keepdim reduction): the 0-d loss it holds
    return loss


_ZERO_WEIGHT: "weakref.WeakKeyDictionary[nn.Module, Optional[torch.Tensor]]" = weakref.WeakKeyDictionary()


def zero_weight_ignored(loss_fn: Callable, targets: Any) -> Any:
    """``targets`` with those of a class whose ``weight`` is 0 set to the loss's ``ignore_index``, for a mean-reduced
    ``torch.nn.CrossEntropyLoss`` / ``NLLLoss`` without label smoothing; else ``targets`` as they are.

    The same loss, exactly: such a target adds 0 to the weighted sum and 0 to the sum of weights the mean divides by.
    But a micro-batch whose targets all weigh 0 gets torch's NaN gradient (its backward divides by a total weight
    of 0, where an ignored target is skipped): as ignored targets, it gets the zero gradient of a micro-batch with
    no target (:func:`item_counter` counts their weights, 0). The classes of weight 0 are read once per loss module
    (its weight is a buffer, not trained), so a step adds no host synchronisation."""
    weight, ignore = getattr(loss_fn, "weight", None), getattr(loss_fn, "ignore_index", None)
    if not (isinstance(loss_fn, nn.Module) and isinstance(weight, torch.Tensor) and isinstance(ignore, int)
            and isinstance(targets, torch.Tensor) and not targets.is_floating_point() and not targets.is_complex()
            and targets.dtype != torch.bool and not getattr(loss_fn, "label_smoothing", 0.0)
            and getattr(loss_fn, "reduction", "mean") == "mean"):
        return targets
    zero: Optional[torch.Tensor]
    if loss_fn not in _ZERO_WEIGHT:  # (the loss module -> its classes of weight 0, or None)
        zero = weight.detach() == 0
        _ZERO_WEIGHT[loss_fn] = zero if bool(zero.any()) else None
    zero = _ZERO_WEIGHT[loss_fn]
    if zero is None:
        return targets
    zero = zero.to(targets.device)
    counted = (targets != ignore) & (targets >= 0) & (targets < zero.numel())
    return targets.masked_fill(counted & zero[targets.where(counted, 0)], ignore)


def upcast(value: Any) -> Any:
    """``value`` with its bf16/fp16 tensors (in tuples, lists and dicts too) as float32."""
    if isinstance(value, torch.Tensor):
        return value.float() if value.dtype in (torch.bfloat16, torch.float16) else value
    if isinstance(value, Mapping):
        return type(value)({k: upcast(v) for k, v in value.items()}) if isinstance(value, dict) else value
    if isinstance(value, (list, tuple)):
        return rebuilt(value, [upcast(v) for v in value])
    return value


def item_counter(loss_fn: Callable, model: nn.Module, own_loss: bool,
                 batch: Any) -> Optional[Callable[[Any], torch.Tensor]]:
    """How many targets a micro-batch's loss is the mean of, as a function of the batch (a 0-d float64 tensor on
    the targets' device), or None when every micro-batch of the same rows weighs the same (the loss counts samples,
    or its averaging is unknown).

    The mean-reduced ``torch.nn.CrossEntropyLoss``/``NLLLoss`` and :class:`hydratrain.losses.NextTokenLoss` average
    over the integer targets that are not ``ignore_index`` (with class ``weight``: over the sum of their weights, as
    ``torch.nn.functional.cross_entropy`` divides), and a ``transformers`` model that computes its own loss
    (``own_loss``) over its ``labels`` that are not -100, shifted by one for a ``...ForCausalLM``. A micro-batch of
    padded sequences then weighs what its real tokens do, as in transformers' ``num_items_in_batch`` (PR #34191) and
    torchtune's per-token normalisation (PR #1875)."""
    targets = targets_of(batch)
    if not isinstance(targets, torch.Tensor) or targets.is_floating_point() or targets.is_complex() \
            or targets.dtype == torch.bool:
        return None
    if own_loss:
        kind = hf_kind(model)
        if kind is None:
            return None
        return lambda b: _count(targets_of(b)[..., 1:] if kind == "causal" else targets_of(b), -100, None)
    ignore = getattr(loss_fn, "ignore_index", None)
    if not isinstance(ignore, int) or getattr(loss_fn, "reduction", "mean") != "mean":
        return None
    weight = getattr(loss_fn, "weight", None)
    return lambda b: _count(targets_of(b), ignore, weight if isinstance(weight, torch.Tensor) else None)


def hf_kind(model: nn.Module) -> Optional[str]:
    """``"causal"`` for a ``transformers`` ``...ForCausalLM`` (its own loss: the next-token cross-entropy over its
    labels shifted by one), ``"other"`` for another ``transformers`` model, None for any other model."""
    module = getattr(model, "module", model)  # DDP's wrapper
    if not any(c.__module__.startswith("transformers.") and c.__name__ == "PreTrainedModel"
               for c in type(module).__mro__):
        return None
    return "causal" if type(module).__name__.endswith("ForCausalLM") else "other"


def _count(targets: torch.Tensor, ignore_index: int, weight: Optional[torch.Tensor]) -> torch.Tensor:
    kept = targets != ignore_index
    if weight is None:
        return kept.sum(dtype=torch.float64)
    return (weight.to(targets.device, torch.float64)[targets.where(kept, 0)] * kept).sum()


def rows(batch: Any) -> int:
    """Samples in ``batch``: the first dim of its targets when they are one tensor (a flat layout's ``input``, as
    ``nn.EmbeddingBag``'s, has a row per token, not per sample), else of its first tensor."""
    from torch.utils._pytree import tree_leaves

    targets = targets_of(batch)
    if isinstance(targets, torch.Tensor) and targets.dim() > 0:
        return int(targets.shape[0])
    for leaf in tree_leaves(batch):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    return 0


def select(value: Any, mask: torch.Tensor) -> Any:
    """``value`` (a tensor, or tuples, lists and dicts of them; outputs or targets) with only the rows of ``mask``
    (``(B,)`` bool) kept along the first dim; a list or tuple of ``B`` plain values (strings, numbers: what the
    default collate makes of a string field) is a column, and keeps those rows too; other values as they are."""
    if isinstance(value, torch.Tensor):
        return value[mask] if value.dim() > 0 and value.shape[0] == mask.shape[0] else value
    if isinstance(value, Mapping):
        return {k: select(v, mask) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        if len(value) == mask.shape[0] and not any(isinstance(v, (torch.Tensor, Mapping, list, tuple)) for v in value):
            return rebuilt(value, [v for v, keep in zip(value, mask.tolist()) if keep])
        return rebuilt(value, [select(v, mask) for v in value])
    return value


def shapes(value: Any) -> str:
    """``value``'s tensor shapes, for an error line: ``(8, 64) int64``, ``{input_ids: (8, 64), ...}``."""
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k}: {shapes(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "(" + ", ".join(shapes(v) for v in value) + ")"
    return type(value).__name__
