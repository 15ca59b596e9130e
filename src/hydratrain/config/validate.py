"""Value and cross-field checks of a composed run config, before any process or process group exists.

:func:`validate` reads the config only (it never writes it) and raises :class:`~hydratrain.errors.ConfigError`
naming the first bad key, its value and what is allowed. It walks the checks in :data:`CHECKS`: the config's shape
(:mod:`~hydratrain.config.structure`), then each group's values beside that group's schema (``hydratrain.config.
<group>``: a check that relates two groups sits with the group whose key its error names), then those that import
or build a component (an optimizer or schedule of one's own, the model, the loss, the metrics, the callbacks), which
are here. Launchers call it on each job's config before starting workers. Checks that depend on the machine (is
there a GPU, NCCL, do the files exist) are in :func:`check_environment`.
"""
from __future__ import annotations

import inspect
import shutil
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch import nn

from hydratrain.components import (
    INIT_DEVICES,
    _accepts,
    _hints,
    build_loss,
    build_metrics,
    build_model,
    check_call,
    check_parameters,
    check_state_dict,
    checked_loss,
    forget_checked,
    keep_checked,
    locate,
    model_kwargs,
    model_settings,
    target_of,
)
from hydratrain.config import (
    checkpoint,
    data,
    launcher,
    logger,
    model,
    optim,
    paths,
    precision,
    scheduler,
    schema,
    strategy,
    structure,
    trainer,
    wrap_policy,
)
from hydratrain.config.launcher import launched_processes
from hydratrain.config.settings import LoraSettings, node_dict
from hydratrain.config.strategy import StrategyName
from hydratrain.config.values import NO_VALUE, check_ranges, select
from hydratrain.data.loader import check_data_node, is_dataset_node
from hydratrain.data.tokenized import preflight_data, vocab_size_for
from hydratrain.errors import ConfigError
from hydratrain.optim import LOWBIT_INSTALL, RUN_LENGTH_KEYWORDS, lowbit_available, own_keywords
from hydratrain.optim import is_own as own
from hydratrain.parallel import float8, lora
from hydratrain.parallel.fsdp import HSDP
from hydratrain.paths import Paths, resolve_path
from hydratrain.protocols import max_seq_len_of


def validate(cfg: DictConfig) -> None:
    """Check values that the schema's types cannot. Raises :class:`ConfigError` on the first bad key (an
    interpolation that does not resolve, first)."""
    for check in CHECKS:
        check(cfg)


def _check_ranges(cfg: DictConfig) -> None:
    """Each group's numeric keys (``RANGES`` beside its schema): every group's > 0 keys first, then >= 0, then
    > 0 or null."""
    check_ranges(cfg, (data.RANGES, optim.RANGES, scheduler.RANGES, trainer.RANGES, precision.RANGES, schema.RANGES,
                       strategy.RANGES, optim.ADAMW8BIT_RANGES, wrap_policy.RANGES, checkpoint.RANGES))


def _check_own_optimizer(cfg: DictConfig) -> None:
    """An ``optim`` node with ``_target_``: a ``torch.optim.Optimizer`` class that takes the node's keywords, and a
    peak ``lr``. Raises ConfigError naming the key."""
    node = cfg.optim
    if not own(node):
        return  # (a built-in optimizer: its values are hydratrain.config.optim's)
    target = str(node["_target_"])
    if node.get("lr") is None:
        raise ConfigError("optim.lr", NO_VALUE, f"optim._target_={target} needs its peak lr here (the schedule, "
                          "scheduler=, scales it from there): add optim.lr=VALUE")
    cls = locate(target, "optim")
    if not (inspect.isclass(cls) and issubclass(cls, torch.optim.Optimizer)):
        raise ConfigError("optim._target_", target, "is not a torch.optim.Optimizer class (torch.optim.SGD, or a "
                          "subclass of your own)")
    given = {**own_keywords(node), "lr": node.lr, **({"weight_decay": node.weight_decay}
                                                     if node.get("weight_decay") is not None else {})}
    check_call(cls, given, "optim", target, supplied=1)


