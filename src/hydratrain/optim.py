"""Optimizer and learning-rate schedule builders.

- ``adamw``: ``torch.optim.AdamW`` (Loshchilov & Hutter 2019) with weight decay on matrices only; norms' gains and
  biases (1-D tensors) get none, as in GPT-2/LLaMA training recipes. ``optim.impl=auto`` uses torch's fused kernel
  where it has one for the parameters' device (CPU and CUDA; one kernel launch per parameter group instead of a few
  per tensor, which matters most for FSDP's DTensor shards, whose every op is dispatched in Python), else foreach.
- ``adamw8bit``: the same update with both moments stored as 8-bit block-wise quantised codes (Dettmers et al. 2022,
  "8-bit Optimizers via Block-wise Quantization"), by torchao's ``torchao.optim.AdamW8bit`` (extra ``[lowbit]``).
  It works on FSDP2's DTensor shards (each rank quantises its own shard) and on plain tensors, on CPU and CUDA; its
  update is compiled with ``torch.compile`` (on CPU: a C++ compiler; the first step of a run pays the compilation).
  bitsandbytes' ``AdamW8bit`` was measured too (0.50.2, CPU): it trains plain tensors but fails on DTensor
  parameters ("got mixed torch.Tensor and DTensor"), so it cannot serve fsdp/hsdp.
- ``warmup_cosine``: linear warm-up over ``warmup_steps`` to ``optim.lr``, then cosine decay (Loshchilov & Hutter
  2017, SGDR, one cycle) to ``min_lr_ratio * optim.lr`` at ``total_steps``. ``constant``: warm-up, then flat.
"""
from __future__ import annotations

import contextlib
import fnmatch
import logging
import math
import warnings
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
from omegaconf import OmegaConf
from torch import nn

from hydratrain.components import locate
from hydratrain.config.settings import node_dict
from hydratrain.errors import ConfigError
from hydratrain.parallel.init import canonical_name

LOWBIT_INSTALL = "pip install -e '.[lowbit]'"
log = logging.getLogger(__name__)


def param_groups(model: nn.Module, optim_cfg, weight_decay: Optional[float]) -> list[dict]:
    """The optimizer's parameter groups over ``model``'s trainable parameters. ``optim.param_groups``: a list of
    ``{match: <glob on parameter names>, lr_scale, weight_decay}``; each parameter goes to the first entry whose
    glob matches its name (the model's own name, without wrappers' prefixes), the rest to the default. Within a
    group without its own ``weight_decay``, ``weight_decay`` applies to matrices and none to 1-D tensors (norms'
    gains, biases); ``weight_decay`` None: one group, no such split. The lr of a group is ``optim.lr * lr_scale``
    (the schedule scales each). Logs how many parameters each group got. Raises :class:`ConfigError` naming
    ``optim.param_groups[i].match`` for a glob that matches no trainable parameter."""
    entries = [dict(e) for e in (optim_cfg.get("param_groups") or [])]
    named = [(_plain_name(n), p) for n, p in model.named_parameters() if p.requires_grad]
    chosen: list[list] = [[] for _ in entries] + [[]]
    for name, p in named:
        index = next((i for i, e in enumerate(entries) if fnmatch.fnmatchcase(name, str(e["match"]))), len(entries))
        chosen[index].append(p)
    groups, lines = [], []
    for i in [len(entries), *range(len(entries))]:  # the default group first: train/lr is its lr
        params = chosen[i]
        entry = entries[i] if i < len(entries) else {}
        if i < len(entries) and not params:
            raise ConfigError(f"optim.param_groups[{i}].match", entry["match"], "matches no trainable parameter; the "
                              f"names look like {', '.join(n for n, _ in named[:3])}")
        extra = {"lr": float(optim_cfg.lr) * float(entry["lr_scale"])} if entry.get("lr_scale") is not None else {}
        decay = entry.get("weight_decay", weight_decay)
        if decay is None or "weight_decay" in entry:
            split = [(params, {} if decay is None else {"weight_decay": float(decay)})]
        else:
            split = [([p for p in params if p.ndim >= 2], {"weight_decay": float(decay)}),
                     ([p for p in params if p.ndim < 2], {"weight_decay": 0.0})]
        groups += [{"params": ps, **values, **extra} for ps, values in split if ps]
        if entries and params:
            what = f"'{entry['match']}'" if i < len(entries) else "the rest"
            lines.append(f"{what} {sum(p.numel() for p in params):,} parameters in {len(params)} tensors" +
                         "".join(f", {k} {v}" for k, v in entry.items() if k != "match"))
    if lines:
        log.info("optimizer parameter groups (optim.param_groups): %s", "; ".join(lines))
    return groups


def _plain_name(name: str) -> str:
    """A parameter's name as the model names it: without DDP's ``module.`` and the wrappers' prefixes."""
    return canonical_name(name.removeprefix("module."))


