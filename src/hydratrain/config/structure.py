"""Checks of the config's shape, whatever the group: every component group has a node, every interpolation
resolves, every integer fits int64, every key is one its schema declares and has a value, each option node is the
option it was composed as, and no group the run reads was removed (``~group``). No torch import."""
from __future__ import annotations

import dataclasses
import re
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from hydratrain.config.data import LOADER_KEYS
from hydratrain.config.model import MODEL_KEYS
from hydratrain.config.schema import SCHEMAS
from hydratrain.config.values import NO_VALUE, unresolvable
from hydratrain.errors import ConfigError, Placeholder

GROUPS_WITH_OPTIONS = ("data", "strategy", "precision", "wrap_policy", "launcher", "optim", "scheduler", "paths")


def check_option_nodes(cfg: DictConfig) -> None:
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
        raise ConfigError(group, NO_VALUE, f"has no option (removed with ~{group}, or a file of your own without "
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


def refuse_removed_groups(cfg: DictConfig) -> None:
    """``~group`` (Hydra's removal from the defaults list) of a group the run reads: where the group's schema has a
    default for every key (``~checkpoint``, ``~logger``, ``~trainer``), the schema's defaults took the option's place
    and the run went on as if nothing had been removed (``~checkpoint ~logger`` to save disk in a sweep would still
    write checkpoints and events). Reads Hydra's ``runtime.choices`` (the config's own ``hydra`` node, or the
    running app's); without either, checks nothing. Raises :class:`ConfigError` naming the group and, where there is
    one, the key that turns its work off."""
    if "hydra" in cfg:
        hydra = OmegaConf.select(cfg, "hydra", default=None)
    else:
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


_DELETED, _ANOTHER_CONFIG = Placeholder("<deleted>"), Placeholder("<another config>")


def check_known_keys(node: DictConfig, path: str = "") -> None:
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
            raise ConfigError(where, NO_VALUE, why)
        child = node._get_node(key)
        if isinstance(child, (DictConfig, ListConfig)) and not child._is_none() and not child._is_missing():
            _check_entries(child, where)
            if isinstance(child, DictConfig):
                check_known_keys(child, where)


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


def check_resolves(cfg: DictConfig) -> None:
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


def refuse_missing_components(cfg: DictConfig) -> None:
    """A component group with no node (``~model``, or a config composed without it): one line naming the group."""
    owned = {"model": MODEL_KEYS, "data": LOADER_KEYS, "loss": ()}  # (in every such node: no option of its own)
    for group in ("model", "loss", "data"):
        node = cfg._get_node(group, throw_on_missing_key=False) if isinstance(cfg, DictConfig) else None
        if node is not None and (node._is_missing() or isinstance(node, DictConfig) and not node._is_none()
                                 and set(node.keys()) <= set(owned[group])):
            raise ConfigError(group, NO_VALUE, f"has no option: choose one with {group}=NAME (conf/{group}/), or "
                              f"give a file of your own with _target_ in a --config-dir (docs/own-model.md)")


def check_int_ranges(node: Any, path: str = "") -> None:
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
                check_int_ranges(child, where)
            continue
        if child._is_missing():
            continue
        value = node[key]
        if isinstance(value, int) and not isinstance(value, bool) and not -2**63 <= value < 2**63:
            raise ConfigError(where, value, "out of range: integer keys take values that fit torch's int64 "
                              "(|value| < 2**63)")

