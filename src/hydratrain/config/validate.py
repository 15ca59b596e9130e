"""Value and cross-field checks of a composed run config, before any process or process group exists.

:func:`validate` reads the config only (it never writes it) and raises :class:`~hydratrain.errors.ConfigError`
naming the first bad key, its value and what is allowed. It imports nothing heavy, so launchers can call it on each
job's config before starting workers. Checks that depend on the machine (is there a GPU, NCCL, do the files exist)
are in :func:`check_environment`.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import math
import re
import urllib.parse
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
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
from hydratrain.config.launcher import launched_processes, missing_slurm_commands, validate_launcher  # noqa: F401
from hydratrain.config.schema import (
    DATASET_ONLY_KEYS,
    LOADER_KEYS,
    MODEL_KEYS,
    SCHEMAS,
    DType,
    LoaderKeys,
    StrategyName,
    WrapPolicyName,
)
from hydratrain.config.settings import LoraSettings, node_dict
from hydratrain.config.values import (  # noqa: F401 (their home was here)
    COMPILE_VALUES,
    SHARD_ON_ONE_RANK_VALUES,
    _choice,
    compile_setting,
    shard_on_one_rank_setting,
    unresolvable,
)
from hydratrain.data.corpora import expand_paths
from hydratrain.data.loader import check_data_node, is_dataset_node
from hydratrain.data.tokenized import preflight_data, vocab_size_for
from hydratrain.errors import RESERVED_EXIT_CODES, ConfigError, Placeholder
from hydratrain.optim import LOWBIT_INSTALL, RUN_LENGTH_KEYWORDS, lowbit_available, own_keywords
from hydratrain.optim import is_own as own
from hydratrain.parallel import lora
from hydratrain.parallel.strategy import HSDP
from hydratrain.paths import Paths, resolve_path
from hydratrain.protocols import max_seq_len_of

BYTE_LEVEL_DATA = ("python_stdlib", "text_files")
GROUPS_WITH_OPTIONS = ("data", "strategy", "precision", "wrap_policy", "launcher", "optim", "scheduler", "paths")


def batch_size_setting(value: Any) -> Any:
    """``data.batch_size``: a positive int, or ``auto`` (the largest micro-batch the memory planner says fits:
    :mod:`hydratrain.batch_size`). Raises :class:`ConfigError` otherwise."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError("data.batch_size", value, "allowed: a positive integer (samples per micro-batch per "
                          "rank), or auto (the largest the memory planner says fits)")
    return value


def _get(cfg: DictConfig, key: str) -> Any:
    return OmegaConf.select(cfg, key, throw_on_missing=False)


def _check_option_nodes(cfg: DictConfig) -> None:
    """``<group>.name`` must be the option its node was composed for (``strategy.name=ddp`` on the fsdp node would
    keep fsdp's keys under ddp's name): choose options with ``<group>=<option>``."""
    for group in GROUPS_WITH_OPTIONS:
        node = cfg.get(group)
        if node is None or (group in ("data", "optim", "scheduler") and OmegaConf.is_dict(node) and "_target_" in node):
            continue  # (a dataset, an optimizer or a schedule of one's own: checked with the components)
        if not dataclasses.is_dataclass(OmegaConf.get_type(node)):
            if not dataclasses.is_dataclass(OmegaConf.get_type(cfg)) and "trainer" in cfg and \
                    not dataclasses.is_dataclass(OmegaConf.get_type(cfg.trainer)):  # no node is typed
                raise ConfigError("--config-name", _ANOTHER_CONFIG, "not conf/train.yaml on its typed schema (a "
                                  "run's saved .hydra/config.yaml?): to run a past run again, give train.py its "
                                  "overrides (and the --config-dir it used, if any): python train.py $(sed 's/^- //' "
                                  "RUN/.hydra/overrides.yaml); to continue it: checkpoint.resume_from=RUN")
            _refuse_an_untyped_option(group, node)
        option = getattr(OmegaConf.get_type(node), "option", None)
        if option is not None and node.name != option:
            raise ConfigError(f"{group}.name", node.name, f"the {group} node was composed as {option}; pick an "
                              f"option with {group}={node.name}, not by renaming it")


def _refuse_an_untyped_option(group: str, node: DictConfig) -> None:
    """A group node that no option schema types: a user's own option file without its schema line (which must not
    be reported as removed with ``~group``), or ``~group`` and then an overlay's keys."""
    schemas = list(SCHEMAS[group])
    name = node.get("name") if not OmegaConf.is_missing(node, "name") else None
    if name is None:  # (a user's option file with neither its schema line nor a name lands here too)
        raise ConfigError(group, _NO_VALUE, f"has no option (removed with ~{group}, or a file of your own without "
                          f"its schema line?): choose one with {group}=NAME (conf/{group}/); an option file of your "
                          f"own begins with 'defaults: [/schema/{group}/SCHEMA@_here_, _self_]' and name: SCHEMA "
                          f"(schemas: {', '.join(schemas)})")
    schema = name if name in schemas else "SCHEMA"
    raise ConfigError(f"{group}.name", name, f"the {group} option is on no schema: begin its file with 'defaults: "
                      f"[/schema/{group}/{schema}@_here_, _self_]' (as conf/{group}/ does; schemas: "
                      f"{', '.join(schemas)})")