def build_optimizer(model: nn.Module, optim_cfg) -> torch.optim.Optimizer:
    """AdamW (``optim=adamw``) or torchao's 8-bit AdamW (``optim=adamw8bit``) over ``model``'s trainable parameters
    (DTensor shards under fsdp/hsdp), in the groups :func:`param_groups` makes. Raises ImportError for adamw8bit
    without torchao (``check_environment`` reports that as a config error before any process group)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if is_own(optim_cfg):
        return _own_optimizer(model, params, optim_cfg)
    groups = param_groups(model, optim_cfg, optim_cfg.weight_decay)
    kwargs = dict(lr=optim_cfg.lr, betas=(optim_cfg.beta1, optim_cfg.beta2), eps=optim_cfg.eps)
    if str(optim_cfg.name) == "adamw8bit":
        with _quiet_import():
            from torchao.optim import AdamW8bit
        # torchao compiles its step over a tensor subclass; dynamo's note about that class's caching hash reached the
        # console at the first step with a source line, and says nothing a run can act on
        warnings.filterwarnings("ignore", message=".*does not implement _stable_hash_for_caching", category=UserWarning)
        log.info("optimizer: torchao.optim.AdamW8bit, block_size %d", optim_cfg.block_size)
        return AdamW8bit(groups, block_size=optim_cfg.block_size, **kwargs)
    impl = adamw_impl(str(optim_cfg.get("impl", "auto")), params)
    log.info("optimizer: torch.optim.AdamW, %s implementation%s", impl,
             " (optim.impl=auto)" if str(optim_cfg.get("impl", "auto")) == "auto" else "")
    flags: dict[str, Any] = {"for_loop": {"foreach": False}, "foreach": {"foreach": True},
                             "fused": {"fused": True}}[impl]
    return torch.optim.AdamW(groups, **kwargs, **flags)


def is_own(optim_cfg) -> bool:
    """Whether the ``optim`` node names an optimizer class of the researcher's choice (``_target_``), rather than a
    built-in option (``name: adamw`` | ``adamw8bit``)."""
    return optim_cfg is not None and "_target_" in optim_cfg


def optimizer_name(optim_cfg) -> str:
    """``adamw``, ``adamw8bit``, or the class an own optimizer names (``torch.optim.SGD``)."""
    return str(optim_cfg["_target_"]) if is_own(optim_cfg) else str(optim_cfg.name)


#: an own optimizer node's keys that hydratrain reads itself
OWN_KEYS = ("_target_", "lr", "weight_decay", "param_groups")


def own_keywords(optim_cfg) -> dict:
    """The constructor keywords of an own optimizer node: every key but ``_target_``, ``lr`` and ``weight_decay``,
    which :func:`_own_optimizer` passes itself."""
    node: Any = OmegaConf.to_container(optim_cfg, resolve=True) if OmegaConf.is_config(optim_cfg) else dict(optim_cfg)
    return {k: v for k, v in node.items() if k not in OWN_KEYS}


def _own_optimizer(model: nn.Module, params: list, optim_cfg) -> torch.optim.Optimizer:
    """``<_target_>(param groups, lr=optim.lr, **keywords)``: with ``weight_decay`` in the node, two groups as for
    AdamW (the decay on matrices, none on norms' gains and biases), else one. The schedule scales each group's lr
    (``hydratrain.optim.Schedule``), and the state is checkpointed whatever the class (``torch.optim``'s
    ``state_dict``). Raises :class:`~hydratrain.errors.ConfigError` naming ``optim._target_``."""
    target = str(optim_cfg["_target_"])
    cls = locate(target, "optim")
    decay = optim_cfg.get("weight_decay")
    groups = param_groups(model, optim_cfg, decay)
    try:
        optimizer = cls(groups, lr=float(optim_cfg.lr), **own_keywords(optim_cfg))
    except Exception as err:  # noqa: BLE001 (the class's own refusal of a value: one line naming it)
        why = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ConfigError("optim._target_", target, f"building it raised {type(err).__name__}: {why}") from None
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError("optim._target_", target, f"built a {type(optimizer).__name__}, not a "
                          "torch.optim.Optimizer")
    log.info("optimizer: %s%s", target, f", weight decay {decay} on matrices" if decay is not None else "")
    return optimizer


FUSED_DEVICES = ("cpu", "cuda")  # torch.optim.AdamW(fused=True) kernels in every torch this package supports (>= 2.6)


def adamw_impl(requested: str, params: list) -> str:
    """``for_loop`` | ``foreach`` | ``fused``: ``requested`` unless ``auto``; auto is fused when every parameter is
    a floating tensor on a device with a fused kernel (:data:`FUSED_DEVICES`), else foreach."""
    if requested != "auto":
        return requested
    fused = bool(params) and all(p.device.type in FUSED_DEVICES and p.is_floating_point() for p in params)
    return "fused" if fused else "foreach"


@contextlib.contextmanager
def _quiet_import() -> Iterator[None]:
    """Silence torchao's import-time warnings (its CUDA-only kernel libraries that do not load on CPU, a pytree
    deprecation): they say nothing about this run."""
    loggers = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def lowbit_available() -> bool:
    """Whether torchao (``optim=adamw8bit``) is installed, without importing it."""
    import importlib.util

    return importlib.util.find_spec("torchao") is not None


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state this rank holds: the local shard of every state tensor, and the inner tensors
    (8-bit codes, one fp32 scale per block, the 256-entry fp32 code table) of quantised ones such as torchao's
    ``OptimState8bit``; each storage counted once."""
    total, seen = 0, set()

    def add(t: torch.Tensor) -> None:
        nonlocal total
        if hasattr(t, "to_local"):  # DTensor: this rank's shard
            t = t.to_local()
        if hasattr(t, "__tensor_flatten__") and type(t) is not torch.Tensor:  # a tensor subclass: its parts
            names, _ = t.__tensor_flatten__()
            for name in names:
                add(getattr(t, name))
            return
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()

    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                add(value)
    return total


