"""The checks a sweep makes of itself: before it submits (its launcher keys, its fixed values under submitit, a
``hydra.run.dir`` it would not use, a stored Optuna study relaunched over its own job dirs) and, after a trial
failed, whether the search can still find anything (:func:`_hopeless`). Called by the sweep's Hydra callback
(:class:`hydratrain.sweep.SweepReportCallback`); each raises :class:`~hydratrain.errors.ConfigError` or says why.
"""
from __future__ import annotations

import os
from typing import Any, List, Optional, Sequence

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from omegaconf import DictConfig, OmegaConf

from hydratrain.dist.run_dir import MULTIRUN_MARK, _read_json, _sweep_dir
from hydratrain.errors import ConfigError


def _hopeless(hc: Any, err: BaseException, rows: List[dict], launching: bool, config: Any = None) -> str:
    """Why a search that goes on after failed trials (a sweeper with ``max_failure_rate`` > 0, such as the Optuna
    preset) should stop now, after trial ``err`` failed; '' when it should go on. Only the process that runs the
    sweeper decides (``launching``: Hydra's basic launcher runs the jobs in it; hydratrain's torchrun and ray
    launchers report a failed job there, not from its workers). It stops when no trial has completed and either

    - every trial provably fails alike (:func:`_fails_alike`: a config error whose key and text name no key the
      sweep varies; ``config``, the job's config, tells whether that key's value is an interpolation), or
    - this was the last of ``n_trials`` (else Optuna ends in ``ValueError: No trials are completed yet``).

    When in doubt it goes on: a failure another trial's values might avoid costs a trial, a search stopped for
    nothing costs the search."""
    sweeper = hc.get("sweeper") or {}
    if not sweeper.get("max_failure_rate") or not (launching or "BasicLauncher" in str(hc.launcher.get("_target_"))):
        return ""
    if any(r["status"] == "COMPLETED" for r in rows):
        return ""
    message = f"{getattr(err, 'label', type(err).__name__)}: {err}".splitlines()[0]
    sampled = _sampled(hc)
    if _fails_alike(err, sampled, hc, config):
        return (f"{message}; no sampled value ({', '.join(sampled) or 'none'}) causes it, "  # type: ignore[arg-type]
                "so every trial would fail alike")  # (sampled is not None where _fails_alike holds)
    n_trials = sweeper.get("n_trials")
    if isinstance(n_trials, int) and hc.job.num >= n_trials - 1:
        return f"all {len(rows)} trials failed; the last: {message}"
    return ""


def _fails_alike(err: BaseException, sampled: Optional[List[str]], hc: Any, config: Any = None) -> bool:
    """Whether every trial of the sweep would fail with ``err``: provably only when it is a config error (a check
    on the composed config, the same for every trial with the same values) and no key the sweep varies can change
    what it checked:

    - the keys the sweep varies are known (``sampled``, not None) and none is a config group (a swept option file,
      ``+experiment=a,b``, may set any key);
    - the error's key is no sampled key, none is above or below it, and its text names none (a check across keys,
      ``model.n_head=4: must divide model.d_model=66``, names the other one);
    - the error's key is not Hydra's own (``hydra.sweep.dir``: one job's dir, not the trial's values) and its value
      in the job's ``config`` is not an interpolation (it may follow a sampled key).

    A checkpoint or output error (status 3) is not: the checkpoint's shapes, the save's size follow the sampled
    model and batch."""
    if not isinstance(err, ConfigError) or sampled is None:
        return False
    key = str(getattr(err, "key", ""))
    groups = set((hc.get("runtime") or {}).get("choices") or {})
    if any(p in groups or p.split("@")[0] in groups for p in sampled) or key.startswith("hydra.") or key == "hydra":
        return False
    if any(key == p or key.startswith(p + ".") or p.startswith(key + ".") or p in str(err) for p in sampled):
        return False
    if config is not None:
        try:
            parent, _, leaf = key.rpartition(".")
            node = OmegaConf.select(config, parent) if parent else config
            if node is not None and leaf in node and OmegaConf.is_interpolation(node, leaf):
                return False
        except Exception:  # noqa: BLE001 (a key that is no config path, e.g. optim.beta1/beta2: as it reads)
            pass
    return True


