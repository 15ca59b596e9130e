"""Activation checkpointing and ``torch.compile``, applied before the strategy wraps the model (the order torchtitan
uses: AC, then compile, then FSDP). Blocks come from :mod:`hydratrain.parallel.blocks`.

``trainer.compile`` (:func:`choose_compile`, a pure function of the setting, the device, the strategy and AC):

- ``auto`` (the default): compile on CUDA, not elsewhere. On the CPU compiling gained nothing measurable (gpt_tiny,
  within the noise of eager) and cost about 26 s more start-up; on one H200 the whole gpt_small compiled ran 1.38x
  the eager loop's tokens/s (docs/performance.md).
- ``true``: compile on any device, at the granularity ``auto`` picks on CUDA:

  - ``single``: the whole model (``Module.compile()`` on the root, so parameter names keep no ``_orig_mod.``): one
    graph holds the embedding, every block, the final norm and the head, so inductor fuses across block boundaries
    (whole model 1.38x eager, per block 1.04x, gpt_small on one H200). Blocks under activation checkpointing are
    traced as checkpoint regions (a higher-order op) inside that graph and still recomputed in backward.
  - ``ddp`` without activation checkpointing: the whole model, compiled before DDP wraps it. DDP's forward runs the
    compiled module inside ``DistributedDataParallel._inside_ddp_forward``, where dynamo's ``DDPOptimizer`` splits
    the graph at DDP's bucket boundaries, so the gradient all-reduce still overlaps the backward
    (``torch._dynamo.config.optimize_ddp``, default ``ddp_optimizer``).
  - ``ddp`` with activation checkpointing: per block, each block compiled inside its checkpoint wrapper, so the
    checkpoint stays outside every compiled graph: ``DDPOptimizer`` does not split graphs around higher-order ops
    (it fell back to one bucket, pytorch/pytorch#104639; DDP + compile + AC failures: #104674, #119440, #144035).
  - ``fsdp``/``hsdp``: per block, before ``fully_shard`` (torchtitan's ``apply_compile``: "compile each
    TransformerBlock ... efficient due to repeated structure"). FSDP2 runs its unit hooks with dynamo disabled
    (``torch.distributed.fsdp._fully_shard._fsdp_state``: ``_dynamo_disable``), so a whole-model graph would be
    broken at every unit's hooks anyway; per block, one compiled graph serves every block of a class.
- ``model`` / ``blocks``: that granularity whatever the strategy (``model`` under FSDP is correct but breaks at each
  unit's hooks).
- ``false``: eager.
"""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any, ContextManager, Iterator, Optional

import torch
from torch import nn

from hydratrain.config.values import COMPILE_VALUES, compile_setting  # noqa: F401  (re-exported)
from hydratrain.errors import ConfigError
from hydratrain.parallel.blocks import Blocks, find_blocks

log = logging.getLogger("hydratrain.compile")

@dataclass(frozen=True)
class CompileChoice:
    """What ``trainer.compile`` resolved to: ``what`` is ``none``, ``model`` (the whole model) or ``blocks`` (each
    block); ``why`` says which rule chose it, in a few words for the start-up line."""

    what: str
    why: str

    @property
    def enabled(self) -> bool:
        return self.what != "none"


def choose_compile(setting: Any, device_type: str, strategy: str, activation_checkpointing: bool,
                   has_blocks: bool) -> CompileChoice:
    """What to compile (see the module docstring) for ``trainer.compile=setting`` on a ``device_type`` (``cuda``,
    ``cpu``, ...) under ``strategy`` (``single``, ``ddp``, ``fsdp``, ``hsdp``), with or without activation
    checkpointing, for a model in which blocks were (``has_blocks``) or were not found.

    Pure: reads no device. Raises :class:`~hydratrain.errors.ConfigError` naming ``trainer.compile`` when the setting
    is not one of :data:`COMPILE_VALUES`, or asks for blocks (``blocks``, or ``true`` under ``fsdp``/``hsdp``) of a
    model with none."""
    value = compile_setting(setting)
    if value == "false":
        return CompileChoice("none", "trainer.compile=false")
    if value == "auto" and device_type != "cuda":
        return CompileChoice("none", f"trainer.compile=auto: not on {device_type}, where compiling measured within "
                             "the noise of eager for ~26 s more start-up")
    if value == "model":
        return CompileChoice("model", "trainer.compile=model")
    sharded = strategy in ("fsdp", "hsdp")
    if value == "blocks" or sharded or (strategy == "ddp" and activation_checkpointing):
        if not has_blocks:
            if value == "auto":
                return CompileChoice("none", f"trainer.compile=auto: no blocks found to compile one by one under "
                                     f"{strategy} (name them with wrap_policy.block_classes)")
            raise ConfigError("trainer.compile", value, "found no blocks in the model to compile one by one (no "
                              "_no_split_modules, no nn.ModuleList or nn.Sequential of one class): name them with "
                              "wrap_policy.block_classes, or use trainer.compile=model")
        if value == "blocks":
            return CompileChoice("blocks", "trainer.compile=blocks")
        why = ("per block under FSDP2, whose unit hooks break any larger graph" if sharded else
               "per block under ddp with activation checkpointing: DDP's graph splitting does not cross checkpoints")
        return CompileChoice("blocks", f"trainer.compile={value} on {device_type}: {why}")
    why = "the whole model under ddp (graph split at DDP's buckets)" if strategy == "ddp" else "the whole model"
    return CompileChoice("model", f"trainer.compile={value} on {device_type}: {why}")