#: the groups of conf/train.yaml's defaults list (a test keeps the two alike): the run reads every one
DEFAULT_GROUPS = ("model", "data", "loss", "strategy", "precision", "wrap_policy", "launcher", "optim", "scheduler",
                  "paths", "trainer", "logger", "checkpoint", "distributed", "plan")
#: how to turn off what a group does, for the message on ``~group``
_OFF_SWITCHES = {"checkpoint": "checkpoint.every_n_steps=0 saves no periodic checkpoints (and "
                               "checkpoint.save_on_sigterm=false none at all)",
                 "logger": "logger.tensorboard=false writes no TensorBoard events",
                 "plan": "plan.enabled=false makes no memory plan",
                 "launcher": "launcher=local runs in this process"}


def _refuse_removed_groups(cfg: DictConfig) -> None:
    """``~group`` (Hydra's removal from the defaults list) of a group the run reads: where the group's schema has a
    default for every key (``~checkpoint``, ``~logger``, ``~trainer``), the schema's defaults took the option's place
    and the run went on as if nothing had been removed (``~checkpoint ~logger`` to save disk in a sweep would still
    write checkpoints and events). Reads Hydra's ``runtime.choices`` (the config's own ``hydra`` node, or the
    running app's); without either, checks nothing. Raises :class:`ConfigError` naming the group and, where there is
    one, the key that turns its work off."""
    if "hydra" in cfg:
        hydra = OmegaConf.select(cfg, "hydra", default=None)
    else:
        from hydra.core.hydra_config import HydraConfig

        hydra = HydraConfig.get() if HydraConfig.initialized() else None
    choices = OmegaConf.select(hydra, "runtime.choices", default=None) if hydra is not None else None
    if not choices:
        return
    # a list of options (logger=[tensorboard,mlflow]) leaves the group out of the choices as ~group does
    lists = {o.split("=", 1)[0] for o in OmegaConf.select(hydra, "overrides.task", default=None) or ()
             if re.match(r"[\w/]+=\[", o)}
    for group in DEFAULT_GROUPS:
        removed = choices.get(group) is None and group not in lists
        if removed and not _a_target_node_in_its_place(cfg, group):
            off = f"; to turn it off: {_OFF_SWITCHES[group]}" if group in _OFF_SWITCHES else ""
            raise ConfigError(group, _DELETED, f"removed with ~{group}, but the run reads every key of it (the "
                              f"schema's defaults would take the option's place): choose an option with "
                              f"{group}=NAME (conf/{group}/){off}")


def _a_target_node_in_its_place(cfg: DictConfig, group: str) -> bool:
    """``override /<group>: null`` in an experiment that then writes the group's node with ``_target_`` (a model,
    data or loss of one's own inline): the node took the option's place, nothing was removed."""
    node = OmegaConf.select(cfg, group, default=None)
    return isinstance(node, DictConfig) and "_target_" in node


_DELETED, _NO_VALUE, _ANOTHER_CONFIG = Placeholder("<deleted>"), Placeholder("???"), Placeholder("<another config>")


def _check_known_keys(node: DictConfig, path: str = "") -> None:
    """Every key of a schema-typed node is a field of its dataclass. Hydra's ``+key=value`` (which its own error for
    an unknown key suggests) appends a key to a structured node: nothing reads it, so it is an error here rather than
    a run that silently ignores it. Nodes typed as plain dicts (e.g. ``launcher.resources_per_worker``) take any key.
    """
    schema = OmegaConf.get_type(node)
    if not dataclasses.is_dataclass(schema):
        return
    fields = [f.name for f in dataclasses.fields(schema)]
    present = set(node.keys())  # (``in node`` is also False for a key whose value is missing, ???)
    for f in dataclasses.fields(schema):
        if f.name not in present:  # deleted with Hydra's ~key: nothing in the run may read a key that is not there
            where = f"{path}.{f.name}" if path else f.name
            default = "VALUE" if f.default is dataclasses.MISSING else OmegaConf.to_yaml({"v": f.default}).strip()[3:]
            raise ConfigError(where, _DELETED, f"removed with ~{where}, but the run reads it: give it a value instead, "
                                               f"e.g. its default: {where}={default}")
    for key in node.keys():
        where = f"{path}.{key}" if path else str(key)  # type: ignore[str-bytes-safe]  # (a config's keys are str)
        if where == "hydra":  # Hydra's own node, present when a launcher checks a job's config
            continue
        if key not in fields:
            option = getattr(schema, "option", None)
            owner = f"{path}={option}" if option is not None else (path or "the run config")
            raise ConfigError(where, node._get_node(key)._value(),  # type: ignore[union-attr]  # (key is present)
                              f"not a key of {owner} (nothing would read it); "
                              f"allowed: {', '.join(fields)}")
        if OmegaConf.is_missing(node, key):  # ??? in a preset (data=text_files without data.paths), or ~group
            why = (f"has no value: choose an option with {path}=NAME (conf/{path}/)" if key == "name" and path
                   else f"has no value: give it one ({where}=VALUE)")
            raise ConfigError(where, _NO_VALUE, why)
        child = node._get_node(key)
        if isinstance(child, (DictConfig, ListConfig)) and not child._is_none() and not child._is_missing():
            _check_entries(child, where)
            if isinstance(child, DictConfig):
                _check_known_keys(child, where)


