"""``train.py``'s command line around Hydra: the run's config checks (:func:`check`), also on the config that
``--cfg job`` prints (:func:`with_config_checks`), and composition errors as one line. Imports no torch: ``--help``
and ``--cfg`` stay fast; the checks import what they need when they run."""
from __future__ import annotations

import copy
import functools
import sys
from pathlib import Path
from typing import Any, Optional

from hydra._internal.utils import get_args_parser
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from hydratrain import exits
from hydratrain.config.launcher import launched_processes
from hydratrain.config.settings import plus_as_force
from hydratrain.dist.env import dist_info
from hydratrain.errors import HydratrainError, say
from hydratrain.paths import launch_dir


def check(cfg: DictConfig, world_size: int, launch: Path, local_world_size: Optional[int] = None) -> None:
    """The config checks a run makes before it starts, and before any process group exists: the cross-field rules
    (:func:`hydratrain.config.validate.validate`) and those of this machine and launch
    (:func:`~hydratrain.config.validate.check_environment`: device, backend, world size, input paths;
    ``world_size`` and ``local_world_size`` ranks, relative paths against the launch dir ``launch``). :func:`main`
    runs them, and so does ``train.py --cfg job`` (:func:`with_config_checks`). Raises
    :class:`~hydratrain.errors.ConfigError` on the first bad key."""
    from hydratrain.config.validate import check_environment, validate  # (start-up: torch ~2 s, not for --help)

    validate(cfg)
    check_environment(cfg, world_size, launch, local_world_size)



def with_config_checks(entry):
    """``train.py``'s entry: Hydra's ``@hydra.main`` function ``entry``, with the config errors a run ends with.

    - An error Hydra finds while it composes the config (an unknown key or option, a wrong type) ends the launch as
      any config error does: one line, ``hydratrain: config error: ...``, exit status 2, printed once per node under
      torchrun (:func:`hydratrain.exits.end_composition`), not Hydra's few lines on every rank.
    - When the command line printed the composed config instead of running (``--cfg job`` or ``--cfg all``: Hydra
      prints it and never calls the task), :func:`check` runs on that same config, as a run of that command line
      would, on the ranks the config's launcher starts (else this launch's). A failed check ends the command as it
      ends the run: the run's one line (``hydratrain: config error: <key>=<value>: <why>``) and exit status 2, after
      the printed config. When the printed config cannot be had, one line says it was not checked. Checks that need
      the built data, model or process group (a token id beyond the vocabulary, the device mesh) run only in a run.
    """
    @functools.wraps(entry)
    def run_or_print(*args, **kwargs):
        if args or kwargs:  # a config passed in: Hydra only calls the task
            return entry(*args, **kwargs)
        exits.composing()
        sys.argv[1:] = plus_as_force(sys.argv[1:])  # +model.init_device=meta, from before every node had the key
        try:
            result = entry()
        except Exception as err:
            exits.end_composition(err)  # (raises SystemExit for a composition error)
            raise
        except KeyboardInterrupt:  # Ctrl-C outside a run's own handling: Hydra composing, a launcher between jobs
            exits.end_interrupted_launch()
        finally:
            exits.composing(False)
        _check_printed_config()
        return result

    return run_or_print



def _check_printed_config() -> None:
    """:func:`with_config_checks`' part after Hydra's ``--cfg``: raises ``SystemExit`` with the failed check's
    status."""
    try:
        args = get_args_parser().parse_args(sys.argv[1:])
    except SystemExit:
        return
    if args.cfg not in ("job", "all"):
        return
    cfg = _printed_config()
    if cfg is None:
        say("hydratrain: the printed config was not checked (this Hydra keeps no composed config after --cfg): "
            "a run of it checks it before it starts")
        return

    env = dist_info()
    world, local = env.world_size, env.local_world_size
    if select_value(cfg, "launcher.name", "local") not in (None, "local"):  # the launcher's workers run it
        world = launched_processes(cfg.launcher)
        local = next((cfg.launcher[k] for k in ("nproc_per_node", "tasks_per_node") if k in cfg.launcher), world)
    readonly = cfg._get_node_flag("readonly")
    OmegaConf.set_readonly(cfg, True)
    try:
        check(cfg, world, launch_dir(), local)
    except HydratrainError as err:
        say(f"hydratrain: {err.label}: {err}")
        raise SystemExit(err.exit_status) from None
    finally:
        OmegaConf.set_readonly(cfg, readonly)



def _printed_config() -> Optional[DictConfig]:
    """The task config Hydra composed for ``--cfg`` (``hydra`` removed): Hydra's ``show_cfg`` keeps the whole
    composed config as the parent of the ``hydra`` node it hands to ``HydraConfig``; None when it is not there."""
    try:
        whole = HydraConfig.instance().cfg.hydra._get_parent()  # type: ignore[union-attr]  # (a DictConfig)
    except Exception:  # noqa: BLE001 (another Hydra: said so by the caller)
        return None
    if not isinstance(whole, DictConfig) or "trainer" not in whole:
        return None
    if "hydra" in whole:  # --cfg all: the task's part, as a run gets it (a deep copy keeps the schema's types)
        whole = copy.deepcopy(whole)
        with read_write(whole), open_dict(whole):
            del whole["hydra"]
    return whole



def select_value(cfg: DictConfig, key: str, default: Any) -> Any:
    """``cfg``'s value at ``key``, or ``default`` when it is missing or does not resolve (the config check names
    it)."""
    try:
        return OmegaConf.select(cfg, key, default=default)
    except Exception:
        return default
