"""The run's directories (the ``paths`` config group), resolved once into absolute paths: :class:`Paths`.

``conf/paths/default.yaml`` keeps the layout hydratrain always had (data paths relative to the launch dir, run dirs
under ``outputs/`` and ``multirun/`` there, caches in ``~/.cache/hydratrain``); ``conf/paths/workspace.yaml`` puts
everything under one mounted directory (``$WORKSPACE``, default ``/workspace``), as in a container or a pod with a
shared volume. Each key reads an environment variable first (``HYDRATRAIN_DATA_DIR``, ``HYDRATRAIN_OUTPUT_DIR``,
``HYDRATRAIN_CACHE``, ``HYDRATRAIN_MODEL_DIR``)::

    python train.py paths=workspace                               # /workspace/{data,outputs,multirun,cache,models}
    WORKSPACE=/mnt/ws python train.py paths=workspace data=text_files 'data.paths=[notes/*.md]'  # /mnt/ws/data/notes
    HYDRATRAIN_DATA_DIR=/datasets python train.py data=token_bin data.train_path=owt/train.bin ...

Who uses which: relative data paths (``data.paths``, ``data.train_path``, ``data.val_path``, ``data.tokenizer``)
resolve against ``paths.data_dir``; the run dirs (``hydra.run.dir`` / ``hydra.sweep.dir`` in ``conf/train.yaml``)
are built from ``paths.output_dir``; corpus and token caches and the CPU peak-FLOP/s figure go to
``paths.cache_dir`` unless ``data.cache_dir`` is set (it wins, as before); a relative ``model.init_from`` is read from
``paths.model_dir``. Relative ``paths.*`` values, ``data.cache_dir`` and ``checkpoint.resume_from`` resolve against
the launch dir (:func:`launch_dir`), whatever ``hydra.job.chdir``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from hydra.core.hydra_config import HydraConfig

MODEL_DIR_ENV = "HYDRATRAIN_MODEL_DIR"


def temporary_sibling(path: Path) -> Path:
    """Where to write ``path`` before renaming it into place: ``.<name>.tmp<pid>`` in the same dir (so the rename is
    atomic, on one filesystem), or ``.<sha1 of the name, 16 hex>.tmp<pid>`` when that name would pass the
    filesystem's 255-byte limit on a name: a valid 250-byte target name failed with ``File name too long`` for its
    temporary name alone."""
    import hashlib

    name = f".{path.name}.tmp{os.getpid()}"
    if len(os.fsencode(name)) > 255:
        name = f".{hashlib.sha1(os.fsencode(path.name)).hexdigest()[:16]}.tmp{os.getpid()}"
    return path.with_name(name)


@dataclass(frozen=True)
class Paths:
    """Absolute directories of one run (never written back into the config)."""

    launch: Path  # where the command was started
    data: Path  # base of relative data paths
    output: Path  # holds outputs/<stamp> and multirun/<stamp> (Hydra's run dirs; informational here)
    cache: Path  # corpus and token caches
    model: Path  # base of a relative model.init_from

    @classmethod
    def resolve(cls, cfg, launch: Path) -> "Paths":
        """The paths of the run config ``cfg`` with relative values made absolute against ``launch``. A config
        without a ``paths`` node (composed by hand) gets the default layout."""
        node = cfg.get("paths")
        data_cache = cfg.data.get("cache_dir") if cfg.get("data") is not None else None
        if node is None:
            return cls(launch, launch, launch, resolve_path(data_cache, launch) if data_cache else default_cache_dir(),
                       launch)
        cache = data_cache if data_cache else node.cache_dir
        return cls(launch, resolve_path(node.data_dir, launch), resolve_path(node.output_dir, launch),
                   resolve_path(cache, launch), resolve_path(node.model_dir, launch))


def join(base: str, rest: str) -> str:
    """``base/rest`` normalised (``./outputs/x`` -> ``outputs/x``, ``~`` expanded): the Hydra resolver
    ``${hydratrain.path:BASE,REST}`` that builds the run dirs from ``paths.output_dir``."""
    return os.path.normpath(os.path.join(os.path.expanduser(str(base)), str(rest)))


def default_model_dir() -> Path:
    """Where ``python -m hydratrain.export`` writes a relative output file: ``$HYDRATRAIN_MODEL_DIR`` (the variable
    ``paths.model_dir`` reads), else the current directory."""
    return Path(os.environ.get(MODEL_DIR_ENV, ".")).expanduser()


def prepare_output_file(path: "Path | str") -> None:
    """Before a command's work, check that the file ``path`` can be written at its end: its directory is created
    (with parents) and must take writes, and ``path`` must not be a directory. The CLIs that write one file (export,
    the tokenizer, the comm check) call it first, so a bad path costs one line, not a traceback after minutes of
    work. Raises OSError (its ``strerror`` and ``filename`` say what is in the way)."""
    import errno

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_dir():
        raise IsADirectoryError(errno.EISDIR, "is a directory", str(path))
    if not os.access(path.parent, os.W_OK):
        raise PermissionError(errno.EACCES, "permission denied", str(path.parent))


def launch_dir() -> Path:
    """The directory the command was launched from: Hydra's ``hydra.runtime.cwd`` (set before any ``chdir`` and
    carried to launcher workers with the job's config), else the current directory."""
    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.cwd)
    return Path(os.getcwd())


def resolve_path(value: Union[str, Path], base: Optional[Path] = None) -> Path:
    """``value`` with ``~`` expanded, made absolute against ``base`` (default :func:`launch_dir`) when relative."""
    path = Path(value).expanduser()
    return path if path.is_absolute() else (base if base is not None else launch_dir()) / path


def default_cache_dir() -> Path:
    return Path(os.environ.get("HYDRATRAIN_CACHE", Path.home() / ".cache" / "hydratrain"))