def lr_factor(step: int, name: str, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the peak lr for optimizer step ``step`` (0-based) under schedule ``name``: a linear warm-up
    reaching 1.0 at step ``warmup_steps - 1``, then (``warmup_cosine``) a cosine decay from that peak (step 0 without
    warm-up) to exactly ``min_lr_ratio`` at the last step, ``total_steps - 1`` (SGDR's cosine annealing,
    Loshchilov & Hutter 2017, without restarts)."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if name == "constant":
        return 1.0
    peak = max(warmup_steps - 1, 0)
    progress = min(1.0, (step - peak) / max(1, total_steps - 1 - peak))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


@dataclass
class Schedule:
    """:func:`lr_factor` of one run as a callable for ``LambdaLR``; ``total_steps`` may be re-targeted on a resume
    (``trainer.max_epochs`` on another batch geometry: ``Trainer.keep_the_epoch_limit``)."""
    name: str
    warmup_steps: int
    total_steps: int
    min_lr_ratio: float

    def __call__(self, step: int) -> float:
        return lr_factor(step, self.name, self.warmup_steps, self.total_steps, self.min_lr_ratio)


#: keywords of an own scheduler class that the run fills when its node does not give them: the run's length
RUN_LENGTH_KEYWORDS = ("total_steps", "T_max", "total_iters")


def build_scheduler(optimizer: torch.optim.Optimizer, scheduler_cfg, total_steps: int):
    """``torch.optim.lr_scheduler.LambdaLR`` applying :func:`lr_factor` (a :class:`Schedule`); step it once per
    optimizer step (the update of optimizer step ``s``, 1-based, uses factor ``s - 1``). A node with ``_target_``:
    :func:`own_scheduler`."""
    if is_own(scheduler_cfg):
        return own_scheduler(optimizer, scheduler_cfg, total_steps)
    schedule = Schedule(str(scheduler_cfg.name), scheduler_cfg.warmup_steps, total_steps,
                        scheduler_cfg.get("min_lr_ratio", 1.0))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def own_scheduler(optimizer: torch.optim.Optimizer, scheduler_cfg, total_steps: int):
    """``<_target_>(optimizer, **keywords)``: any ``torch.optim.lr_scheduler`` class (or one of one's own), stepped
    after every optimizer step, except ``ReduceLROnPlateau``, which is stepped after every evaluation with the
    monitored metric (:class:`hydratrain.train.extras.PlateauStep`). A run-length keyword the class takes
    (:data:`RUN_LENGTH_KEYWORDS`: OneCycleLR's ``total_steps``, CosineAnnealingLR's ``T_max``) and the node leaves out
    is the run's number of optimizer steps. Raises :class:`~hydratrain.errors.ConfigError` naming
    ``scheduler._target_``."""
    import inspect


    target = str(scheduler_cfg["_target_"])
    cls = locate(target, "scheduler")
    kwargs = {k: v for k, v in node_dict(scheduler_cfg).items() if not k.startswith("_")}
    params = inspect.signature(cls).parameters
    kwargs.update({k: total_steps for k in RUN_LENGTH_KEYWORDS if k in params and k not in kwargs})
    try:
        scheduler = cls(optimizer, **kwargs)
    except Exception as err:  # noqa: BLE001 (the class's own refusal of a value: one line naming it)
        why = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ConfigError("scheduler._target_", target, f"building it raised {type(err).__name__}: {why}") from None
    log.info("lr schedule: %s(%s)", target, ", ".join(f"{k}={v}" for k, v in kwargs.items()))
    return scheduler


def steps_per_evaluation(scheduler) -> bool:
    """Whether ``scheduler`` is stepped after each evaluation with a metric (``ReduceLROnPlateau``) rather than after
    each optimizer step."""
    return isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)