def _check_own_scheduler(cfg: DictConfig) -> None:
    """A ``scheduler`` node with ``_target_``: an lr scheduler class (``torch.optim.lr_scheduler.*``) that takes the
    node's keywords after the optimizer. Raises ConfigError naming the key."""
    node = cfg.scheduler
    if not own(node):
        return
    target = str(node["_target_"])
    cls = locate(target, "scheduler")
    bases = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
    if not (inspect.isclass(cls) and issubclass(cls, bases)):
        raise ConfigError("scheduler._target_", target, "is not an lr scheduler class (torch.optim.lr_scheduler."
                          "OneCycleLR, ReduceLROnPlateau, ..., or a subclass of LRScheduler of your own)")
    given = {k: v for k, v in node_dict(node).items() if not k.startswith("_")}
    params = inspect.signature(cls).parameters
    given.update({k: 1 for k in RUN_LENGTH_KEYWORDS if k in params and k not in given})  # (the run fills them)
    check_call(cls, given, "scheduler", target, supplied=1)


def _check_block_classes(cfg: DictConfig) -> None:
    """``wrap_policy.block_classes``: each dotted path imports to an ``nn.Module`` class (a bare class name is
    matched against the model's classes once it is built). Raises ConfigError naming the key."""
    names = [str(n) for n in (select(cfg, "wrap_policy.block_classes") or ())]
    for name in names:
        if "." not in name:
            continue
        obj = locate(name, "", full_key="wrap_policy.block_classes", value=names)
        if not (isinstance(obj, type) and issubclass(obj, nn.Module)):
            raise ConfigError("wrap_policy.block_classes", names, f"{name!r} is not an nn.Module class (it is "
                              f"{type(obj).__name__ if not isinstance(obj, type) else 'the class ' + obj.__name__}); "
                              "name the class of the model's blocks, by dotted path or bare name")


def _check_monitors(cfg: DictConfig) -> None:
    """``trainer.objective``, ``checkpoint.monitor`` and ``trainer.early_stopping.monitor`` name a metric the
    evaluation logs: the loss's, the metrics', and their EMA twins with ``trainer.ema``."""
    perplexity = ["eval/perplexity"] if getattr(checked_loss(cfg), "perplexity", False) else []  # (next_token)
    allowed = ["eval/loss", *perplexity, *(f"eval/{name}" for name in (cfg.get("metrics") or {}))]
    ema = cfg.trainer.ema.decay is not None
    if ema:  # the EMA weights' evaluation logs the same names under eval_ema/ (hydratrain.train.ema)
        allowed += [f"eval_ema/{name.removeprefix('eval/')}" for name in allowed]
    monitors = {"trainer.objective": cfg.trainer.objective, "checkpoint.monitor": cfg.checkpoint.monitor,
                "trainer.early_stopping.monitor": cfg.trainer.early_stopping.monitor}
    for key, monitor in monitors.items():
        if monitor is not None and monitor not in allowed:
            why = " (perplexity is logged with a loss that reports it: loss=next_token)" if "perplexity" in monitor \
                else ""
            if str(monitor).startswith("eval_ema/") and not ema:
                why = " (eval_ema/* is logged with an EMA of the weights: set trainer.ema.decay, e.g. 0.999)"
            raise ConfigError(key, monitor, f"names no metric the evaluation logs; allowed: {', '.join(allowed)}{why}")


def _check_callbacks(cfg: DictConfig) -> None:
    """Each ``callbacks.<name>`` node names a class or function that takes its keywords
    (:mod:`hydratrain.train.extras` builds them)."""
    for name, node in (cfg.get("callbacks") or {}).items():
        key = f"callbacks.{name}"
        target = target_of(node, key)
        kwargs = {k: v for k, v in node_dict(node).items() if not k.startswith("_")}
        check_call(locate(target, key), kwargs, key, target)