def apply_activation_checkpointing(model: nn.Module, blocks: Optional[Blocks] = None) -> int:
    """Wrap each of ``blocks`` (default: :func:`~hydratrain.parallel.blocks.find_blocks`) with non-reentrant
    activation checkpointing; returns how many were wrapped.

    Uses ``torch.distributed.algorithms._checkpoint.checkpoint_wrapper`` (its prefix is stripped from state-dict keys
    by ``torch.distributed.checkpoint.state_dict``, so checkpoints do not depend on it). ``blocks`` then holds the
    wrappers: one per distinct block, put in every place the block is used (a layer shared across depths, as in
    ALBERT, is checkpointed at each use and is one FSDP unit). A block holding BatchNorm layers that track running
    statistics recomputes its forward in train mode in backward, which would update those statistics a second time
    per step: its recomputation keeps them as the forward left them (:func:`_statistics_kept`), so checkpointing
    changes nothing a step computes.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    blocks = blocks if blocks is not None else find_blocks(model)

    def wrapper(module: nn.Module) -> nn.Module:
        from torch.nn.modules.batchnorm import _BatchNorm

        norms = [m for m in module.modules() if isinstance(m, _BatchNorm) and m.track_running_stats]
        if not norms:
            return checkpoint_wrapper(module, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        return checkpoint_wrapper(module, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                                  context_fn=lambda: (contextlib.nullcontext(), _statistics_kept(norms)))

    wrappers = {id(m): wrapper(m) for m in blocks.modules}  # one per distinct block, however often it is used
    for parent in list(model.modules()):
        for name, child in list(parent._modules.items()):  # every use (named_children yields a module once)
            if id(child) in wrappers and parent is not wrappers[id(child)]:
                setattr(parent, name, wrappers[id(child)])
    blocks.modules = list(wrappers.values())
    return len(blocks.modules)


@contextlib.contextmanager
def _statistics_kept(norms: list) -> Iterator[None]:
    """The running statistics (mean, var, batch count) of ``norms`` as they are on entry, put back on exit: the
    recomputation of a checkpointed block in backward must not update them again."""
    with torch.no_grad():
        kept = [[b.clone() for b in (m.running_mean, m.running_var, m.num_batches_tracked) if b is not None]
                for m in norms]
    try:
        yield
    finally:
        with torch.no_grad():
            for m, saved in zip(norms, kept):
                for b, s in zip([b for b in (m.running_mean, m.running_var, m.num_batches_tracked) if b is not None],
                                saved):
                    b.copy_(s)


def compile_blocks(blocks: Blocks, **options) -> int:
    """``torch.compile`` each of ``blocks`` in place (``Module.compile`` keeps parameter names; under activation
    checkpointing the block inside its wrapper, so the recomputation runs the compiled block); returns how many.
    ``options`` go to ``torch.compile`` (tests pass ``backend="aot_eager"``).

    Blocks of one class share one forward and, with ``torch._dynamo.config.inline_inbuilt_nn_modules`` (the default
    since torch 2.5), their parameters are graph inputs rather than guarded constants, so one compiled graph serves
    every block instead of one recompile per block (which would hit dynamo's recompile limit on deep models and
    silently fall back to eager).
    """
    for m in blocks.modules:
        getattr(m, "_checkpoint_wrapped_module", m).compile(**options)
    return len(blocks.modules)


def apply_compile(raw: nn.Module, blocks: Blocks, choice: CompileChoice, **options) -> Optional[str]:
    """Compile ``raw`` in place as ``choice`` says, before any wrapper (DDP, ``fully_shard``) is applied; returns
    what was compiled (``the whole model (GPT)``, ``12 blocks (12 Block)``), or None when nothing was. ``options``
    go to ``torch.compile``."""
    if choice.what == "model":
        raw.compile(**options)  # Module.compile: the module itself runs compiled, its state-dict keys unchanged
        return f"the whole model ({type(raw).__name__})"
    if choice.what == "blocks":
        return f"{compile_blocks(blocks, **options)} blocks ({blocks.describe()})"
    return None


def eager() -> ContextManager:
    """A context in which compiled modules run eagerly (``torch.compiler.set_stance("force_eager")``). Evaluation
    and sampling run in it: compiled graphs serve the training steps, and an eval (no grad, eval mode) or each new
    length of a generated sequence would otherwise be compiled again, which costs more than it saves."""
    return torch.compiler.set_stance("force_eager")


class CompileClock:
    """Times the first two training steps of a launch whose model has compiled parts (``compiled``, as
    :func:`apply_compile` returned it) and logs one line: what was compiled and the compilation time, estimated as
    the first step's seconds minus the second's (each timed to a device synchronisation, two in a launch).

    Call :meth:`step_done` after each step with the step's index in this launch (0, 1, ...), its start time
    (``time.perf_counter()``) and whether it was the launch's last step."""

    def __init__(self, compiled: str, device):
        self.compiled, self.device = compiled, device
        self.first: Optional[float] = None
        self.compile_s: Optional[float] = None  # the estimate, once the second step is done
        self.done = False

    def step_done(self, index: int, started: float, last: bool = False) -> None:
        if self.done or index > 1:
            return

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - started
        if index == 0:
            self.first = seconds
            if last:
                log.info("torch.compile: compiled %s; the first step took %.2f s, compilation included (no second "
                         "step to compare)", self.compiled, seconds)
                self.done = True
            return
        self.compile_s = max(0.0, self.first - seconds)  # type: ignore[operator]  # (set at index 0)
        log.info("torch.compile: compiled %s; first step %.2f s, second %.3f s: about %.1f s of compilation",
                 self.compiled, self.first, seconds, self.compile_s)
        self.done = True
