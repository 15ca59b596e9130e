"""The ``paths`` group (where data, run dirs, caches and model files live: :mod:`hydratrain.paths` resolves them)
and the check every path-valued key of the config gets: it is not empty. No torch import."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from omegaconf import MISSING, DictConfig

from hydratrain.config.values import Option, select
from hydratrain.errors import ConfigError


class PathsName(Option):
    default = "default"
    workspace = "workspace"


@dataclass
class PathsConfig:
    """Where data, run dirs, caches and model files live (see ``hydratrain.paths``). Relative values resolve
    against the launch dir; each preset reads an environment variable first (``${oc.env:VAR,default}``)."""

    option: ClassVar[Optional[PathsName]] = None
    name: PathsName = MISSING
    data_dir: str = "."  # relative data paths (data.paths, data.train_path, data.tokenizer, ...) resolve here
    output_dir: str = "."  # run dirs: <output_dir>/outputs/<stamp> (single runs), <output_dir>/multirun/<stamp>
    cache_dir: str = "~/.cache/hydratrain"  # corpus and token caches, the CPU peak FLOP/s (data.cache_dir wins)
    model_dir: str = "."  # relative model.init_from files are read, and exported weights written, here


@dataclass
class DefaultPaths(PathsConfig):
    option: ClassVar[PathsName] = PathsName.default
    name: PathsName = PathsName.default


@dataclass
class WorkspacePaths(PathsConfig):
    """One mounted directory holds everything: <root>/data, <root>/outputs and <root>/multirun, <root>/cache,
    <root>/models (a container or a Ray/Kubernetes pod with a shared volume)."""

    option: ClassVar[PathsName] = PathsName.workspace
    name: PathsName = PathsName.workspace
    root: str = "/workspace"


#: every key of the config that holds one path (data.paths, a list, is checked entry by entry)
PATH_KEYS = ("checkpoint.resume_from", "model.init_from", "data.tokenizer", "data.train_path", "data.val_path",
             "data.cache_dir", "paths.root", "paths.data_dir", "paths.output_dir", "paths.cache_dir", "paths.model_dir")
REQUIRED_PATH_KEYS = ("data.train_path", "data.val_path")


def refuse_empty_paths(cfg: DictConfig) -> None:
    """An empty string is no path: ``checkpoint.resume_from=$CKPT`` with CKPT unset trained from scratch and
    ``data.tokenizer=$TOK`` trained a new BPE, both without a word, because '' read as "not set"."""
    for key in PATH_KEYS:
        value = select(cfg, key)
        if isinstance(value, str) and not value.strip():
            none = ("" if key in REQUIRED_PATH_KEYS else ", or '.' for the launch dir" if key.startswith("paths.")
                    else ", or null for none")
            raise ConfigError(key, value, f"empty (from an unset shell variable, as in {key}=$VAR?): give a path"
                              f"{none}")
    for entry in select(cfg, "data.paths") or ():
        if isinstance(entry, str) and not entry.strip():
            raise ConfigError("data.paths", list(cfg.data.paths), "holds an empty entry (from an unset shell "
                              "variable?): give files or globs")
