"""Callbacks: the training loop's seam for code of one's own, and for hydratrain's own extras.

    # my_conf/callbacks.yaml is not needed: a node per callback, on the command line or in an experiment file
    python train.py '+callbacks.count._target_=mypkg.cb.CountSteps'

    class CountSteps(hydratrain.Callback):
        def __init__(self):
            self.steps = 0
        def on_train_step_end(self, run, step, logs):
            self.steps += 1
            if step == 50 and run.is_main:
                print("halfway")
        def state_dict(self):
            return {"steps": self.steps}
        def load_state_dict(self, state):
            self.steps = state["steps"]

A callback is any object with some of the hook methods of :class:`Callback` (subclassing it is optional). Every
rank calls every hook, in the order of the ``callbacks`` node. ``run`` is a read-only :class:`RunView`. A callback
asks the run to stop with ``run.request_stop(why)``: the ranks agree at the next log step or evaluation, and every
rank stops after the same step; the run then ends as a normal one does (final evaluation and outputs). A callback
with ``state_dict``/``load_state_dict`` is checkpointed with the run (rank 0's state, restored on every rank), so a
resumed run goes on as the uninterrupted one would; tensors in that state (DTensors under FSDP) are saved as the
model's are, each rank its shards, and resharded on load. A hook that raises ends the run with one line naming the
callback (``callbacks.<name>``).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn

from hydratrain.dist.collectives import all_reduce_max, first_given
from hydratrain.errors import CallbackError, ConfigError

log = logging.getLogger("hydratrain.callbacks")

HOOKS = ("on_fit_start", "on_train_step_start", "on_train_step_end", "on_eval_end", "on_save_checkpoint",
         "on_checkpoint_saved", "on_fit_end")


class Callback:
    """The hooks a callback may have; each does nothing here. ``run`` is the :class:`RunView`."""

    def on_fit_start(self, run: "RunView") -> None:
        """Before the first step of this launch (after a resume: with the restored step)."""

    def on_train_step_start(self, run: "RunView", step: int) -> None:
        """Before optimizer step ``step`` (its data fetch included); the previous step's log line, evaluation and
        checkpoint save are done."""

    def on_train_step_end(self, run: "RunView", step: int, logs: dict) -> None:
        """After optimizer step ``step``. ``logs``: the scalars logged at this step (``train/loss``, ``train/lr``,
        ``train/grad_norm``, ``perf/...``), empty on a step that logs nothing (``trainer.log_every_n_steps``)."""

    def on_eval_end(self, run: "RunView", step: int, metrics: dict) -> None:
        """After an evaluation at step ``step``. ``metrics``: ``{"eval/loss": ..., "eval/<name>": ...}``, the same
        on every rank. It is one dict, handed to the callbacks in order: a callback may add values of its own
        (``<prefix>/<name>``: the EMA weights' ``eval_ema/*``), which the callbacks after it see as well
        (``checkpoint.monitor`` and ``trainer.early_stopping.monitor`` may name them), as does
        ``trainer.objective``."""

    def on_save_checkpoint(self, run: "RunView", step: int) -> None:
        """Before the checkpoint of step ``step`` is written."""

    def on_checkpoint_saved(self, run: "RunView", step: int, path: Path) -> None:
        """After the checkpoint of step ``step`` is complete at ``path`` (on every rank)."""

    def on_fit_end(self, run: "RunView", result: Any) -> None:
        """After the final evaluation. ``result``: the run's ``FitResult`` (steps, losses, metrics, objective)."""


@dataclass(frozen=True)
class RunView:
    """What a callback sees of the run (read only, except :meth:`request_stop`)."""

    rank: int
    world_size: int
    run_dir: Path
    model: nn.Module  # the trained model as the strategy wraps it (DDP, FSDP2 shards)
    raw_model: nn.Module  # the same model without a DDP wrapper (FSDP2 keeps its shards in place)
    _max_steps: Callable[[], int]
    _step: Callable[[], int]
    _stop: Callable[[str], None]
    _checkpoint: Callable[[], None]
    _evaluate: Callable[[], dict] = lambda: {}
    _log_scalars: Callable[[dict, int], None] = lambda values, step: None

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that should print or write files of its own."""
        return self.rank == 0

    @property
    def step(self) -> int:
        """Optimizer steps done."""
        return self._step()

    @property
    def max_steps(self) -> int:
        """The step the run trains to (``trainer.max_steps``, or what ``trainer.max_epochs`` gives)."""
        return self._max_steps()

    def request_stop(self, why: str) -> None:
        """Stop the run after this step (agreed by every rank at the next log step or evaluation)."""
        self._stop(why)

    def request_checkpoint(self) -> None:
        """Save a checkpoint at the next log step or evaluation, this step if it is one (agreed by every rank)."""
        self._checkpoint()

    def evaluate(self) -> dict:
        """The run's evaluation (the fixed eval set, the loss and the ``metrics``) of the model as it is now:
        ``{"loss": ..., "<name>": ...}``, the same on every rank, logged nowhere. Every rank must call (from the same
        hook at the same step): the model's forward and the metrics' sync are collective."""
        return self._evaluate()

    def log_scalars(self, values: dict, step: int) -> None:
        """Log ``{tag: value}`` at ``step`` to every tracker of the run (TensorBoard, and CSV, MLflow, W&B where
        ``logger`` names them; rank 0 writes; any rank may call)."""
        self._log_scalars(values, step)


STOPPED = "__stopped__"  # the key of the agreed stop's reason in the callbacks' checkpointed state


class Callbacks:
    """The run's callbacks by name, called in order; also the Stateful entry of their states in checkpoints."""

    def __init__(self, callbacks: dict[str, Any], device: torch.device):
        self.callbacks, self.device = dict(callbacks), device
        self.view: Optional[RunView] = None
        self.stop_reason: Optional[str] = None  # this rank's request
        self.stopped: Optional[str] = None  # the agreed stop's reason, once agreed
        self.resumed_stop: Optional[str] = None  # the stop the checkpoint this run resumed from was saved after
        self.checkpoint_requested = False  # this rank's request for a save at this step

    def __bool__(self) -> bool:
        return bool(self.callbacks)

    def bind(self, view: RunView) -> None:
        self.view = view

    def request_stop(self, why: str) -> None:
        if self.stop_reason is None:
            self.stop_reason = why

    def call(self, hook: str, *args: Any) -> None:
        """``hook`` of every callback that has it. A callback that raises becomes a one-line error naming it."""
        for name, callback in self.callbacks.items():
            method = getattr(callback, hook, None)
            if method is None:
                continue
            try:
                method(self.view, *args)
            except (ConfigError, CallbackError):
                raise
            except Exception as err:  # noqa: BLE001 (any error of a user's code: one line naming it)
                why = (str(err).strip().splitlines() or [""])[0]
                raise CallbackError(f"callbacks.{name} ({type(callback).__name__}.{hook}) raised "
                                    f"{type(err).__name__}: {why}") from err

    def request_checkpoint(self) -> None:
        self.checkpoint_requested = True

    def agree(self) -> tuple[bool, bool]:
        """(stop, save a checkpoint now): whether any rank's callback asked for either (one all-reduce; every rank
        calls at the same steps). A stop is kept once agreed; a checkpoint request is for this step only."""
        if not self.callbacks:
            return False, False
        flags = all_reduce_max(torch.tensor([int(self.stop_reason is not None), int(self.checkpoint_requested)],
                                            dtype=torch.int32, device=self.device)).tolist()
        self.checkpoint_requested = False
        if flags[0] and self.stopped is None:  # (once, on every rank alike: the asking rank's reason for all)
            self.stopped = first_given(self.stop_reason) or "a callback asked to stop"
        return self.stopped is not None, bool(flags[1])

    # Stateful: the states of the callbacks that have one, by name, and the agreed stop's reason (every save at or
    # after the stop's step comes after the agreement: a relaunch of the stopped run knows it stopped)
    def state_dict(self) -> dict:
        states = {name: cb.state_dict() for name, cb in self.callbacks.items()
                  if callable(getattr(cb, "state_dict", None))}
        return {**states, STOPPED: self.stopped or ""}

    def load_state_dict(self, state: dict) -> None:
        for name, cb in self.callbacks.items():
            if name in state and callable(getattr(cb, "load_state_dict", None)):
                cb.load_state_dict(state[name])
        self.resumed_stop = state.get(STOPPED) or None



def improves(value: float, best: Optional[float], mode: str, min_delta: float = 0.0) -> bool:
    """Whether ``value`` beats ``best`` by more than ``min_delta`` (``mode`` min: lower is better; max: higher).
    A NaN never improves; anything improves on no best."""
    if value != value:  # NaN
        return False
    if best is None:
        return True
    return value < best - min_delta if str(mode) == "min" else value > best + min_delta