def _vocabulary_for_checks(cfg: DictConfig, cls: Any) -> Optional[int]:
    """What a ``vocab_size: null`` keyword becomes for the checks before the run: the data's vocabulary where it is
    known without a tokenizer (256 for bytes and synthetic tokens), else a stand-in of its type (the run takes the
    tokenizer's); None when the keyword is not null. Raises :class:`ConfigError` naming ``model.vocab_size`` when
    the data builds datasets (no vocabulary to take) and ``cls`` does not take None."""
    if model_kwargs(cfg).get("vocab_size", 0) is not None:
        return None
    node = cfg.get("data")
    if not is_dataset_node(node):
        try:
            return vocab_size_for(node, None, None)
        except ConfigError:  # token_bin without a tokenizer: the run says so where it looks for the vocabulary
            return 256
    if "vocab_size" in _hints(cls) and _accepts(_hints(cls)["vocab_size"], None) is not None:
        raise ConfigError("model.vocab_size", None, f"null takes the data's vocabulary, but data._target_="
                          f"{node.get('_target_')} builds datasets, which have none (only token data does): set "
                          "model.vocab_size to the number of ids your data holds")
    return None


def check_components(cfg: DictConfig) -> None:
    """Every check of the components that needs no process group (see the module docstring): the model's target,
    keywords, types, hydratrain's model keys and the model's own checks (a build on the meta device, whose
    :class:`ConfigError` is raised; anything else it raises waits for the real build, which may not be on meta);
    the loss; each metric (built: torchmetrics checks its arguments then); a data factory's target and keywords.
    The meta model, the loss and the metrics it built are kept for the run's build in this process to take over
    (:func:`hydratrain.components.keep_checked`). Raises :class:`ConfigError`."""
    forget_checked()
    settings = model_settings(cfg)
    if str(settings.init_device) not in INIT_DEVICES:
        raise ConfigError("model.init_device", settings.init_device, f"allowed: {', '.join(INIT_DEVICES)}")
    target = target_of(cfg.get("model"), "model")
    cls = locate(target, "model")
    vocab = _vocabulary_for_checks(cfg, cls)
    check_call(cls, model_kwargs(cfg, vocab), "model", target)
    try:
        built = build_model(cfg, "meta", vocab)
    except ConfigError as err:
        if err.key != "model._target_":  # the model's own check, naming its key
            raise
        built = None
    if built is not None:
        check_parameters(built, target)
        check_state_dict(built, target, built_on_meta=True)
        adapters = LoraSettings.of(cfg)
        if adapters is not None:  # (peft's own refusal of the target modules, on a copy)
            lora.check(built, adapters)
    limit, seq_len = max_seq_len_of(built), cfg.data.get("seq_len") if cfg.get("data") else None
    if isinstance(limit, int) and isinstance(seq_len, int) and seq_len > limit:  # positions the model has weights for
        raise ConfigError("data.seq_len", seq_len, f"longer than the {limit} positions the model has "
                          f"({type(built).__name__}.max_seq_len); allowed: <= {limit}")
    loss, metrics = build_loss(cfg), build_metrics(cfg)
    # what was built to check it is what the run's build then uses, not built again in this process
    keep_checked(cfg, target, vocab, built, loss, metrics)
    node = cfg.get("data")
    if node is not None and OmegaConf.is_dict(node) and "_target_" in node:
        check_data_node(node)


#: every check :func:`validate` makes, in the order it makes them: a config with several bad keys gets the error of
#: the first (the order the checks had when they were one function, kept so the same input gets the same line)
CHECKS: tuple[Callable[[DictConfig], None], ...] = (
    structure.refuse_missing_components, structure.check_resolves, structure.check_int_ranges,
    structure.check_known_keys, structure.check_option_nodes, structure.refuse_removed_groups,
    data.check_batch_size, trainer.check_compile, strategy.check_shard_on_one_rank, _check_ranges, data.check,
    optim.check_param_groups, _check_own_scheduler, _check_own_optimizer, optim.check_betas, scheduler.check,
    trainer.check_run_length, wrap_policy.check, precision.check_fsdp_autocast, strategy.check_shard_size,
    precision.check_reduce_dtype, model.check_init_device, checkpoint.check_preempt_exit_code,
    paths.refuse_empty_paths, model.check_init_from, launcher.check, strategy.check_launched, schema.check_peft,
    check_components, _check_block_classes, _check_monitors,
    schema.check_mode, trainer.check_objective_at, checkpoint.check_save_top_k, trainer.check_ema,
    schema.check_callback_names, trainer.check_early_stopping, _check_callbacks, logger.check, trainer.check_profile,
)