def _check_entries(node: DictConfig | ListConfig, where: str) -> None:
    """The entries of a typed container (``List[str]`` like ``data.paths``, ``Dict[str, float]`` like
    ``launcher.resources_per_worker``) are values of its element type. OmegaConf converts and checks scalar entries but
    lets a nested list or dict through (``data.paths=[[notes/*.md]]``), which then failed deep in the start-up with a
    ``TypeError`` traceback."""
    etype = node._metadata.element_type
    if etype not in (str, int, float, bool):
        return
    for index in range(len(node)) if isinstance(node, ListConfig) else node.keys():
        entry = node._get_node(index)  # type: ignore[arg-type]  # (an int for a ListConfig, a key for a DictConfig)
        if isinstance(entry, (DictConfig, ListConfig)):
            kind = "list" if isinstance(entry, ListConfig) else "dict"
            raise ConfigError(where, OmegaConf.to_container(node, resolve=False),
                              f"each entry must be a {etype.__name__}; entry {index!r} is a {kind}")


def _check_resolves(cfg: DictConfig) -> None:
    """Every interpolation resolves (``${oc.env:VAR}`` of an unset variable, ``${a.key}`` that does not exist): a
    :class:`ConfigError` naming the key and its unresolved text, not OmegaConf's traceback from the first read."""
    try:
        for name in cfg:  # not Hydra's own node (its run dir resolver reserves a dir)
            if name != "hydra":
                node = cfg[name]
                if OmegaConf.is_config(node):
                    OmegaConf.to_container(node, resolve=True)
    except OmegaConfBaseException as err:
        key = str(getattr(err, "full_key", "") or "")
        raw: Any = OmegaConf.to_container(cfg, resolve=False)
        for part in re.findall(r"[^.\[\]]+", key):  # data.paths[0]: a list's entry too (not None)
            if isinstance(raw, dict):
                raw = raw.get(part)
            else:
                raw = raw[int(part)] if isinstance(raw, list) and part.isdigit() and int(part) < len(raw) else None
        raise unresolvable(key or "<config>", raw, err) from None


PATH_KEYS = ("checkpoint.resume_from", "model.init_from", "data.tokenizer", "data.train_path", "data.val_path",
             "data.cache_dir", "paths.root", "paths.data_dir", "paths.output_dir", "paths.cache_dir", "paths.model_dir")
REQUIRED_PATH_KEYS = ("data.train_path", "data.val_path")


def _refuse_empty_paths(cfg: DictConfig) -> None:
    """An empty string is no path: ``checkpoint.resume_from=$CKPT`` with CKPT unset trained from scratch and
    ``data.tokenizer=$TOK`` trained a new BPE, both without a word, because '' read as "not set"."""
    for key in PATH_KEYS:
        value = _get(cfg, key)
        if isinstance(value, str) and not value.strip():
            none = ("" if key in REQUIRED_PATH_KEYS else ", or '.' for the launch dir" if key.startswith("paths.")
                    else ", or null for none")
            raise ConfigError(key, value, f"empty (from an unset shell variable, as in {key}=$VAR?): give a path"
                              f"{none}")
    for entry in _get(cfg, "data.paths") or ():
        if isinstance(entry, str) and not entry.strip():
            raise ConfigError("data.paths", list(cfg.data.paths), "holds an empty entry (from an unset shell "
                              "variable?): give files or globs")


def _refuse_missing_components(cfg: DictConfig) -> None:
    """A component group with no node (``~model``, or a config composed without it): one line naming the group."""
    owned = {"model": MODEL_KEYS, "data": LOADER_KEYS, "loss": ()}  # (in every such node: no option of its own)
    for group in ("model", "loss", "data"):
        node = cfg._get_node(group, throw_on_missing_key=False) if isinstance(cfg, DictConfig) else None
        if node is not None and (node._is_missing() or isinstance(node, DictConfig) and not node._is_none()
                                 and set(node.keys()) <= set(owned[group])):
            raise ConfigError(group, _NO_VALUE, f"has no option: choose one with {group}=NAME (conf/{group}/), or "
                              f"give a file of your own with _target_ in a --config-dir (docs/own-model.md)")