def _sampled(hc: Any) -> Optional[List[str]]:
    """The config keys this sweep varies: those the multirun recorded at its start (:func:`mark_multirun`), else
    those of the sweep dir's ``multirun.yaml`` (Hydra's basic sweeper writes it before the first job); with
    ``hydra.sweeper.params``'s (the job's own). None when the command line's cannot be known (another sweeper, e.g.
    Optuna's, which writes no ``multirun.yaml``, in a sweep dir without the mark)."""
    sweep_dir = _sweep_dir(hc)
    mark = _read_json(sweep_dir / MULTIRUN_MARK)
    recorded: Optional[list]
    if mark.get("sampled") is not None:
        recorded = list(mark["sampled"])
    else:
        try:
            recorded = sampled_keys(OmegaConf.load(sweep_dir / "multirun.yaml").hydra)
        except Exception:  # noqa: BLE001 (no multirun.yaml, another Hydra's layout)
            recorded = None
    if recorded is None:
        return None
    params = [_plain_key(str(k)) for k in ((hc.get("sweeper") or {}).get("params") or {})]
    return list(dict.fromkeys(params + recorded))


def sampled_keys(hydra_cfg: Any) -> Optional[List[str]]:
    """The config keys a multirun varies, from its Hydra config (``hydra``: the sweep's, at its start): every key of
    ``hydra.sweeper.params`` (the search space of Optuna's and the basic sweeper), and every key the command line
    (``hydra.overrides.task``) sweeps in any of Hydra's syntaxes: ``choice()``, ``range()``, ``interval()``,
    ``tag()``, ``glob()``, comma lists; given as ``key=``, ``+key=``, ``++key=`` or ``~key=``. Keys are plain
    (``model.d_model``; a group as ``model``, with ``@package`` when given). None when the overrides cannot be
    parsed (then nothing can be ruled out)."""
    params = [_plain_key(str(k)) for k in ((hydra_cfg.get("sweeper") or {}).get("params") or {})]
    try:
        task = [str(t) for t in hydra_cfg.overrides.task]
        overrides = OverridesParser.create().parse_overrides(task)
    except Exception:  # noqa: BLE001 (a syntax the parser reads otherwise than the sweeper)
        return None
    swept = [o.key_or_group + (f"@{o.package}" if o.package else "") for o in overrides if o.is_sweep_override()]
    return list(dict.fromkeys(params + swept))


def _plain_key(key: str) -> str:
    """A ``hydra.sweeper.params`` key without Hydra's ``+``, ``++`` or ``~`` prefix."""
    return key.lstrip("+~")


def _check_before_submitting(config: DictConfig) -> None:
    """The config checks of a job (:func:`hydratrain.config.validate`) on the sweep's config, whose swept keys keep
    their defaults, before submitit queues anything: a bad fixed value fails now, not when a SLURM job starts after
    its wait in the queue. (A bad swept value still fails its own job.) Raises ConfigError."""
    from hydratrain.config.validate import validate  # (start-up: torch ~2 s)

    task = OmegaConf.masked_copy(config, [str(k) for k in config if k != "hydra"])  # (its keys are strings)
    OmegaConf.set_readonly(task, True)
    validate(task)


def refuse_swept_executor_keys(launcher: str, overrides: Sequence[Override]) -> None:
    """hydra-submitit-launcher makes one executor (nodes, tasks, GPUs, CPUs, time limit, partition) for the whole
    sweep from the sweep-level config: a swept ``launcher.*`` key (Hydra refuses ``hydra.*`` ones) would run every
    job with the sweep's value while each job's report row and hparams said its own. Raises ConfigError naming the
    key. ``launcher``: its name; ``overrides``: the sweep's, parsed (``OverridesParser.parse_overrides``)."""
    for override in overrides:
        if override.is_sweep_override() and override.key_or_group.startswith("launcher."):
            # (a parsed line's): why the ignore below
            raise ConfigError(override.key_or_group, override.input_line.split("=", 1)[1],  # type: ignore[union-attr]
                              f"cannot be swept under launcher={launcher}: submitit sets one executor for "
                              "the whole sweep, so every job would run with the sweep's value while its report row "
                              "said its own; run one sweep per value (launcher=torchrun and ray take it per job)")


