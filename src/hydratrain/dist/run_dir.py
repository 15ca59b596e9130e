"""One run dir for all ranks, and the launch dir every user-given path is relative to.

- :func:`run_stamp`: the ``YYYY-MM-DD/HH-MM-SS`` stamp all ranks of a launch agree on (Hydra resolver
  ``${hydratrain.stamp:}`` in ``conf/train.yaml``'s ``hydra.run.dir`` / ``hydra.sweep.dir``).
- :func:`launch_dir` / :func:`resolve_path`: the directory the command was started from (Hydra's
  ``hydra.runtime.cwd``), whatever ``hydra.job.chdir``, the launcher or the sweep; every path key (``data.paths``,
  ``model.init_from``, ``checkpoint.resume_from``, ``data.cache_dir``) resolves against it.
- :func:`run_dir_of`: this job's output dir.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional, Union

from hydratrain.dist.env import env_rank

STAMP_ENV = "HYDRATRAIN_STAMP"  # a launcher's stamp, inherited by the processes it starts
_STAMP: Optional[str] = None


def run_stamp() -> str:
    """A ``YYYY-MM-DD/HH-MM-SS`` stamp that every rank of one launch agrees on.

    Hydra's ``${now:}`` resolves per process, so ranks started a second apart would write to two run dirs.

    * With several ranks (torchrun, the ``launcher=torchrun`` plugin, submitit tasks), every rank proposes a stamp
      to the TCPStore at ``MASTER_ADDR``/``MASTER_PORT`` with ``compare_set``; the first proposal wins and all ranks,
      on all nodes, read it back. The proposal is the launching process's stamp (``$HYDRATRAIN_STAMP``, inherited
      from a launcher) if there is one, else the local time. The key is per launch (elastic run id / SLURM job id),
      so ranks restarted by the agent (``max_restarts``) keep the same run dir and can resume from it.
    * Else ``$HYDRATRAIN_STAMP`` if set, else the local time.

    The stamp is exported as ``$HYDRATRAIN_STAMP`` so processes this one starts (launcher workers) agree with it.
    """
    global _STAMP
    if _STAMP is None:
        from hydratrain.dist.env import dist_info

        mine = os.environ.get(STAMP_ENV) or time.strftime("%Y-%m-%d/%H-%M-%S")
        if dist_info().world_size > 1 and "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
            from hydratrain.dist.process_group import base_store

            store = base_store()
            launch_id = next((os.environ[k] for k in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SUBMITIT_LOCAL_JOB_ID")
                              if k in os.environ), "none")
            key = "hydratrain/run_stamp/" + launch_id
            _STAMP = store.compare_set(key, "", mine).decode()
            if _STAMP == "":  # very old stores return the expected value when they set the key
                _STAMP = store.get(key).decode()
        else:
            _STAMP = mine
        os.environ[STAMP_ENV] = _STAMP
    return _STAMP


def output_subdir() -> Optional[str]:
    """``.hydra`` on rank 0 and ``None`` (Hydra then writes no config copy) on the other ranks, and on rank 0 too
    when another live job holds the run dir (:mod:`hydratrain.dist.run_lock`; this job then stops with exit status
    2, and the running job's ``.hydra/`` stays its own)."""
    if env_rank() != 0:
        return None
    from hydra.core.hydra_config import HydraConfig

    from hydratrain.dist.run_lock import held_by_another

    try:
        output_dir = HydraConfig.get().runtime.output_dir
    except Exception:  # resolved before Hydra set up the job (--cfg hydra, a launcher's process)
        return ".hydra"
    return None if output_dir and held_by_another(Path(output_dir)) else ".hydra"


def register_resolvers() -> None:
    """Register ``${hydratrain.stamp:}``, ``${hydratrain.output_subdir:}``, ``${hydratrain.rank:}`` and
    ``${hydratrain.path:BASE,REST}`` (:func:`hydratrain.paths.join`) (idempotent)."""
    from omegaconf import OmegaConf

    from hydratrain.paths import join

    for name, fn in (("hydratrain.stamp", run_stamp), ("hydratrain.output_subdir", output_subdir),
                     ("hydratrain.rank", env_rank), ("hydratrain.path", join)):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn, use_cache=False)


def launch_dir() -> Path:
    """The directory the command was launched from: Hydra's ``hydra.runtime.cwd`` (set before any ``chdir`` and
    carried to launcher workers with the job's config), else the current directory."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.cwd)
    return Path(os.getcwd())


def resolve_path(value: Union[str, Path], base: Optional[Path] = None) -> Path:
    """``value`` with ``~`` expanded, made absolute against ``base`` (default :func:`launch_dir`) when relative."""
    path = Path(value).expanduser()
    return path if path.is_absolute() else (base if base is not None else launch_dir()) / path


def run_dir_of() -> Path:
    """Hydra's output dir for this job (the current dir when called without Hydra)."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir)
    return Path(os.getcwd())