def _check_int_ranges(node: Any, path: str = "") -> None:
    """Every integer in the config fits torch's int64, in typed and untyped nodes alike (a component's keyword
    arguments too): a value past it was a traceback deep in the run (``torch.manual_seed``, a tensor's size)."""
    if isinstance(node, DictConfig):
        items: list[tuple[Any, Any]] = [(k, node._get_node(k)) for k in node.keys()
                                        if not (path == "" and k == "hydra")]
    elif isinstance(node, ListConfig):
        items = [(i, node._get_node(i)) for i in range(len(node))]
    else:
        return
    for key, child in items:
        where = f"{path}.{key}" if path and isinstance(key, str) else f"{path}[{key}]" if path else str(key)
        if isinstance(child, (DictConfig, ListConfig)):
            if not child._is_none() and not child._is_missing():
                _check_int_ranges(child, where)
            continue
        if child._is_missing():
            continue
        value = node[key]
        if isinstance(value, int) and not isinstance(value, bool) and not -2**63 <= value < 2**63:
            raise ConfigError(where, value, "out of range: integer keys take values that fit torch's int64 "
                              "(|value| < 2**63)")


def is_own(node: Any) -> bool:
    return own(node)


def _refuse_loader_keys_on_a_corpus(data: Any) -> None:
    """A built-in corpus has the DataLoader's keys (every data option has them, :class:`~hydratrain.config.schema.
    LoaderKeys`) but batches memory-mapped tokens in the training process: a value other than the default would be
    ignored, so it is refused (and ``val_fraction`` of ``token_bin``, whose val split is ``data.val_path``)."""
    if not OmegaConf.is_dict(data) or "_target_" in data or data.get("name") is None:
        return
    name = data.name
    unused = DATASET_ONLY_KEYS + (("val_fraction",) if str(name) == "token_bin" else ())
    for key in unused:
        if key in data and data[key] != getattr(LoaderKeys, key):
            raise ConfigError(f"data.{key}", data[key], f"not used by data={name}, which slices memory-mapped tokens "
                              f"in the training process; allowed: {getattr(LoaderKeys, key)} (the DataLoader's keys "
                              "apply to a dataset node, _target_: docs/own-model.md)"
                              if key != "val_fraction" else "not used by data=token_bin, whose val split is "
                              "data.val_path; allowed: leave it out")


