"""Evaluation over the fixed eval set (:class:`hydratrain.data.streams.EvalBatches`): the same samples, each counted
once, whatever the world size and batch size, so ``eval/*`` is comparable across the runs of a sweep that varies
them.
"""
from __future__ import annotations

import copy
import inspect
import logging
import math
from typing import Callable, ContextManager, Optional

import torch
import torch.distributed as dist
from torch import nn

from hydratrain.errors import ConfigError
from hydratrain.train.batch import (
    builtin_loss,
    forward,
    hf_kind,
    item_counter,
    loss_of,
    prediction,
    rows,
    select,
    shapes,
    targets_of,
    upcast,
)

log = logging.getLogger("hydratrain.eval")


class Evaluator:
    """``eval/loss`` (the run's loss over the eval set), ``eval/perplexity`` (``exp`` of it, when the loss has
    ``perplexity = True``: the next-token loss) and each metric of ``metrics`` (``{name: torchmetrics.Metric}``,
    updated with ``(outputs, targets)`` of every sample, bf16/fp16 outputs in float32 as the loss gets them), all
    synced across ranks by torchmetrics' ``compute()`` (every rank calls).

    The loss is the mean of each batch's mean loss weighted by what it is the mean of: its targets that are not
    ignored where the loss counts them (:func:`~hydratrain.train.batch.item_counter`: the mean over the eval set's
    tokens, padding left out), else its samples; kept as two sums in the default dtype (float32) per rank, summed
    over the ranks at the end (:func:`_sum_over_ranks`: torchmetrics' ``SumMetric`` did the same, and
    importing torchmetrics costs a run without user metrics seconds of start-up). In the last
    global batch each rank holds only its own samples (:class:`~hydratrain.data.streams.EvalBatches`); a rank with
    none runs the forward on one padding sample, which every rank needs for FSDP, and discards it.

    A loss that communicates (a contrastive loss that all-gathers its embeddings: any ``c10d`` op while it runs,
    seen once by :meth:`check_loss`) needs every rank to call it as often and on batches of the same shape, or the
    ranks wait for each other forever. Such a loss is called on the whole global batches only (the last one, if
    short, goes to the metrics alone), and an eval set that fills none is a config error.
    """

    def __init__(self, eval_batches, device: torch.device, loss_fn: Callable, metrics: Optional[dict] = None):
        self.batches, self.device, self.loss_fn = eval_batches, device, loss_fn
        self.metrics = {name: m.to(device) for name, m in (metrics or {}).items()}
        self.perplexity = bool(getattr(loss_fn, "perplexity", False))
        self._checked = False  # the first eval turns a metric that refuses the outputs into one config-error line
        self.loss_communicates: Optional[bool] = None  # known after check_loss (every rank learns the same)
        self.count, self._count_known = None, False  # batch.item_counter's rule, from the trainer's first forward
        self._warned_no_target = False
        self._not_computed: set = set()  # the metrics whose compute() raised at an eval (warned once each)

    def on(self, batches) -> "Evaluator":
        """This evaluator (its loss, metrics and what it has learnt of them) over other ``batches`` (the test set)."""
        other = copy.copy(self)
        other.batches = batches
        return other

    def counts(self, rule, own_loss: bool = False) -> None:
        """Weigh each batch's loss by ``rule(batch)`` (:func:`~hydratrain.train.batch.item_counter`; None: by its
        samples). ``own_loss``: the model returns its own loss, of which the ``loss`` node says nothing (an
        auxiliary term in it would make ``exp`` of it no perplexity), so no perplexity is reported, unless the
        model is a ``transformers`` causal LM, whose own loss is the next-token cross-entropy."""
        self.count, self._count_known = rule, True
        self.perplexity = self.perplexity and not own_loss

    def check_loss(self, outputs, batch) -> torch.Tensor:
        """``loss_of(outputs, batch)``, noting whether the loss ran a collective (``c10d`` or functional
        collective ops, seen by a ``TorchDispatchMode``): the trainer calls it on the eval-mode outputs of its first
        micro-batch, every rank alike (a loss that communicates must not be left out on any rank)."""
        from torch.utils._python_dispatch import TorchDispatchMode

        class Collectives(TorchDispatchMode):
            seen = False

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func.namespace in ("c10d", "_c10d_functional", "c10d_functional"):
                    Collectives.seen = True
                return func(*args, **(kwargs or {}))

        with Collectives():
            loss = loss_of(outputs, batch, self.loss_fn)
        if Collectives.seen and not self.loss_communicates:
            n, whole = self._whole_samples()
            if whole == 0:
                b = self.batches
                raise ConfigError("trainer.eval_samples", n, f"{n} eval samples fill no global batch of "
                                  f"{b.world_size} ranks x data.batch_size={b.batch_size}, and the loss communicates "
                                  "across ranks (it ran a collective), so its eval/loss needs whole global batches: "
                                  f"give trainer.eval_samples >= {b.world_size * b.batch_size} (a larger val split), "
                                  "or a smaller data.batch_size")
            log.info("eval: the loss communicates across ranks (it ran a collective), so eval/loss is over whole "
                     "global batches: %s of the %s eval samples%s; the metrics see them all", whole, n,
                     "" if whole == n else " (the rest fill no global batch)")
        self.loss_communicates = Collectives.seen
        return loss

    def _whole_samples(self) -> tuple:
        """(eval samples, those in whole global batches) of an :class:`~hydratrain.data.streams.EvalBatches`;
        both None for another iterable."""
        b = self.batches
        if not all(hasattr(b, key) for key in ("n_samples", "batch_size", "world_size")):
            return None, None
        return b.n_samples, b.n_samples - b.n_samples % (b.world_size * b.batch_size)

    def check_metrics(self, outputs, batch) -> None:
        """Update a copy of each metric with ``outputs`` (a training micro-batch's, detached) and ``batch``'s
        targets, then drop the copies: a metric that refuses them is one config-error line at the first step, not
        after training up to the first eval. Raises :class:`~hydratrain.errors.ConfigError`."""
        if not self.metrics or self._checked:
            return
        from torch.utils._pytree import tree_map

        with torch.no_grad():
            outputs = upcast(prediction(outputs))  # as the loss and the eval's metrics get them
            detached = tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, outputs)
            empty = self._some_rank_empty()
            for name, metric in self.metrics.items():
                copy = metric.clone()
                self._update(name, copy, detached, targets_of(batch))
                if empty and any(isinstance(default, list) for default in metric._defaults.values()):
                    none = torch.zeros(rows(batch), dtype=torch.bool, device=self.device)
                    self._update_none(name, metric.clone(), select(detached, none), select(targets_of(batch), none))
                copy.sync_on_compute = False  # this rank's copy alone: no collective
                try:
                    value = copy.compute()
                except Exception:  # noqa: BLE001 (one batch may be too little for it: the eval's data decides)
                    continue
                self._check_value(name, f"{type(metric).__module__}.{type(metric).__qualname__}", value,
                                  "average" in inspect.signature(type(metric)).parameters)

    @staticmethod
    def _check_value(name: str, target: str, value, averages: bool = False) -> None:
        """A metric's ``compute()`` is logged as one number (``eval/<name>``): a dict (``ClasswiseWrapper``,
        ``MeanAveragePrecision``) or a vector (``average=None``: per class) is a config error naming it."""
        if isinstance(value, torch.Tensor) and value.numel() == 1 or isinstance(value, (int, float)):
            return

        what = (f"a dict ({', '.join(map(str, list(value)[:4]))}{', ...' if len(value) > 4 else ''})"
                if isinstance(value, dict) else f"a tensor of shape {tuple(value.shape)}"
                if isinstance(value, torch.Tensor) else f"a {type(value).__name__}")
        raise ConfigError(f"metrics.{name}._target_", target, f"its compute() returns {what}, and each metric is "
                          "logged as one number (eval/<name>): give one metric per value" + (
                              ", or reduce it (for a per-class metric: average='macro' or 'micro')" if averages else
                              ", or a metric that computes one (a confusion matrix, a curve: log it yourself)"))

    def _metrics_only(self, outputs, batch, valid: Optional[torch.Tensor]) -> None:
        """Update each metric with ``outputs`` against ``batch``'s targets, only their ``valid`` rows when given
        (none: the zero-row update of :meth:`_update_empty`)."""
        predicted, expected = upcast(prediction(outputs)), targets_of(batch)  # as the loss gets them
        if valid is not None:
            predicted, expected = select(predicted, valid), select(expected, valid)
            if not bool(valid.any()):
                self._update_empty(predicted, expected)
                return
        for name, metric in self.metrics.items():
            self._update(name, metric, predicted, expected)

    def _update_empty(self, outputs, targets) -> None:
        """Zero rows into each metric whose states are lists (``MulticlassAUROC``'s predictions): a rank that has no
        eval samples would otherwise hold an empty list, and the sync, which gathers one tensor per list state from
        every rank, would mismatch (a gloo abort). Sum states sync as they are."""
        for name, metric in self.metrics.items():
            if any(isinstance(default, list) for default in metric._defaults.values()):
                self._update_none(name, metric, outputs, targets)

    def _update_none(self, name: str, metric, outputs, targets) -> None:
        """``metric.update`` with zero rows; a metric that refuses them is a config error naming it and why it
        gets them."""
        try:
            metric.update(outputs, targets)
        except (TypeError, ValueError, RuntimeError, IndexError, KeyError, AttributeError, ZeroDivisionError) as err:
            why = (str(err).strip().splitlines() or [type(err).__name__])[0]
            b = self.batches
            raise ConfigError(f"metrics.{name}._target_", f"{type(metric).__module__}.{type(metric).__qualname__}",
                              f"refused an update with zero rows ({type(err).__name__}: {why}), which a rank that "
                              f"holds no eval sample gives it ({b.n_samples} eval samples on {b.world_size} ranks x "
                              f"data.batch_size={b.batch_size}): let its update() take an empty batch, or make "
                              f"trainer.eval_samples a multiple of {b.world_size}") from err

    def _some_rank_empty(self) -> bool:
        """Whether the last global batch leaves some rank without an eval sample (rank ``r`` takes its positions
        ``r, r + W, ...``: those at or past the batch's samples get none)."""
        b = self.batches
        if not all(hasattr(b, key) for key in ("n_samples", "batch_size", "world_size", "global_batches")):
            return False
        return b.n_samples - (b.global_batches - 1) * b.world_size * b.batch_size < b.world_size

    def _update(self, name: str, metric, outputs, targets) -> None:
        if self._checked:
            metric.update(outputs, targets)
            return
        try:
            metric.update(outputs, targets)
        except (TypeError, ValueError, RuntimeError, IndexError, KeyError, AttributeError) as err:
            why = (str(err).strip().splitlines() or [type(err).__name__])[0]
            target = f"{type(metric).__module__}.{type(metric).__qualname__}"
            raise ConfigError(f"metrics.{name}._target_", target, f"refused the model's outputs {shapes(outputs)} "
                              f"against targets {shapes(targets)}: {type(err).__name__}: {why}") from err

    @torch.no_grad()
    def evaluate(self, model: nn.Module, autocast: ContextManager) -> dict:
        """``{"loss": nats, "perplexity": exp(loss) (when reported), name: value per metric}`` of ``model`` (every
        rank calls; the model is put back in train mode). No ``loss`` nor ``perplexity`` when the loss counts its
        targets and the eval set has none (every one ignored): one warning, the first time."""
        loss_sum = torch.zeros((), dtype=torch.get_default_dtype(), device=self.device)
        counted = torch.zeros_like(loss_sum)  # what the losses are means of
        was_training = model.training
        model.eval()
        for g, (batch, valid) in enumerate(self.batches):
            if self.loss_communicates is None:  # no training step in this launch (a resume at max_steps)
                self.check_loss(forward(model, batch, autocast), batch)
            n_valid, whole = int(valid.sum()), self.loss_communicates
            n, in_whole = self._whole_samples() if whole else (None, None)
            if in_whole is not None and in_whole < n and g == len(self.batches) - 1:
                # the last global batch, short (and a lone padding sample on a rank with none), on every rank
                # alike: the metrics only (a loss that gathers across ranks needs batches of one shape)
                self._metrics_only(forward(model, batch, autocast), batch, valid)
                continue
            if n_valid == 0:
                outputs = forward(model, batch, autocast)  # this rank's share is padding: the forward FSDP needs
                self._update_empty(select(upcast(prediction(outputs)), valid), select(targets_of(batch), valid))
                continue
            outputs = forward(model, batch, autocast)
            if not self._count_known:  # no training step in this launch
                own = builtin_loss(outputs) is not None
                self.counts(item_counter(self.loss_fn, model, own, batch), own and hf_kind(model) != "causal")
            loss = loss_of(outputs, batch, self.loss_fn)
            items = (torch.tensor(float(n_valid), dtype=torch.float64, device=self.device) if self.count is None
                     else self.count(batch))
            # a batch whose targets are all ignored has a NaN mean over none of them: it counts for nothing
            loss_sum += torch.where(items > 0, loss.detach().to(torch.float64) * items, 0.0).to(loss_sum.dtype).sum()
            counted += items.to(counted.dtype).sum()
            self._metrics_only(outputs, batch, None)
        model.train(was_training)
        out: dict[str, float]
        loss_sum, total = _sum_over_ranks(torch.stack([loss_sum, counted]))
        out = {}
        if total.item() > 0:  # the same on every rank: the sums are synchronised
            mean = (loss_sum / total).item()
            out["loss"] = mean
            if self.perplexity:
                out["perplexity"] = math.exp(mean) if math.isfinite(mean) and mean < 700 else math.inf
        elif not self._warned_no_target:
            self._warned_no_target = True
            n = getattr(self.batches, "n_samples", "the")
            log.warning("every target of the %s eval samples is ignored (the loss's ignore_index): no eval/loss, which "
                        "would be a mean over none; give the validation split targets to score (data)", n)
        self._checked = True
        for name, metric in self.metrics.items():
            try:
                value = metric.compute()  # (on the synced states: it raises on every rank alike)
            except Exception as err:  # noqa: BLE001 (the eval set decides: R2Score needs 2 samples; the run goes on)
                self._say_not_computed(name, metric, err)
                continue
            finally:
                metric.reset()
            out[name] = float(value) if isinstance(value, torch.Tensor) else float(value)
        return out

    def _say_not_computed(self, name: str, metric, err: BaseException) -> None:
        """One warning per metric whose ``compute()`` raised on this eval's data (too few samples, one class only):
        ``eval/<name>`` is left out of this eval (and of ``results.json`` when it is the final one), and the
        training, its checkpoints and its weights go on as they are."""
        if name in self._not_computed:
            return
        self._not_computed.add(name)
        why = (str(err).strip().splitlines() or [type(err).__name__])[0]
        n = getattr(self.batches, "n_samples", None)
        log.warning("eval/%s not computed: metrics.%s._target_=%s raised %s: %s%s; it is left out of the eval's "
                    "results (a larger eval set, trainer.eval_samples, may give it what it needs)", name, name,
                    f"{type(metric).__module__}.{type(metric).__qualname__}", type(err).__name__, why,
                    f" (on {n} eval samples)" if n is not None else "")


def _sum_over_ranks(values: torch.Tensor) -> torch.Tensor:
    """``values`` summed over the ranks (every rank calls; without a process group, as they are): gathered and
    summed by one local kernel, so every rank gets the same bits (an all-reduce's order is the backend's)."""
    if not dist.is_initialized():
        return values
    gathered = [torch.empty_like(values) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, values)
    return torch.stack(gathered).sum(0)