def refuse_a_stored_study_over_its_job_dirs(hc: Any) -> None:
    """An Optuna sweep (``hydra.sweeper.storage`` set) whose study already holds trials, relaunched into a
    ``hydra.sweep.dir`` that holds job dirs: Hydra's Optuna sweeper numbers the relaunch's trials from job 0 again
    (hydra issue #3328), so each new trial lands in an earlier trial's dir, where it is refused as another trial
    or, when the seeded sampler proposes the same values again, only re-evaluates the finished one and is told to
    the study as a new observation (the study would hold copies of trials). Also a stored study
    searched inside each torchrun rank (one sweeper per rank). Raises :class:`~hydratrain.errors.ConfigError` on
    ``hydra.sweeper.storage``; a storage optuna cannot read is left to the sweeper."""
    sweeper = hc.get("sweeper", {})
    storage, name = sweeper.get("storage"), sweeper.get("study_name")
    if storage and "optuna" in str(sweeper.get("_target_", "")).lower() and \
            int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        # (every rank would create the study at once: sqlite's IntegrityError traceback, a trial left RUNNING)
        raise ConfigError("hydra.sweeper.storage", storage, "a search run inside each torchrun rank (torchrun "
                          "train.py -m) has a sweeper per rank, and all of them would write the study: launch the "
                          "search with launcher=torchrun instead (python train.py -m launcher=torchrun "
                          "launcher.nproc_per_node=N ...)")
    sweep_dir = _sweep_dir(hc)
    jobs = [d for d in sweep_dir.iterdir() if d.is_dir() and d.name.isdigit()] if sweep_dir.is_dir() else []
    if not storage or "optuna" not in str(sweeper.get("_target_", "")).lower() or not jobs:
        return
    try:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        trials = next((s.n_trials for s in optuna.study.get_all_study_summaries(storage=str(storage))
                       if s.study_name == name), 0)
    except Exception:  # noqa: BLE001 (not ours to report: the sweeper says what is wrong with its storage)
        return
    if trials:
        raise ConfigError("hydra.sweeper.storage", storage,
                          f"its study {name!r} already holds {trials} trial(s) and hydra.sweep.dir={sweep_dir} holds "
                          f"{len(jobs)} job dir(s): Hydra's Optuna sweeper numbers a relaunch's trials from job 0 "
                          "again, so each would land in an earlier trial's dir; to add trials to the study give a new "
                          "hydra.sweep.dir (and another hydra.sweeper.sampler.seed, or the seeded sampler proposes "
                          "the first trials' values again)")



def refuse_a_run_dir(hydra_cfg: DictConfig) -> None:
    """A multirun puts each job in ``hydra.sweep.dir`` / ``hydra.sweep.subdir``; Hydra ignores a ``hydra.run.dir``
    given on the command line, so the run would land elsewhere than asked. Raises ConfigError on that key, naming
    the key that does it."""
    given = []
    for override in OverridesParser.create().parse_overrides([str(o) for o in hydra_cfg.overrides.hydra]):
        value = override.value()
        if override.key_or_group == "hydra.run.dir":
            given.append(str(value))
        elif override.key_or_group == "hydra.run" and isinstance(value, dict) and "dir" in value:  # hydra.run={dir:X}
            given.append(str(value["dir"]))
    if given:
        launcher = hydra_cfg.runtime.choices.get("launcher")
        why = f" (launcher={launcher} runs even one run as a sweep of one job)" if launcher not in (None, "local") \
            else ""
        raise ConfigError("hydra.run.dir", given[-1], f"not used by a sweep{why}, which puts each job in a sub-dir "
                          f"of hydra.sweep.dir (hydra.sweep.subdir, by default the job number): give "
                          f"hydra.sweep.dir={given[-1]}")