def validate(cfg: DictConfig) -> None:
    """Check values that the schema's types cannot. Raises :class:`ConfigError` on the first bad key (an
    interpolation that does not resolve, first)."""
    _refuse_missing_components(cfg)
    _check_resolves(cfg)
    _check_int_ranges(cfg)
    _check_known_keys(cfg)
    _check_option_nodes(cfg)
    _refuse_removed_groups(cfg)

    def positive(key: str, allow_zero: bool = False, allow_none: bool = False) -> None:
        value = _get(cfg, key)
        if value is None and allow_none:
            return
        if value is None or not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
            raise ConfigError(key, value, "must be finite and " + (">= 0" if allow_zero else "> 0"))

    if OmegaConf.select(cfg, "data.batch_size", default="<absent>") != "<absent>":
        batch_size_setting(cfg.data.batch_size)
    compile_setting(cfg.trainer.compile)
    if OmegaConf.select(cfg, "strategy.shard_on_one_rank", default="<absent>") != "<absent>":
        shard_on_one_rank_setting(cfg.strategy.shard_on_one_rank)
    for key in ("data.seq_len", "data.synthetic_tokens",
                "optim.lr", "optim.eps", "trainer.grad_accum_steps", "trainer.log_every_n_steps",
                "trainer.max_consecutive_nonfinite", "precision.init_scale", "precision.growth_interval",
                "distributed.failure_timeout_s", "distributed.collective_timeout_s", "strategy.bucket_cap_mb",
                "optim.block_size",
                "wrap_policy.min_num_params"):
        if OmegaConf.select(cfg, key, default="<absent>") != "<absent>":
            positive(key)
    for key in ("optim.weight_decay", "scheduler.warmup_steps", "trainer.grad_clip", "trainer.eval_every_n_steps",
                "trainer.eval_samples", "trainer.sample_tokens", "checkpoint.every_n_steps", "checkpoint.keep_last"):
        positive(key, allow_zero=True, allow_none=key == "optim.weight_decay" and is_own(cfg.optim)
                 or key == "scheduler.warmup_steps" and is_own(cfg.scheduler))
    for key in ("trainer.max_steps", "trainer.max_epochs", "logger.peak_flops", "plan.memory_gb", "plan.world_size",
                "plan.ranks_per_node"):
        positive(key, allow_none=True)

    # conventions on the model's keywords, whatever the model: a context length and a vocabulary
    max_seq_len, vocab_size, seq_len = _get(cfg, "model.max_seq_len"), _get(cfg, "model.vocab_size"), \
        _get(cfg, "data.seq_len")
    if _number(max_seq_len) and _number(seq_len) and seq_len > max_seq_len:
        raise ConfigError("data.seq_len", seq_len, f"must be <= model.max_seq_len={max_seq_len}")
    if _get(cfg, "data.name") in BYTE_LEVEL_DATA and _number(vocab_size) and vocab_size < 256:
        raise ConfigError("model.vocab_size", vocab_size, f"byte-level data={cfg.data.name} needs >= 256")
    if "paths" in cfg.data and not cfg.data.paths:
        raise ConfigError("data.paths", list(cfg.data.paths), f"data={cfg.data.name} needs at least one file or glob")
    val_fraction = _get(cfg, "data.val_fraction")
    if val_fraction is not None and not 0.0 < val_fraction < 1.0:
        raise ConfigError("data.val_fraction", val_fraction, "must be in (0, 1)")
    _refuse_loader_keys_on_a_corpus(cfg.data)
    if _get(cfg, "data.vocab_size") is not None and cfg.data.vocab_size < 257:
        raise ConfigError("data.vocab_size", cfg.data.vocab_size, "a byte-level BPE needs more than the 256 byte "
                          "tokens; allowed: >= 257")
    if _get(cfg, "data.vocab_size") is not None and _get(cfg, "data.tokenizer"):
        raise ConfigError("data.vocab_size", cfg.data.vocab_size, f"unused with data.tokenizer={cfg.data.tokenizer}, "
                          "whose own vocabulary the run takes (a BPE of data.vocab_size is trained only when "
                          "data.tokenizer is null); drop one of the two (model.vocab_size sets a larger embedding)")
    _check_param_groups(cfg.optim)
    if is_own(cfg.scheduler):
        _check_own_scheduler(cfg.scheduler)
    if is_own(cfg.optim):
        _check_own_optimizer(cfg.optim)
    elif not 0.0 <= cfg.optim.beta1 < 1.0 or not 0.0 <= cfg.optim.beta2 < 1.0:
        raise ConfigError("optim.beta1/beta2", (cfg.optim.beta1, cfg.optim.beta2), "must be in [0, 1)")
    ratio = _get(cfg, "scheduler.min_lr_ratio")
    if ratio is not None and not 0.0 <= ratio <= 1.0:
        raise ConfigError("scheduler.min_lr_ratio", ratio, "must be in [0, 1]")
    if cfg.trainer.max_steps is None and cfg.trainer.max_epochs is None:
        raise ConfigError("trainer.max_steps", None, "set trainer.max_steps and/or trainer.max_epochs")

    strategy = cfg.strategy.name
    sharded = (StrategyName.fsdp, StrategyName.hsdp)
    if cfg.wrap_policy.name not in (WrapPolicyName.auto, WrapPolicyName.none) and strategy not in sharded:
        raise ConfigError("wrap_policy", cfg.wrap_policy.name, f"only strategy=fsdp or hsdp shards modules by a wrap "
                          f"policy (this run: strategy={strategy}); allowed here: auto, none")
    if _get(cfg, "precision.fsdp_autocast") and strategy not in sharded:
        raise ConfigError("precision.fsdp_autocast", True, f"unused with strategy={strategy}, whose forward runs "
                          "under autocast already; allowed with strategy=fsdp or hsdp")
    shard_size = _get(cfg, "strategy.shard_size")
    if shard_size is not None and shard_size < 1:
        raise ConfigError("strategy.shard_size", shard_size, "must be >= 1 (ranks per shard group), or null for "
                          "the ranks per node")
    if strategy == StrategyName.single and cfg.precision.reduce_dtype != DType.float32:
        raise ConfigError("precision.reduce_dtype", cfg.precision.reduce_dtype, "strategy=single reduces no "
                          "gradients across ranks; allowed: float32")

    settings = model_settings(cfg)
    if settings.init_device == "cuda" and cfg.device == "cpu":
        raise ConfigError("model.init_device", "cuda", "the run's device is cpu; allowed: auto, meta, cpu")
    code = cfg.checkpoint.preempt_exit_code
    if not 0 < code < 126 or code in RESERVED_EXIT_CODES:
        raise ConfigError("checkpoint.preempt_exit_code", code, f"must be in {max(RESERVED_EXIT_CODES) + 1}..125 "
                          f"({', '.join(map(str, RESERVED_EXIT_CODES))} are hydratrain's own exit statuses, 126+ "
                          "the shell's)")
    _refuse_empty_paths(cfg)
    init_from = settings.init_from
    if init_from is not None and not str(init_from).endswith(".safetensors"):
        raise ConfigError("model.init_from", init_from, "must be a .safetensors file (python -m hydratrain.export "
                          "CHECKPOINT_DIR OUT.safetensors makes one)")
    validate_launcher(cfg.launcher)
    launched = launched_processes(cfg.launcher)
    if shard_size is not None and launched > 1 and launched % shard_size:
        raise ConfigError("strategy.shard_size", shard_size, f"must divide the {launched} ranks launcher="
                          f"{cfg.launcher.name} starts; allowed: "
                          f"{', '.join(str(d) for d in range(1, launched + 1) if launched % d == 0)}")
    if strategy == StrategyName.single and launched > 1:
        raise ConfigError("strategy.name", "single", f"runs one process but launcher={cfg.launcher.name} starts "
                          f"{launched}; allowed: ddp, fsdp, hsdp")
    if cfg.get("peft") is not None:
        if settings.init_from is not None:  # (its file holds the base's names; the run trains peft's)
            raise ConfigError("model.init_from", settings.init_from, "is not read under +peft=lora: the base comes "
                              "from model.pretrained (a save_pretrained dir, as the run's export/ is)")
        positive("peft.r")
        positive("peft.alpha")
        if not 0 <= float(cfg.peft.dropout) < 1:
            raise ConfigError("peft.dropout", cfg.peft.dropout, "must be >= 0 and < 1")
    check_components(cfg)
    _check_block_classes(cfg)
    objective = cfg.trainer.objective

    perplexity = ["eval/perplexity"] if getattr(checked_loss(cfg), "perplexity", False) else []  # (next_token)
    allowed = ["eval/loss", *perplexity, *(f"eval/{name}" for name in (cfg.get("metrics") or {}))]
    ema = cfg.trainer.ema.decay is not None
    if ema:  # the EMA weights' evaluation logs the same names under eval_ema/ (hydratrain.train.ema)
        allowed += [f"eval_ema/{name.removeprefix('eval/')}" for name in allowed]
    monitors = {"trainer.objective": objective, "checkpoint.monitor": cfg.checkpoint.monitor,
                "trainer.early_stopping.monitor": cfg.trainer.early_stopping.monitor}
    for key, monitor in monitors.items():
        if monitor is not None and monitor not in allowed:
            why = " (perplexity is logged with a loss that reports it: loss=next_token)" if "perplexity" in monitor \
                else ""
            if str(monitor).startswith("eval_ema/") and not ema:
                why = " (eval_ema/* is logged with an EMA of the weights: set trainer.ema.decay, e.g. 0.999)"
            raise ConfigError(key, monitor, f"names no metric the evaluation logs; allowed: {', '.join(allowed)}{why}")
    _check_loop_extras(cfg)
    _check_trackers(cfg.logger)
    _check_profile(cfg)