def total_steps(trainer_cfg, batches, done: int = 0) -> int:
    """Optimizer steps the run takes in all: ``trainer.max_steps`` capped by ``trainer.max_epochs``, counted as
    ``done`` steps already taken plus the micro-batches ``batches`` (a ``hydratrain.data.streams.ShardedBatches``)
    has left before that epoch ends from its current position, ``trainer.grad_accum_steps`` per step. From a fresh
    position that is ``max_epochs * batches_per_epoch // grad_accum_steps``; after a resume on another batch size,
    accumulation or world size it still ends the run at the end of that epoch."""
    steps = []
    if trainer_cfg.max_steps is not None:
        steps.append(trainer_cfg.max_steps)
    if trainer_cfg.max_epochs is not None:
        steps.append(done + batches.batches_left(trainer_cfg.max_epochs) // trainer_cfg.grad_accum_steps)
    return max(0, min(steps))


def warn_run_length(trainer_cfg, scheduler_cfg, batches, steps: int, done: int = 0) -> None:
    """Log one warning line each when the run's length is not what its keys suggest: one optimizer step of
    ``trainer.grad_accum_steps`` micro-batches spans more than an epoch (a typo such as 2**32 would make the first step
    run for days without a word), ``trainer.max_epochs`` ends
    with micro-batches that fill no whole step of ``trainer.grad_accum_steps`` (they are not trained),
    ``trainer.max_steps`` ends the run before ``trainer.max_epochs`` does (both set), or ``scheduler.warmup_steps``
    is not shorter than the ``steps`` optimizer steps it takes (:func:`total_steps`), so the lr reaches
    ``optim.lr`` only at the last step or never and ``warmup_cosine`` never decays. ``batches`` is the run's
    ``hydratrain.data.streams.ShardedBatches``, at its restored position after a resume at step ``done`` (counted from
    there: before the load they were the fresh config's counts, wrong after a resume on another batch geometry)."""
    accum = trainer_cfg.grad_accum_steps
    if accum > batches.batches_per_epoch:
        log.warning("trainer.grad_accum_steps=%d makes every optimizer step %d micro-batches per rank: %.3g epochs "
                    "of the training data (%d micro-batches per rank an epoch at data.batch_size=%d); a "
                    "grad_accum_steps of at most %d keeps a step within an epoch", accum, accum,
                    accum / batches.batches_per_epoch, batches.batches_per_epoch, batches.batch_size,
                    batches.batches_per_epoch)
    if trainer_cfg.max_epochs is not None:
        left = batches.batches_left(trainer_cfg.max_epochs)
        epoch_steps, untrained = divmod(left, accum)
        which = f"its {left} micro-batches per rank" if not done else \
            f"the {left} micro-batches per rank left after the resumed step {done}"
        if untrained and (trainer_cfg.max_steps is None or trainer_cfg.max_steps >= done + epoch_steps):
            log.warning("trainer.max_epochs=%d leaves the run's last %d micro-batch(es) per rank (%d samples each "
                        "rank) untrained: %s fill %d optimizer steps of trainer.grad_accum_steps=%d; a "
                        "grad_accum_steps that divides %d trains them all", trainer_cfg.max_epochs, untrained,
                        untrained * batches.batch_size, which, epoch_steps, accum, left)
        epoch_steps += done
    if trainer_cfg.max_steps is not None and trainer_cfg.max_epochs is not None:
        if trainer_cfg.max_steps < epoch_steps:
            log.warning("trainer.max_steps=%d ends the run before trainer.max_epochs=%d would (at %d optimizer "
                        "steps): it stops after %.3g epochs; set trainer.max_steps=null to train every epoch",
                        trainer_cfg.max_steps, trainer_cfg.max_epochs, epoch_steps,
                        (trainer_cfg.max_epochs * batches.batches_per_epoch - left  # trained before the resume
                         + (trainer_cfg.max_steps - done) * accum) / batches.batches_per_epoch)
    warmup = scheduler_cfg.get("warmup_steps")  # (a schedule of one's own has its own keys)
    if warmup and warmup >= steps:
        reach = ("reaches optim.lr only at the last step" if warmup == steps
                 else f"never reaches optim.lr (it ends at {steps / warmup:.0%} of it)")
        decay = ", and warmup_cosine never decays" if str(scheduler_cfg.name) == "warmup_cosine" else ""
        log.warning("scheduler.warmup_steps=%d is not shorter than the %d optimizer steps this run takes "
                    "(trainer.max_steps / max_epochs): the lr %s%s", warmup, steps, reach, decay)