def _check_lowbit(on_cpu: bool) -> None:
    """optim=adamw8bit needs torchao, and on CPU a C++ compiler for the update torchao compiles."""
    if not lowbit_available():
        raise ConfigError("optim.name", "adamw8bit", f"needs torchao, which is not installed ({LOWBIT_INSTALL}); "
                          "allowed here: adamw")
    if on_cpu and not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        raise ConfigError("optim.name", "adamw8bit", "torchao compiles its update with torch.compile, which on CPU "
                          "needs a C++ compiler (g++) on PATH; allowed here: adamw (or run on a GPU)")


def check_environment(cfg: DictConfig, world_size: int, launch_dir: Path,
                      local_world_size: Optional[int] = None) -> None:
    """Checks that depend on this machine and launch: the device, the backend, the world size, input paths.

    ``world_size`` and ``local_world_size`` (ranks on this node; default: all of them) come from the launch
    environment (``hydratrain.dist.env``); relative paths resolve against ``launch_dir`` (see
    :func:`hydratrain.paths.resolve_path`). Raises :class:`ConfigError`.
    """
    cuda = torch.cuda.is_available()
    if "cuda" in (cfg.device, select(cfg, "model.init_device")) and not cuda:
        key = "device" if cfg.device == "cuda" else "model.init_device"
        raise ConfigError(key, "cuda", "torch sees no CUDA device here; allowed: auto, cpu" +
                          (", meta" if key != "device" else ""))
    backend: Optional[str] = cfg.strategy.get("backend")
    if backend == "nccl":
        if not (dist.is_available() and dist.is_nccl_available()):
            raise ConfigError("strategy.backend", "nccl", "this torch has no NCCL; allowed here: gloo (or null)")
        if cfg.device == "cpu" or not cuda:
            raise ConfigError("strategy.backend", "nccl", "NCCL needs CUDA tensors and this run's device is the "
                              "CPU; allowed: gloo (or null)")
    if cfg.strategy.name == StrategyName.single and world_size > 1:
        raise ConfigError("strategy.name", "single", f"runs one process but WORLD_SIZE={world_size}; "
                          "allowed under torchrun: ddp, fsdp, hsdp")
    name = cfg.launcher.get("name")
    if name not in (None, "local") and launched_processes(cfg.launcher) != world_size:
        key = next(f"launcher.{k}" for k in ("nproc_per_node", "tasks_per_node", "num_workers", "name")
                   if k in cfg.launcher)
        raise ConfigError(key, cfg.launcher.get(key.split(".", 1)[1]),
                          f"this job's config says launcher={name} starts {launched_processes(cfg.launcher)} "
                          f"rank(s), but it runs on {world_size}: its launcher was set up from other values (submitit "
                          "makes one executor per sweep, so a swept group or experiment cannot change it); run one "
                          "sweep per value")
    if select(cfg, "optim.name") == "adamw8bit":
        _check_lowbit(cfg.device == "cpu" or (cfg.device == "auto" and not cuda))
    float8.check(str(cfg.precision.name), bool(select(cfg, "precision.fp8_emulate")),
                 "cuda" if cfg.device != "cpu" and cuda else "cpu")
    if cfg.strategy.name == StrategyName.hsdp:
        HSDP.mesh_shape(cfg.strategy.shard_size, world_size, local_world_size or world_size)

    dirs = Paths.resolve(cfg, launch_dir)
    if "name" in cfg.data:
        preflight_data(cfg.data, dirs.data)  # token files, the tokenizer, tokenized_text's globs
    for key, base, what in (("model.init_from", dirs.model, "paths.model_dir"),
                            ("checkpoint.resume_from", launch_dir, "the launch dir")):
        value = select(cfg, key)
        if value and not resolve_path(value, base).exists():
            where = (f"looked for {resolve_path(value, base)}" if Path(value).expanduser().is_absolute()
                     else f"relative paths resolve against {what} {base}")
            raise ConfigError(key, value, f"no such path ({where})")