#: tracker -> (the module it needs, the extra that installs it)
_TRACKER_EXTRAS = {"mlflow": ("mlflow", "mlflow"), "wandb": ("wandb", "wandb")}


def _check_trackers(logger: DictConfig) -> None:
    """A chosen tracker's library is installed (looked up, not imported: it loads only in the run that uses it), and
    no password stands in ``logger.mlflow.tracking_uri``, which Hydra writes to ``.hydra/`` with the rest of the
    config (MLflow takes it from $MLFLOW_TRACKING_PASSWORD instead)."""
    for name, (module, extra) in _TRACKER_EXTRAS.items():
        if logger[name].enabled and importlib.util.find_spec(module) is None:
            raise ConfigError("logger", name, f"needs the {module} package: pip install 'hydratrain[{extra}]' "
                              f"(or drop {name} from logger=[...])")
    uri = logger.mlflow.tracking_uri
    if uri and urllib.parse.urlsplit(uri).password is not None:
        raise ConfigError("logger.mlflow.tracking_uri", "<a URI with a password>", "would be written to the run "
                          "dir's .hydra/config.yaml: give the password in $MLFLOW_TRACKING_PASSWORD (and the user in "
                          "$MLFLOW_TRACKING_USERNAME), or the whole URI in $MLFLOW_TRACKING_URI")


def _check_profile(cfg: DictConfig) -> None:
    """``trainer.profile.steps``: two steps ``[first, last]``, ``1 <= first <= last <= trainer.max_steps``
    (:mod:`hydratrain.train.profiler`)."""
    steps = cfg.trainer.profile.steps
    if steps is None:
        return
    steps, max_steps = list(steps), cfg.trainer.max_steps
    if len(steps) != 2 or not 1 <= steps[0] <= steps[1] or (max_steps is not None and steps[1] > max_steps):
        raise ConfigError("trainer.profile.steps", steps, "must be [first, last] optimizer steps with 1 <= first <= "
                          f"last <= trainer.max_steps={max_steps}, e.g. [10, 12] (null: no trace)")
    if "profiler" in (cfg.get("callbacks") or {}):
        raise ConfigError("callbacks.profiler._target_", cfg.callbacks.profiler.get("_target_"), "callbacks.profiler "
                          "is the name of trainer.profile's own callback (trainer.profile.steps is set): give yours "
                          "another name")


