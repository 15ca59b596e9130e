"""EMA weights: a callback that keeps an exponential moving average of the trainable parameters, evaluates it beside
the raw weights and exports it.

    python train.py trainer.ema.decay=0.999 trainer.ema.warmup_steps=100 checkpoint.monitor=eval_ema/loss

After every optimizer step ``t`` (1, 2, ...) each EMA tensor moves towards its parameter::

    decay_t = decay * min(1, t / warmup_steps)     (decay itself when warmup_steps = 0)
    ema     = decay_t * ema + (1 - decay_t) * param

so with a warm-up the average starts close to the weights and its memory grows linearly to ``1 / (1 - decay)``
steps by step ``warmup_steps``. It starts from the weights the run starts with (after ``model.init_from``). A step
whose update the non-finite guard or the fp16 scaler dropped still counts: the average moves towards the unchanged
weights (reading the skip flag would cost a host synchronisation per step).

The EMA is float32 and sharded exactly as the parameters are: under FSDP/HSDP each rank keeps the EMA of its own
shard (a DTensor with the parameter's placements; the update acts on the local shards, nothing is gathered), under
DDP and single each rank a whole copy. Buffers (BatchNorm's running statistics) are not averaged: the EMA weights are
evaluated and exported with the run's own buffers.

At every evaluation the EMA values are copied into the parameters (the raw ones kept aside and copied back after),
the run's evaluation runs again and its values are logged as ``eval_ema/<name>`` (TensorBoard and the log); they are
also added to the metrics the later callbacks get, so ``checkpoint.monitor=eval_ema/loss``,
``trainer.early_stopping.monitor=eval_ema/accuracy`` and ``trainer.objective=eval_ema/loss`` work (this callback runs
before every other). Its state (the EMA tensors, DTensors under FSDP) is checkpointed with the run and resharded on
load like the model's, so a resumed run's EMA is the uninterrupted one's. With ``trainer.save_weights`` the end of the
run writes ``model_ema.safetensors`` beside ``model.safetensors``, in its format.
"""
from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from torch import nn

from hydratrain.parallel import float8
from hydratrain.parallel.init import canonical_name
from hydratrain.train.callbacks import Callback, RunView
from hydratrain.train.outputs import save_weights

log = logging.getLogger("hydratrain.callbacks")

FILE = "model_ema.safetensors"
PREFIX = "eval_ema/"


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the tensor itself under no_grad), else ``t``."""
    return t.to_local() if hasattr(t, "to_local") else t


def _reshard(model: nn.Module) -> None:
    """Free the gathered parameters FSDP2 still holds (its root keeps them after a forward without a backward, as
    an evaluation is), so the next forward gathers the sharded values again. Nothing outside FSDP2."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        return
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


class EMA(Callback):
    """The EMA of ``model``'s trainable parameters (the model as the strategy built it, FSDP2 shards in place).

    ``save_weights``: write :data:`FILE` at the end of the run; ``metadata``: its header's entries (the model's
    config, as ``model.safetensors`` has)."""
    def __init__(self, model: nn.Module, decay: float, warmup_steps: int = 0, save_weights: bool = True,
                 metadata: Optional[dict] = None):

        self.decay, self.warmup_steps = float(decay), int(warmup_steps)
        self.save_weights, self.metadata = save_weights, dict(metadata or {})
        self.names, self.params = [], []
        for name, p in model.named_parameters():
            if p.requires_grad:
                self.names.append(canonical_name(name))
                self.params.append(p)
        with torch.no_grad():  # (a DTensor clone keeps the placements: each rank its own shard; float8.plain: not
            # torchao's float8-cast wrapper of a weight gathered in float8, which safetensors cannot write)
            self.ema = [float8.plain(p).detach().to(torch.float32, copy=True) for p in self.params]
        self._fp32 = all(p.dtype == torch.float32 for p in self.params)
        self._restored = False  # loaded from a checkpoint (else it starts from the weights at on_fit_start)
        self.evaluated: dict = {}  # the latest evaluation of the EMA weights, {"eval_ema/<name>": value}

    def decay_at(self, step: int) -> float:
        """The decay of the update after optimizer step ``step`` (1-based)."""
        if self.warmup_steps > 0:
            return self.decay * min(1.0, step / self.warmup_steps)
        return self.decay

    # --------------------------------------------------------------------------------------------------- hooks
    def on_fit_start(self, run: RunView) -> None:
        if self._restored:
            return
        if run.step > 0:
            log.warning("the checkpoint resumed at step %d holds no EMA of the weights (trainer.ema): it starts from "
                        "the resumed weights", run.step)
        self._copy(self.params, self.ema)  # the weights the run starts from (model.init_from loaded after build)

    @torch.no_grad()
    def on_train_step_end(self, run: RunView, step: int, logs: dict) -> None:
        weight = 1.0 - self.decay_at(step)
        params = [_local(p) for p in self.params]
        if not self._fp32:
            params = [p.float() for p in params]
        torch._foreach_lerp_([_local(e) for e in self.ema], params, weight)

    def on_eval_end(self, run: RunView, step: int, metrics: dict) -> None:
        with self.swapped(run.raw_model):
            values = run.evaluate()
        tagged = {f"{PREFIX}{name}": value for name, value in values.items()}
        run.log_scalars(tagged, step)
        formats = {"loss": ".4f", "perplexity": ".3f"}
        log.info("eval of the EMA weights at step %d: %s", step,
                 " ".join(f"{name} {value:{formats.get(name, '.4g')}}" for name, value in values.items()))
        self.evaluated = tagged
        metrics.update(tagged)  # for the callbacks after this one (checkpoint.monitor=eval_ema/loss, ...)

    def on_fit_end(self, run: RunView, result: Any) -> None:
        if not self.save_weights:
            return

        with self.swapped(run.raw_model):
            path = save_weights(run.model, Path(run.run_dir) / FILE, run.is_main,
                                {**self.metadata, "ema_decay": str(self.decay),
                                 "ema_warmup_steps": str(self.warmup_steps), "step": str(run.step)})
        if path:
            log.info("wrote the EMA weights (trainer.ema.decay=%g) to %s", self.decay, path)

    # ------------------------------------------------------------------------------------------------- swap
    @contextlib.contextmanager
    def swapped(self, model: nn.Module) -> Iterator[None]:
        """The EMA values in the parameters inside the block (every rank calls: FSDP's shards), the raw ones after."""
        _reshard(model)  # (gathered copies of the raw values would be used instead of the EMA's)
        backup = [_local(p).detach().clone() for p in self.params]
        self._copy(self.ema, self.params)
        float8.drop_precomputed_scales(self.params)  # (precision=fp8: those were the raw weights' scales)
        try:
            yield
        finally:
            self._copy(backup, self.params)
            _reshard(model)  # (nor the EMA's by the next training step)

    @staticmethod
    @torch.no_grad()
    def _copy(sources: list, targets: list) -> None:
        for src, dst in zip(sources, targets):
            _local(dst).copy_(_local(src))

    # -------------------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict:
        return {"weights": dict(zip(self.names, self.ema))}

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("weights") or {}
        missing = [n for n in self.names if n not in saved]
        if missing:
            log.warning("the checkpoint's EMA of the weights has no %s: %s start from the resumed weights",
                        ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else ""),
                        "they" if len(missing) > 1 else "it")
        with torch.no_grad():
            for name, ema, p in zip(self.names, self.ema, self.params):
                value = saved.get(name)
                if value is None:
                    _local(ema).copy_(_local(p))
                elif value is not ema:  # (DCP fills the tensors state_dict gave it in place)
                    _local(ema).copy_(_local(value))
        self._restored = True
