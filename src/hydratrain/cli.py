"""``train.py``'s command line around Hydra: the run's config checks (:func:`check`), also on the config that
``--cfg job`` prints (:func:`with_config_checks`) and on every job of ``-m ... --cfg job``, composition errors as one
line, and the choices ``--help`` lists (:func:`option_groups`). Imports no torch: ``--help`` and ``--cfg`` stay fast;
the checks import what they need when they run."""
from __future__ import annotations

import contextlib
import copy
import functools
import io
import sys
from pathlib import Path
from typing import Any, Optional

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra._internal.utils import get_args_parser
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.object_type import ObjectType
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from hydratrain import exits
from hydratrain.config.launcher import launched_processes, validate_launcher
from hydratrain.config.settings import plus_as_force
from hydratrain.config.trainer import unused_keys
from hydratrain.dist.env import dist_info
from hydratrain.dist.run_dir import refuse_a_path_that_is_not_utf8
from hydratrain.errors import HydratrainError, say
from hydratrain.paths import launch_dir, resolve_path
from hydratrain.sweep.checks import (
    refuse_a_run_dir,
    refuse_a_stored_study_over_its_job_dirs,
    refuse_swept_executor_keys,
)


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
      would, on the ranks the config's launcher starts (else this launch's), with those of its launch: a sweep's
      start under a launcher that runs one run as a sweep of one job (a ``hydra.run.dir`` it would not use, the
      launcher's keys: :func:`_check_the_sweep_start`) and the run dir's path. A failed check ends the command as it
      ends the run: the run's one line (``hydratrain: config error: <key>=<value>: <why>``) and exit status 2, after
      the printed config. A config that passes gets one comment line after it per key that the run will not use
      (:func:`hydratrain.config.trainer.unused_keys`: ``# not used by this run: trainer.sample_tokens (...)``).
      When the printed config cannot be had, one line says it was not checked. Checks that need the built data,
      model or process group (a token id beyond the vocabulary, the device mesh), or that write (the run dir's probe
      and lock), run only in a run.
    - ``-m ... --cfg job`` (which Hydra refuses: "Only one of --multirun, --cfg ..."): every job of the sweep is
      printed and checked as above, one after the other (:func:`_check_each_job`).
    - ``--help`` lists the choices of this config (:func:`option_groups`, the resolver its template calls).
    """
    @functools.wraps(entry)
    def run_or_print(*args, **kwargs):
        if args or kwargs:  # a config passed in: Hydra only calls the task
            return entry(*args, **kwargs)
        register_help_resolver()
        exits.composing()
        sys.argv[1:] = plus_as_force(sys.argv[1:])  # +model.init_device=meta, from before every node had the key
        if _sweep_to_print():
            return _check_each_job(entry)
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



def _sweep_to_print() -> bool:
    """Whether the command line asks for a sweep's configs: ``-m`` / ``--multirun`` with ``--cfg job`` or ``all``."""
    try:
        args = get_args_parser().parse_args(sys.argv[1:])
    except SystemExit:
        return False
    return bool(args.multirun) and args.cfg in ("job", "all")


def _check_each_job(entry) -> None:
    """``-m OVERRIDES --cfg job``: each job Hydra's basic sweeper would run for ``OVERRIDES`` (the product of the
    swept keys' values and ``hydra.sweeper.params``', the command line winning) is composed, printed after a
    ``# job N: OVERRIDES`` line and checked as ``--cfg job`` checks a run, the sweep's start included (composed with
    ``hydra.mode=MULTIRUN``); a swept ``launcher.*`` key that submitit would not take per job is refused first.
    Ends with a total on stderr and exit status 2 when a job failed a check (each job says its own line). A sweeper
    that draws values while it runs (Optuna) has the one config checked, the searched keys at their composed
    values. Nothing runs and no dir is made."""
    argv = list(sys.argv)
    args = get_args_parser().parse_args([a for a in argv[1:] if a not in ("-m", "--multirun")])
    fixed = [a for a in argv[1:] if a not in ("-m", "--multirun") and a not in args.overrides]  # --cfg job, -cd D
    parser = OverridesParser.create()
    try:
        overrides = parser.parse_overrides(args.overrides)
        jobs = BasicSweeper.split_arguments(overrides, None)[0]
        first = _composed(entry, argv[0], fixed, jobs[0])
        sweeper = HydraConfig.get().sweeper
        params = [f"{k}={v}" for k, v in (sweeper.get("params") or {}).items()]
        if params and str(sweeper.get("_target_", "")).endswith("BasicSweeper"):
            jobs = BasicSweeper.split_arguments(parser.parse_overrides([*params, *args.overrides]), None)[0]
        elif params:
            say(f"hydratrain: {sweeper._target_.rsplit('.', 1)[-1]} draws {', '.join(sorted(sweeper.params))} as "
                "it runs: checked at their composed values")
        if select_value(first, "launcher.name", None) in ("slurm", "submitit_local"):
            refuse_swept_executor_keys(first.launcher.name, overrides)
    except HydratrainError as err:
        say(f"hydratrain: {err.label}: {err}")
        raise SystemExit(err.exit_status) from None
    except Exception as err:  # (a sweep or option Hydra cannot expand or compose: its one line)
        exits.end_composition(err)
        raise
    finally:
        sys.argv = argv
    failed = [num for num, job in enumerate(jobs) if _printed_and_checked(entry, argv[0], fixed, job, num)]
    say(f"hydratrain: {len(jobs)} job(s) checked: " +
        (f"job(s) {', '.join(map(str, failed))} failed" if failed else "all passed"))
    raise SystemExit(2 if failed else 0)


def _composed(entry, script: str, fixed: list, job: list) -> DictConfig:
    """The task config of one job of :func:`_check_each_job`, composed by Hydra's main ``entry`` (``--cfg hydra``,
    its output discarded)."""
    GlobalHydra.instance().clear()
    sys.argv = [script, *[a if a not in ("job", "all") else "hydra" for a in fixed], *job, "hydra.mode=MULTIRUN"]
    with contextlib.redirect_stdout(io.StringIO()):
        entry()
    cfg = _printed_config()
    if cfg is None:
        raise RuntimeError("this Hydra keeps no composed config after --cfg: the sweep's jobs cannot be checked")
    return cfg


def _printed_and_checked(entry, script: str, fixed: list, job: list, num: int) -> int:
    """One job of :func:`_check_each_job`, printed and checked as ``--cfg job`` is: its exit status."""
    print(f"# job {num}: {' '.join(job)}", flush=True)
    GlobalHydra.instance().clear()
    sys.argv = [script, *fixed, *job, "hydra.mode=MULTIRUN"]
    exits.composing()
    try:
        try:
            entry()
        except Exception as err:
            exits.end_composition(err, f"job {num}: ")  # (its one line, and SystemExit)
            raise
        finally:
            exits.composing(False)
        _check_printed_config(f"job {num}: ")
    except SystemExit as end:
        return end.code if isinstance(end.code, int) else 1
    finally:
        sys.argv = [script]
    return 0


def _check_printed_config(job: str = "") -> None:
    """:func:`with_config_checks`' part after Hydra's ``--cfg``: raises ``SystemExit`` with the failed check's
    status. ``job``: what the lines say after ``hydratrain: `` (a sweep's ``job N: ``)."""
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
        hydra_cfg = HydraConfig.get()
        if hydra_cfg.mode == RunMode.MULTIRUN:  # (first, as in the run: the sweep starts before its job)
            _check_the_sweep_start(cfg, hydra_cfg)
        check(cfg, world, launch_dir(), local)
        # the run dir's path, as the run refuses it (a sweep job's, <hydra.sweep.dir>/<its number>, needs the number:
        # its sweep dir is checked)
        refuse_a_path_that_is_not_utf8(resolve_path(str(
            hydra_cfg.sweep.dir if hydra_cfg.mode == RunMode.MULTIRUN else hydra_cfg.run.dir)))
    except HydratrainError as err:
        say(f"hydratrain: {job}{err.label}: {err}")
        raise SystemExit(err.exit_status) from None
    finally:
        OmegaConf.set_readonly(cfg, readonly)
    # the config as composed stays as Hydra printed it; a YAML comment after it (stdout, so `--cfg job > f.yaml`
    # still parses) marks each key that this run holds and will not use (trainer.sample_tokens for a CNN)
    for key in unused_keys(cfg):
        print(f"# not used by this run: {key}")
    say(f"hydratrain: {job}config checks passed ({world} rank(s))" + ("" if job else "; the run checks the built data, "
                                                                    "model and process group as it starts"))



def _check_the_sweep_start(cfg: DictConfig, hydra_cfg: Any) -> None:
    """The checks of a sweep's start (``on_multirun_start`` of :class:`hydratrain.sweep.SweepReportCallback`, in its
    order) on the printed config ``cfg`` (``hydra_cfg``: its ``hydra`` node), for a launch that is a sweep: any
    under a launcher that runs even one run as a sweep of one job (``hydra.mode: MULTIRUN``: torchrun, slurm,
    submitit_local, ray). A ``hydra.run.dir`` the sweep would not use, a stored Optuna study over the sweep dir's job
    dirs, the launcher's keys with what this machine needs to submit. Not made: its refusal of a swept
    ``launcher.*`` key (``--cfg`` composes no sweep: Hydra refuses ``a=1,2`` there) and its probe of the sweep dir,
    which writes there (``--cfg`` makes no dir); nor, later in the run, the run dir's lock and a sweep job's dir
    that another job or trial used. Raises :class:`~hydratrain.errors.ConfigError`."""
    refuse_a_run_dir(hydra_cfg)
    refuse_a_stored_study_over_its_job_dirs(hydra_cfg)
    if "launcher" in cfg:
        validate_launcher(cfg.launcher, submitting=True)



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



#: the option groups whose option may be a node of one's own (``_target_`` + keywords, in a ``--config-dir``), and the
#: top-level keys that hold such nodes by name (hydratrain.components and hydratrain.optim build them)
OWN_TARGET_GROUPS = ("model", "data", "loss", "optim", "scheduler")
OWN_TARGET_KEYS = ("metrics", "callbacks")
#: groups that are no choice of the user's: Hydra's own, and the typed schemas behind the options
#: (``schema/<group>/<option>``, :func:`hydratrain.config.schema.register_configs`)
_NOT_CHOICES = ("hydra", "schema")


def option_groups(*, _root_: Any = None) -> str:
    """What ``train.py --help`` lists (``${hydratrain.option_groups:}`` in ``hydra.help.template``): every config
    group a user chooses from and its options, as Hydra's config search path has them (``conf/`` and a
    ``--config-dir``'s), so the list cannot go stale. The groups of the defaults list (``group=option``, the one
    chosen now marked ``*``; ``or your own (_target_: ...)`` where :data:`OWN_TARGET_GROUPS` allows one), then those
    added with ``+group=option``, then the keys that take named nodes of one's own. ``_root_``: the whole config
    (OmegaConf passes it); its ``hydra.runtime.choices`` say which groups the defaults list holds."""
    if not GlobalHydra.instance().is_initialized():  # (resolved outside Hydra: nothing to list)
        return ""
    loader = GlobalHydra.instance().config_loader()
    choices = OmegaConf.select(_root_, "hydra.runtime.choices", default=None) or {}
    chosen: list[str] = []
    added: list[str] = []
    for group in sorted(loader.list_groups("")):
        options = sorted(loader.get_group_options(group, ObjectType.CONFIG))
        if group in _NOT_CHOICES or not options:
            continue
        now = choices.get(group)
        line = f"  {group}: " + ", ".join(o + ("*" if o == now else "") for o in options)
        if group in OWN_TARGET_GROUPS:
            line += ", or your own (_target_: ...)"
        (chosen if group in choices else added).append(line)
    own = [f"  {key}.NAME: your own (_target_: ...)" for key in OWN_TARGET_KEYS]
    text = "\n".join(["== Choices: group=option (* chosen now) ==", *chosen,
                      "== Added with +group=option ==", *added,
                      "== Named nodes of your own, any number: +KEY.NAME._target_=... ==", *own])
    return text.replace("$", "$$")  # (Hydra's help fills the template's $NAMEs: a $ of ours stays one)


def register_help_resolver() -> None:
    """Register ``${hydratrain.option_groups:}`` (:func:`option_groups`) for ``--help`` (idempotent)."""
    if not OmegaConf.has_resolver("hydratrain.option_groups"):
        OmegaConf.register_new_resolver("hydratrain.option_groups", option_groups, use_cache=False)