def _check_loop_extras(cfg: DictConfig) -> None:
    """The best checkpoints, early stopping, the EMA of the weights and the callbacks' nodes
    (:mod:`hydratrain.train.extras`)."""
    if str(cfg.mode) == "eval" and not cfg.checkpoint.resume_from and cfg.model.get("init_from") is None:
        raise ConfigError("mode", "eval", "evaluates trained weights: give checkpoint.resume_from=<a run dir, a "
                          "checkpoints dir or a step_XXXXXXXX dir> or model.init_from=<a .safetensors file>")
    if str(cfg.trainer.objective_at) == "best" and cfg.checkpoint.monitor is None:
        raise ConfigError("trainer.objective_at", "best", "needs checkpoint.monitor (and checkpoint.mode) to tell "
                          "which evaluation is best; allowed without it: last")
    if cfg.checkpoint.save_top_k < 1:
        raise ConfigError("checkpoint.save_top_k", cfg.checkpoint.save_top_k, "must be >= 1 (checkpoint.monitor=null "
                          "keeps no best checkpoints)")
    ema = cfg.trainer.ema
    if ema.decay is not None and not (math.isfinite(ema.decay) and 0 < ema.decay < 1):
        raise ConfigError("trainer.ema.decay", ema.decay, "must be in (0, 1), e.g. 0.999 (null: no EMA)")
    if ema.warmup_steps < 0:
        raise ConfigError("trainer.ema.warmup_steps", ema.warmup_steps, "must be >= 0 (steps)")
    if ema.decay is not None and "ema" in (cfg.get("callbacks") or {}):
        raise ConfigError("callbacks.ema._target_", cfg.callbacks.ema.get("_target_"), "callbacks.ema is the name of "
                          "trainer.ema's own callback (trainer.ema.decay is set): give yours another name")
    stop = cfg.trainer.early_stopping
    if stop.patience < 1:
        raise ConfigError("trainer.early_stopping.patience", stop.patience, "must be >= 1 (evaluations)")
    if not math.isfinite(stop.min_delta) or stop.min_delta < 0:
        raise ConfigError("trainer.early_stopping.min_delta", stop.min_delta, "must be finite and >= 0")
    if stop.monitor is not None and not cfg.trainer.eval_every_n_steps:
        raise ConfigError("trainer.early_stopping.monitor", stop.monitor, "needs evaluations during training: set "
                          "trainer.eval_every_n_steps > 0")
    for name, node in (cfg.get("callbacks") or {}).items():
        key = f"callbacks.{name}"
        target = target_of(node, key)
        kwargs = {k: v for k, v in node_dict(node).items() if not k.startswith("_")}
        check_call(locate(target, key), kwargs, key, target)


def _check_own_optimizer(node: DictConfig) -> None:
    """An ``optim`` node with ``_target_``: a ``torch.optim.Optimizer`` class that takes the node's keywords, and a
    peak ``lr``. Raises ConfigError naming the key."""
    target = str(node["_target_"])
    if node.get("lr") is None:
        raise ConfigError("optim.lr", _NO_VALUE, f"optim._target_={target} needs its peak lr here (the schedule, "
                          "scheduler=, scales it from there): add optim.lr=VALUE")
    cls = locate(target, "optim")
    if not (inspect.isclass(cls) and issubclass(cls, torch.optim.Optimizer)):
        raise ConfigError("optim._target_", target, "is not a torch.optim.Optimizer class (torch.optim.SGD, or a "
                          "subclass of your own)")
    given = {**own_keywords(node), "lr": node.lr, **({"weight_decay": node.weight_decay}
                                                     if node.get("weight_decay") is not None else {})}
    check_call(cls, given, "optim", target, supplied=1)


def _check_param_groups(node: DictConfig) -> None:
    """``optim.param_groups``: a list of ``{match: glob, lr_scale: > 0, weight_decay: >= 0}`` (whether each glob
    matches a parameter is known once the model is built). Raises ConfigError naming the entry's key."""
    entries = node.get("param_groups") or []
    if not isinstance(entries, (list, ListConfig)):
        raise ConfigError("optim.param_groups", entries, "must be a list of {match, lr_scale, weight_decay}")
    for i, entry in enumerate(entries):
        key = f"optim.param_groups[{i}]"
        if not OmegaConf.is_dict(entry) or not isinstance(entry.get("match"), str) or not entry.match:
            raise ConfigError(f"{key}.match", entry.get("match") if OmegaConf.is_dict(entry) else entry,
                              "each entry needs match: a glob on parameter names (embed*, *.norm.weight)")
        unknown = [k for k in entry if k not in ("match", "lr_scale", "weight_decay")]
        if unknown:
            raise ConfigError(f"{key}.{unknown[0]}", entry[unknown[0]], "allowed keys: match, lr_scale, weight_decay")
        for k, least in (("lr_scale", 0.0), ("weight_decay", None)):
            value = entry.get(k)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or \
                    (value <= least if least is not None else value < 0):
                raise ConfigError(f"{key}.{k}", value, "must be finite and " + ("> 0" if least is not None else ">= 0"))


def _check_own_scheduler(node: DictConfig) -> None:
    """A ``scheduler`` node with ``_target_``: an lr scheduler class (``torch.optim.lr_scheduler.*``) that takes the
    node's keywords after the optimizer. Raises ConfigError naming the key."""
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
    names = [str(n) for n in (_get(cfg, "wrap_policy.block_classes") or ())]


    for name in names:
        if "." not in name:
            continue
        obj = locate(name, "", full_key="wrap_policy.block_classes", value=names)
        if not (isinstance(obj, type) and issubclass(obj, nn.Module)):
            raise ConfigError("wrap_policy.block_classes", names, f"{name!r} is not an nn.Module class (it is "
                              f"{type(obj).__name__ if not isinstance(obj, type) else 'the class ' + obj.__name__}); "
                              "name the class of the model's blocks, by dotted path or bare name")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_lowbit(on_cpu: bool) -> None:
    """optim=adamw8bit needs torchao, and on CPU a C++ compiler for the update torchao compiles."""
    import shutil


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
    if "cuda" in (cfg.device, _get(cfg, "model.init_device")) and not cuda:
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
    if _get(cfg, "optim.name") == "adamw8bit":
        _check_lowbit(cfg.device == "cpu" or (cfg.device == "auto" and not cuda))
    if cfg.strategy.name == StrategyName.hsdp:
        HSDP.mesh_shape(cfg.strategy.shard_size, world_size, local_world_size or world_size)

    paths = Paths.resolve(cfg, launch_dir)
    if _get(cfg, "data.name") == "text_files":
        try:
            expand_paths(list(cfg.data.paths), paths.data)
        except FileNotFoundError as err:
            raise ConfigError("data.paths", list(cfg.data.paths), str(err).split(": ", 1)[1]) from None

    if "name" in cfg.data:
        preflight_data(cfg.data, paths.data)  # token files, the tokenizer, tokenized_text's globs
    for key, base, what in (("model.init_from", paths.model, "paths.model_dir"),
                            ("checkpoint.resume_from", launch_dir, "the launch dir")):
        value = _get(cfg, key)
        if value and not resolve_path(value, base).exists():
            where = (f"looked for {resolve_path(value, base)}" if Path(value).expanduser().is_absolute()
                     else f"relative paths resolve against {what} {base}")
            raise ConfigError(key, value, f"no such path ({where})")


def _vocabulary_for_checks(cfg: DictConfig, cls: Any) -> Optional[int]:
    """What a ``vocab_size: null`` keyword becomes for the checks before the run: the data's vocabulary where it is
    known without a tokenizer (256 for bytes and synthetic tokens), else a stand-in of its type (the run takes the
    tokenizer's); None when the keyword is not null. Raises :class:`ConfigError` naming ``model.vocab_size`` when
    the data builds datasets (no vocabulary to take) and ``cls`` does not take None."""
    if model_kwargs(cfg).get("vocab_size", 0) is not None:
        return None

    data = cfg.get("data")
    if not is_dataset_node(data):
        try:
            return vocab_size_for(data, None, None)
        except ConfigError:  # token_bin without a tokenizer: the run says so where it looks for the vocabulary
            return 256
    if "vocab_size" in _hints(cls) and _accepts(_hints(cls)["vocab_size"], None) is not None:
        raise ConfigError("model.vocab_size", None, f"null takes the data's vocabulary, but data._target_="
                          f"{data.get('_target_')} builds datasets, which have none (only token data does): set "
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
        model = build_model(cfg, "meta", vocab)
    except ConfigError as err:
        if err.key != "model._target_":  # the model's own check, naming its key
            raise
        model = None
    if model is not None:
        check_parameters(model, target)
        check_state_dict(model, target, built_on_meta=True)
        adapters = LoraSettings.of(cfg)
        if adapters is not None:  # (peft's own refusal of the target modules, on a copy)
            lora.check(model, adapters)
    limit, seq_len = max_seq_len_of(model), cfg.data.get("seq_len") if cfg.get("data") else None
    if isinstance(limit, int) and isinstance(seq_len, int) and seq_len > limit:  # positions the model has weights for
        raise ConfigError("data.seq_len", seq_len, f"longer than the {limit} positions the model has "
                          f"({type(model).__name__}.max_seq_len); allowed: <= {limit}")
    loss, metrics = build_loss(cfg), build_metrics(cfg)
    # what was built to check it is what the run's build then uses, not built again in this process
    keep_checked(cfg, target, vocab, model, loss, metrics)
    data = cfg.get("data")
    if data is not None and OmegaConf.is_dict(data) and "_target_" in data:
        check_data_node(data)
