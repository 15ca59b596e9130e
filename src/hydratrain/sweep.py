"""The sweep report: one row per Hydra job of a multirun, and the Hydra callback that keeps it current.

Each job's rank 0 writes ``results.json`` (``Trainer.finish``); this module's callback writes ``status.json`` at the
end of each job, in rank 0 or, for a job that the torchrun launcher saw fail (a failed check, a dead rank), in the
launcher's process; :func:`write_sweep_report` joins them into ``sweep_report.csv`` and ``sweep_report.md`` in the
sweep dir. Registered in ``conf/train.yaml`` as ``hydra.callbacks.sweep_report``.
"""
from __future__ import annotations

import csv
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any, List, Optional

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from hydratrain.checkpoint.preemption import early_guard, take_early_signal
from hydratrain.config.launcher import validate_launcher
from hydratrain.dist.env import env_rank
from hydratrain.dist.launch import composing, launch_command, note_launcher
from hydratrain.dist.run_dir import (
    MULTIRUN_MARK,
    _read_json,
    _sweep_dir,
    discard_if_unused,
    discard_reserved_unused,
    refuse_a_full_run_dir,
    refuse_an_unwritable_run_dir,
)
from hydratrain.errors import EXIT_CONFIG, EXIT_ERROR, ConfigError, HydratrainError, say
from hydratrain.paths import resolve_path

log = logging.getLogger(__name__)

COLUMNS = ["job", "overrides", "status", "steps", "train_loss", "eval_loss", "tokens_per_sec", "peak_memory_mb",
           "mfu", "seconds", "error"]


def mark_multirun(sweep_dir: Path, sampled: Optional[List[str]] = None, command: Optional[List[str]] = None) -> str:
    """Record in ``sweep_dir`` that a new multirun starts there (at its start, once, in the launching process);
    returns its id. The report then lists this multirun's jobs only: a re-run into an existing sweep dir with fewer
    or other jobs does not report (or fail on) the jobs of an earlier one. ``sampled``: the config keys the sweep
    varies (:func:`sampled_keys`; None: not known), which :func:`_hopeless` reads in whatever process learns of a
    failed job; ``command``: the sweep's command line (:func:`hydratrain.dist.launch.launch_command`), from which a
    job in any process says how to resume the sweep (:func:`hydratrain.dist.launch.resume_command`)."""
    import uuid

    sweep_dir.mkdir(parents=True, exist_ok=True)
    mark: dict[str, Any] = {"id": uuid.uuid4().hex, "started": time.time(), "sampled": sampled, "command": command}
    tmp = sweep_dir / f"{MULTIRUN_MARK}.tmp{os.getpid()}"
    tmp.write_text(json.dumps(mark))
    os.replace(tmp, sweep_dir / MULTIRUN_MARK)
    return mark["id"]


def write_job_status(job_dir: Path, num: int, overrides: List[str], status: str, error: str = "",
                     seconds: Optional[float] = math.nan, multirun: Optional[str] = None, results_current: bool = True,
                     refused: bool = False) -> None:
    """Write ``<job_dir>/status.json``: job number, overrides, ``COMPLETED``/``FAILED``, a one-line error, the
    job's seconds (NaN or None: unknown, stored as null), the id of the multirun it belongs to (:func:`mark_multirun`)
    and whether the dir's ``results.json`` is this job's (False: one left by an earlier job in this dir, which the
    report does not show). A job ``refused`` the dir (:func:`refused_the_dir`) writes ``status.job<num>.json``
    instead, so the status of the job or trial the dir belongs to stays (or, for a job still running there, is
    still to come)."""
    if seconds is not None and not math.isfinite(seconds):
        seconds = None
    payload = {"num": num, "overrides": list(overrides), "status": status, "error": error, "seconds": seconds,
               "multirun": multirun, "results_current": results_current}
    name = f"status.job{num}.json" if refused else "status.json"  # (the dir's job may still be running)
    tmp = job_dir / f".{name}.tmp{os.getpid()}"
    tmp.write_text(json.dumps(payload, indent=1))
    os.replace(tmp, job_dir / name)


def _refused_by_its_rank0(job_dir: Path, num: int, multirun: Optional[str]) -> bool:
    """Whether job ``num``'s rank 0 recorded that it was refused ``job_dir`` (``status.job<num>.json`` of this
    multirun): the launcher's process, which sees only its workers' exit, then leaves the dir's ``status.json``, the
    other job's or trial's, alone."""
    status = _read_json(job_dir / f"status.job{num}.json")
    return status.get("num") == num and status.get("multirun") == multirun


def refused_the_dir(err: Any) -> bool:
    """Whether a job failed with the config error that its run dir is another job's or trial's (held by a live job,
    a checkpoint of another trial, another job of this multirun: keyed on ``hydra.sweep.dir`` / ``.subdir``)."""
    return getattr(err, "key", "") in ("hydra.sweep.dir", "hydra.sweep.subdir")


def _overrides_yaml(job_dir: Path) -> Optional[List[str]]:
    path = job_dir / ".hydra" / "overrides.yaml"
    if not path.exists():
        return None

    return [str(o) for o in OmegaConf.load(path)]


def sweep_rows(sweep_dir: Path) -> List[dict]:
    """One dict per job dir found under ``sweep_dir`` (a dir holding ``status.json``, ``results.json`` or
    ``.hydra/overrides.yaml``, at any depth, so nested ``hydra.sweep.subdir`` values work), ordered by job number.
    Values are floats, ints or strings; missing figures are ''."""
    rows = []
    job_dirs = {p.parent for name in ("status.json", "results.json") for p in sweep_dir.rglob(name)}
    job_dirs |= {p.parent.parent for p in sweep_dir.rglob("overrides.yaml") if p.parent.name == ".hydra"}
    mark = _read_json(sweep_dir / MULTIRUN_MARK)
    entries = [(d, _read_json(d / "status.json"), _read_json(d / "results.json"), False) for d in job_dirs]
    # jobs refused a dir that is another job's or trial's (write_job_status): a row of their own, no figures
    entries += [(p.parent, _read_json(p), {}, True) for p in sweep_dir.rglob("status.job*.json")]
    for job_dir, status, results, refused in sorted(entries, key=lambda e: (str(e[0]), e[1].get("num") or 0)):
        if job_dir == sweep_dir or ".submitit" in job_dir.parts:
            continue
        if mark and not (status.get("multirun") == mark.get("id") if refused else _of_multirun(job_dir, status, mark)):
            continue
        if status and not status.get("results_current", True):
            results = {}
        overrides = status.get("overrides") or _overrides_yaml(job_dir) or []
        if status.get("status"):
            state = status["status"]
        else:
            state = "COMPLETED" if results else "RUNNING"
        if state == "COMPLETED" and not results:
            state = "COMPLETED (no results.json)"

        def fig(key: str, scale: float = 1.0, results: dict = results) -> Any:
            v = results.get(key)
            return "" if v is None or (isinstance(v, float) and math.isnan(v)) else round(v * scale, 6)

        num = status.get("num")
        job = job_dir.relative_to(sweep_dir).as_posix() + (f" (job {num})" if refused else "")
        metrics = {f"eval/{k}": ("" if v is None else round(v, 6))
                   for k, v in (results.get("eval_metrics") or {}).items()}
        if results.get("tokens_per_sec") is None and results.get("samples_per_sec") is not None:
            metrics["samples_per_sec"] = fig("samples_per_sec")  # a dataset's throughput (no tokens)
        rows.append({"job": job, "_num": num if num is not None else math.inf,
                     "overrides": " ".join(overrides), "status": state, "steps": results.get("steps", ""),
                     "train_loss": fig("train_loss"), "eval_loss": fig("eval_loss"), **metrics,
                     "tokens_per_sec": fig("tokens_per_sec"), "peak_memory_mb": fig("peak_memory_bytes", 1e-6),
                     "mfu": fig("mfu"), "seconds": fig("seconds") if results else _finite(status.get("seconds")),
                     "error": status.get("error", "")})
    rows.sort(key=lambda r: (r["_num"], r["job"]))
    for r in rows:
        del r["_num"]
    return rows


def _of_multirun(job_dir: Path, status: dict, mark: dict) -> bool:
    """Whether ``job_dir`` is a job of the multirun ``mark``: its status says so, or (running, no status yet of this
    multirun) Hydra wrote its ``.hydra/overrides.yaml`` since that multirun started."""
    if status.get("multirun") == mark.get("id"):
        return True
    try:
        return (job_dir / ".hydra" / "overrides.yaml").stat().st_mtime >= mark.get("started", 0) and (
            not status or (job_dir / "status.json").stat().st_mtime < mark.get("started", 0))
    except OSError:
        return False


def _finite(value: Any) -> Any:
    return value if isinstance(value, (int, float)) and math.isfinite(value) else ""


def write_sweep_report(sweep_dir: Path) -> Optional[Path]:
    """(Re)write ``sweep_report.csv`` and ``sweep_report.md`` in ``sweep_dir`` from the job dirs found there.

    Returns the CSV path, or None when no job dir exists yet. Safe to call after every job.
    """
    sweep_dir = Path(sweep_dir)
    rows = sweep_rows(sweep_dir)
    if not rows:
        return None
    at = COLUMNS.index("eval_loss") + 1  # the metrics' eval/<name> columns follow eval_loss
    metrics = sorted({k for r in rows for k in r if k not in COLUMNS and k != "samples_per_sec"})
    columns = COLUMNS[:at] + metrics + COLUMNS[at:]
    if any("samples_per_sec" in r for r in rows):
        columns.insert(columns.index("tokens_per_sec") + 1, "samples_per_sec")
    csv_path = sweep_dir / "sweep_report.csv"
    tmp = sweep_dir / f".sweep_report.csv.tmp{os.getpid()}"
    with tmp.open("w", newline="") as f:
        writer = csv.DictWriter(f, columns, restval="")
        writer.writeheader()
        writer.writerows(rows)
    os.replace(tmp, csv_path)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(r.get(c, "")) for c in columns) + " |" for r in rows]
    md = sweep_dir / f".sweep_report.md.tmp{os.getpid()}"
    md.write_text("\n".join(lines) + "\n")
    os.replace(md, sweep_dir / "sweep_report.md")
    return csv_path


def _cell(value: Any) -> str:
    """A markdown table cell: floats to 5 significant digits (the CSV keeps every digit), ``|`` escaped."""
    if isinstance(value, float):
        return f"{value:.5g}" if abs(value) < 1e5 else f"{value:,.0f}"
    return str(value).replace("|", "\\|")


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
        from omegaconf import OmegaConf

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
    from hydra.core.override_parser.overrides_parser import OverridesParser

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


def _refuse_swept_executor_keys(config: DictConfig) -> None:
    """hydra-submitit-launcher makes one executor (nodes, tasks, GPUs, CPUs, time limit, partition) for the whole
    sweep from the sweep-level config: a swept ``launcher.*`` key (Hydra refuses ``hydra.*`` ones) would run every
    job with the sweep's value while each job's report row and hparams said its own. Raises ConfigError naming the
    key."""
    from hydra.core.override_parser.overrides_parser import OverridesParser


    for override in OverridesParser.create().parse_overrides([str(line) for line in config.hydra.overrides.task]):
        if override.is_sweep_override() and override.key_or_group.startswith("launcher."):
            # (a parsed line's): why the ignore below
            raise ConfigError(override.key_or_group, override.input_line.split("=", 1)[1],  # type: ignore[union-attr]
                              f"cannot be swept under launcher={config.launcher.name}: submitit sets one executor for "
                              "the whole sweep, so every job would run with the sweep's value while its report row "
                              "said its own; run one sweep per value (launcher=torchrun and ray take it per job)")


def _refuse_a_stored_study_over_its_job_dirs(hc: Any) -> None:
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


def _job_dir(hc: Any) -> Path:
    """This job's run dir (``hydra.runtime.output_dir``), made absolute the same way as :func:`_sweep_dir`."""
    return resolve_path(str(hc.runtime.output_dir), Path(str(hc.runtime.cwd)))


def _is_rank0() -> bool:
    return env_rank() == 0


#: launchers (``hydra.launcher._target_``) that take a SIGTERM recorded between jobs: Hydra's basic launcher (jobs
#: in this process: the next job's guard raises it) and the torchrun plugin (raised before it starts the workers)
_TAKE_EARLY_SIGTERM = ("BasicLauncher", "hydratrain_launcher.torchrun_launcher.TorchrunLauncher")


def keep_early_sigterm(hydra_cfg: DictConfig, save_on_sigterm: bool) -> None:
    """Between the jobs of a sweep, SIGTERM is recorded, as :func:`hydratrain.checkpoint.preemption.early_guard`
    does before the first composition, instead of killing the sweep with 143 and nothing said while Hydra composes
    the next job (seconds on a loaded machine); the next job then ends the sweep as preempted: its guard when it runs
    in this process (Hydra's basic launcher; Optuna's sweeper uses it too), the torchrun plugin before it starts the
    job's workers. Called at the sweep's start and when each job's ``hydratrain.run.main`` ends; not with
    ``checkpoint.save_on_sigterm=false`` (the default action stays), nor for other launchers (Ray, submitit: their
    own handling)."""
    target = str(hydra_cfg.get("launcher", {}).get("_target_"))
    if save_on_sigterm and any(t in target for t in _TAKE_EARLY_SIGTERM):
        early_guard()


class SweepReportCallback(Callback):
    """Hydra callback: on multirun start, check the ``launcher`` keys (a SLURM GPU/task mismatch, or no ``sbatch``
    here, fails before anything is submitted); after each job (rank 0, or the launcher process for a job whose
    workers failed), record its status and refresh the report; at multirun end, refresh it, log where it is, and exit
    with status 1 when any job failed (a sweeper that tolerates failed trials, like the Optuna preset, otherwise exits
    0). A sweep that Hydra's sweeper ends by raising a failed job's error gets the same report and line when the
    sweeping process exits (:func:`await_the_end`). In a single run it only probes the run dir before Hydra makes it
    (:meth:`on_run_start`)."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        """A single run, every rank: a run dir that takes no writes ends the launch with one line and exit status 3
        (``SystemExit``) before Hydra makes it and opens the log file there
        (:func:`hydratrain.dist.run_dir.refuse_an_unwritable_run_dir`)."""
        composing(False)  # composed: Hydra reports its own errors again (hydratrain.exits)
        refuse_an_unwritable_run_dir(config)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        composing(False)  # composed: Hydra reports its own errors again (hydratrain.exits)
        early = take_early_signal()  # a SIGTERM while Hydra composed the sweep: no job has started
        if early is not None and not config.get("checkpoint", {}).get("save_on_sigterm", True):
            os.kill(os.getpid(), early)  # SIGTERM's default, as checkpoint.save_on_sigterm=false asks
        if early is not None:
            code = config.get("checkpoint", {}).get("preempt_exit_code", 75)
            if _is_rank0():  # (a sweep inside each torchrun rank: one line; nothing to resume: no dir to name)
                say("hydratrain: preempted: SIGTERM before the sweep's first job: nothing started; relaunch the "
                    "same command")
            raise SystemExit(code if isinstance(code, int) else 75)
        self._one_run = launched_as_one_run(config.hydra)
        try:
            _refuse_a_run_dir(config.hydra)
        except ConfigError as err:
            if _is_rank0():
                say(f"hydratrain: config error: {err}")
                discard_reserved_unused()
            raise SystemExit(EXIT_CONFIG) from None
        if "launcher" in config or config.hydra.get("sweeper", {}).get("storage"):
            try:
                _refuse_a_stored_study_over_its_job_dirs(config.hydra)
                if "launcher" in config:
                    validate_launcher(config.launcher, submitting=True)
                    if config.launcher.get("name") in ("slurm", "submitit_local"):
                        _check_before_submitting(config)
                        _refuse_swept_executor_keys(config)
            except ConfigError as err:
                if _is_rank0():
                    say(f"hydratrain: config error: {err}")
                    discard_reserved_unused(_LEFT_BY_A_REFUSED_JOB)  # (the dirs this launch made)
                elif os.environ.get("TORCHELASTIC_RUN_ID"):
                    time.sleep(10)  # the same error on every rank: rank 0 says it and leaves first (root cause)
                raise SystemExit(EXIT_CONFIG) from None
        if _is_rank0() and ("launcher" not in config or config.launcher.get("node_rank", 0) == 0):
            refuse_a_full_run_dir(_sweep_dir(config.hydra), sweep=True)

            note_launcher()  # (a sweep inside each torchrun rank: its command is torchrun's)
            mark_multirun(_sweep_dir(config.hydra), sampled_keys(config.hydra), launch_command())
            self._jobs = basic_sweep_jobs(config.hydra), os.getpid()  # (a launcher's workers get a copy of self)
            await_the_end(_sweep_dir(config.hydra))
        keep_early_sigterm(config.hydra, config.get("checkpoint", {}).get("save_on_sigterm", True))

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._job_started = time.time()

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:

        hc = config.hydra if "hydra" in config else HydraConfig.get()
        if hc.mode != RunMode.MULTIRUN or not _is_rank0():
            return
        job_dir = _job_dir(hc)
        job_dir.mkdir(parents=True, exist_ok=True)
        error = ""
        if job_return.status.name == "FAILED":
            error = f"{type(job_return._return_value).__name__}: {job_return._return_value}".splitlines()[0]
        sweep_dir = _sweep_dir(hc)
        results = _read_json(job_dir / "results.json")
        started = getattr(self, "_job_started", None)  # None: the launcher's process, for a job its workers failed
        try:
            current = bool(results) and (job_return.status.name == "COMPLETED" if started is None else
                                         (job_dir / "results.json").stat().st_mtime >= started)
        except OSError:
            current = False
        refused = job_return.status.name == "FAILED" and refused_the_dir(job_return._return_value)
        multirun = _read_json(sweep_dir / MULTIRUN_MARK).get("id")
        if not (started is None and _refused_by_its_rank0(job_dir, hc.job.num, multirun)):
            write_job_status(job_dir, hc.job.num, list(hc.overrides.task), job_return.status.name, error,
                             results.get("seconds", math.nan) if current and not refused else math.nan,
                             multirun, current and not refused, refused)
        write_sweep_report(sweep_dir)
        if job_return.status.name == "FAILED":
            if getattr(job_return._return_value, "ends_the_sweep", False):
                sweep_ended()  # a signal to the torchrun launcher's process: its own line and status end the sweep
                if getattr(self, "_one_run", False) and started is None:
                    end_one_run_by_signal(job_return._return_value)  # ... or, for one run, the run's
                return
            if getattr(self, "_one_run", False):
                if started is None:  # the launcher's process, after the workers (which said their error) are gone
                    sweep_ended()
                    end_one_run(job_return._return_value, sweep_dir)
                return
            if started is not None:  # (the launcher's process: the torchrun and Ray plugins log the failure there)
                log.warning("job #%d failed: %s (the sweep goes on; %s)", hc.job.num, error,
                            sweep_dir / "sweep_report.md")
            why = _hopeless(hc, job_return._return_value, sweep_rows(sweep_dir), launching=started is None,
                            config=config)
            if why:
                sweep_ended()
                raise SystemExit(f"hydratrain: sweep stopped after job {hc.job.num}: {why} (see "
                                 f"{sweep_dir / 'sweep_report.md'})")
        if (hc.job.num + 1, os.getpid()) == getattr(self, "_jobs", None) and any(r["status"] == "FAILED"
                                                                                  for r in sweep_rows(sweep_dir)):
            # Hydra's basic sweeper raises the first failure after the last job, so on_multirun_end would not run:
            # the report and the closing line come now, and last (not Hydra's hint)

            take_early_signal()  # as on_multirun_end: every job has ended
            _end_of_sweep(sweep_dir)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        take_early_signal()  # a SIGTERM after the last job: every job has ended; the report is still written
        if not _is_rank0() or ("launcher" in config and config.launcher.get("node_rank", 0) != 0):
            return
        _end_of_sweep(_sweep_dir(config.hydra))


def launched_as_one_run(hydra_cfg: DictConfig) -> bool:
    """Whether this multirun is one run that the torchrun launcher made a sweep of one job (``launcher=torchrun``
    sets ``hydra.mode: MULTIRUN``), not a sweep the command line asked for: no ``-m`` / ``--multirun`` and one job.
    Such a run ends as a run does: its error's one line and exit status (:func:`end_one_run`), no sweep report on
    the console. (Ray's and submitit's launchers report a job's failure in their own ways: their runs end as
    sweeps.)"""
    import sys

    from hydra._internal.utils import get_args_parser

    if not str(hydra_cfg.launcher.get("_target_", "")).endswith(".TorchrunLauncher"):
        return False
    try:
        args = get_args_parser().parse_args(sys.argv[1:])
    except SystemExit:
        return False
    return not args.multirun and basic_sweep_jobs(hydra_cfg) == 1


def end_one_run(err: BaseException, sweep_dir: Path) -> None:
    """End the launch of one run (:func:`launched_as_one_run`) whose job failed with ``err``, in the launcher's
    process: raise ``SystemExit`` with the status the run would have had under plain ``torchrun`` or one process
    (the failed worker's exit status; 128 + the signal that killed it; a config error found before the workers
    started: 2, :data:`hydratrain.errors.EXIT_CONFIG`), after the error's one line unless a worker has said it. A
    config error leaves no dir behind, as in a run: ``sweep_dir``, when this launch made it and it holds only the
    sweep's records of the refused job, is removed."""
    code = getattr(err, "exitcode", None)
    if isinstance(code, int):
        status = code if code > 0 else 128 - code
        if not getattr(err, "said_by_worker", False):
            say(f"hydratrain: {err}")
    elif isinstance(err, HydratrainError):
        status = err.exit_status
        say(f"hydratrain: {err.label}: {err}")
    elif type(err).__name__ == "LauncherConfigError":  # (the plugin's own: it knows no app)
        status = EXIT_CONFIG
        say(f"hydratrain: config error: {err}")
    else:
        status = EXIT_ERROR
        say(f"hydratrain: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
    if status == EXIT_CONFIG and code is None:
        discard_if_unused(sweep_dir, left=_LEFT_BY_A_REFUSED_JOB)
    raise SystemExit(status)


def end_one_run_by_signal(err: BaseException) -> None:
    """End one run (:func:`launched_as_one_run`) that a signal to the launcher's process stopped (``err``: the
    launcher's error for it): its workers said the run's line (interrupted, preempted: with the command that
    resumes) when they had started, so nothing more is said; before them, one line. Raises ``SystemExit`` with the
    signal's status."""
    status = getattr(err, "exitcode", None)
    if not isinstance(status, int):
        return  # (not the torchrun launcher's: its own line)
    if not getattr(err, "said_by_worker", False):
        kind = "preempted" if getattr(err, "signal_name", "") == "SIGTERM" else "interrupted"
        say(f"hydratrain: {kind}: {getattr(err, 'signal_name', 'a signal')} before the run's workers started: "
            f"nothing was trained; to go on: {getattr(err, 'resume', 'the same command')}")
    raise SystemExit(status)


#: what a sweep of one job refused before its workers started leaves in its sweep dir (and the job's sub-dir)
_LEFT_BY_A_REFUSED_JOB = ("multirun.yaml", "sweep_report.csv", "sweep_report.md", MULTIRUN_MARK, "status.json")


def _refuse_a_run_dir(hydra_cfg: DictConfig) -> None:
    """A multirun puts each job in ``hydra.sweep.dir`` / ``hydra.sweep.subdir``; Hydra ignores a ``hydra.run.dir``
    given on the command line, so the run would land elsewhere than asked. Raises ConfigError on that key, naming
    the key that does it."""
    from hydra.core.override_parser.overrides_parser import OverridesParser


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


def _end_of_sweep(sweep_dir: Path) -> None:
    """Refresh the report and log it; exit with status 1 and one line when any job failed."""
    sweep_ended()
    _log_report(sweep_dir)
    line = _closing_line(sweep_dir)
    if line:
        raise SystemExit(line)


def _log_report(sweep_dir: Path) -> None:
    """Refresh the report and log it (the table, on the console in the sweeping process)."""
    path = write_sweep_report(sweep_dir)
    if path:
        log.info("sweep report: %s\n%s", path, path.with_suffix(".md").read_text())


def _closing_line(sweep_dir: Path) -> str:
    """``hydratrain: N of M sweep job(s) failed (see .../sweep_report.md); first: job ...``, or '' when none
    failed."""
    rows = sweep_rows(sweep_dir)
    failed = [r for r in rows if r["status"] == "FAILED"]
    if not failed:
        return ""
    first = failed[0]
    return (f"hydratrain: {len(failed)} of {len(rows)} sweep job(s) failed (see {sweep_dir / 'sweep_report.md'}); "
            f"first: job {first['job']} ({first['overrides']}): {first['error']}")


#: the sweep this process launched and whose end is still to be said: {"pid": ..., "sweep_dir": Path}; "hooked":
#: whether :func:`end_of_process` is registered with ``atexit`` (once per process)
_AWAITED: dict = {}


def await_the_end(sweep_dir: Path) -> None:
    """Make sure that a sweep with a failed job ends with its report and the closing line (:func:`_end_of_sweep`)
    whatever launcher ran its jobs. Called once per multirun by the sweeping process (``on_multirun_start``, rank 0 of
    node 0); :func:`sweep_ended` takes it back on every way a sweep ends with a line of ours (the closing line after
    the last job or in ``on_multirun_end``, a search stopped early, a preemption or Ctrl-C that stopped a job), and
    :func:`end_of_process`, an ``atexit`` hook, says the end for a sweep that ended otherwise.

    Why at the exit of this process: with Hydra's basic sweeper, a sweep whose jobs include a failure ends with the
    sweeper raising the first failure once the launcher has returned, so ``on_multirun_end`` never runs; and when
    the jobs run in other processes nothing of ours runs in this one after the last job: the torchrun and Ray
    plugins call ``on_job_end`` here only for a job that failed without its workers reporting it,
    hydra-submitit-launcher never (so no report and no closing line when the last job completed). The
    launchers' return is no place to hook either: hydra-submitit-launcher's is not ours, and the torchrun plugin
    knows no app. The exit of this process is the one point every launcher and sweeper reaches after the last job,
    and after Hydra has printed the failure, so the report and the line come last. An exit hook runs on
    ``sys.exit`` and on an uncaught exception; not when a signal kills the process or on ``os._exit`` (the workers
    that ``multiprocessing`` forks leave that way; the pid check is for such a copy). It cannot change the exit
    status, and need not: a sweeper that returns calls ``on_multirun_end``, which ends the sweep itself, so with a
    failed job this process only gets here through Hydra's error exit, status 1. A sweep ended by Ctrl-C outside any
    job (Python's ``KeyboardInterrupt`` traceback) is left as it is."""
    import atexit

    if not _AWAITED.get("hooked"):
        atexit.register(end_of_process)
        _AWAITED["hooked"] = True
    _AWAITED.update(pid=os.getpid(), sweep_dir=Path(sweep_dir))


def launched_sweep_dir() -> Optional[Path]:
    """The dir of the sweep this process launched and whose end is still to be said, or None."""
    return _AWAITED.get("sweep_dir") if _AWAITED.get("pid") == os.getpid() else None


def sweep_ended() -> None:
    """The sweep this process launched ended with a line of ours (or its own launcher's): nothing to add at exit."""
    _AWAITED.pop("sweep_dir", None)


def end_of_process() -> None:
    """At the exit of the sweeping process (``atexit``; see :func:`await_the_end`): when its sweep ended with no line
    of ours and its report has a FAILED row, log the report and print the closing line. Does nothing in another
    process (a forked copy), after Ctrl-C, or when :func:`sweep_ended` was called. Never raises."""
    import sys

    sweep_dir = _AWAITED.pop("sweep_dir", None)
    if sweep_dir is None or _AWAITED.get("pid") != os.getpid() or isinstance(getattr(sys, "last_value", None),
                                                                           KeyboardInterrupt):
        return
    try:
        take_early_signal()  # as on_multirun_end: every job has ended
        line = _closing_line(sweep_dir)
        if line:
            _log_report(sweep_dir)
            say(line)
    except Exception as err:  # noqa: BLE001 (the process is ending with its own status; one line, no traceback)
        say(f"hydratrain: could not write the sweep report in {sweep_dir}: {type(err).__name__}: {err}")


def basic_sweep_jobs(hydra_cfg: DictConfig) -> Optional[int]:
    """How many jobs Hydra's basic sweeper runs for this multirun (the product of the sweep overrides' and
    ``hydra.sweeper.params``' choices, keyed as its ``split_arguments`` keys them, the command line winning), or
    None for another sweeper, batches (``max_batch_size``: it stops at the first batch with a failure) or a sweep it
    cannot count (``glob``). A count below the real one would end the sweep early, so it follows the sweeper's own
    expansion."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    sweeper = hydra_cfg.get("sweeper") or {}
    if not str(sweeper.get("_target_", "")).endswith("BasicSweeper") or sweeper.get("max_batch_size"):
        return None
    params = [f"{k}={v}" for k, v in (sweeper.get("params") or {}).items()]
    try:
        overrides = OverridesParser.create().parse_overrides([*params, *hydra_cfg.overrides.task])
        counts = {o.get_key_element(): len(list(o.sweep_string_iterator())) if o.is_sweep_override() else 1
                  for o in overrides}
    except Exception:  # (a glob sweep, or anything the parser reads otherwise than the sweeper)
        return None
    return math.prod(counts.values())


def record_stopped_job(why: str) -> None:
    """Record this multirun job as FAILED with ``why`` in its ``status.json`` and refresh the sweep report (rank 0 of
    node 0), for a job that ends the whole sweep (a preemption signal, Ctrl-C) before Hydra's ``on_job_end`` runs.
    Its dir's ``results.json``, if any, is an earlier launch's. Does nothing outside a multirun."""

    if not _is_rank0() or not HydraConfig.initialized():
        return
    hc = HydraConfig.get()
    if hc.mode != RunMode.MULTIRUN:
        return
    sweep_ended()  # the caller's line ends the sweep
    sweep_dir = _sweep_dir(hc)
    job_dir = _job_dir(hc)
    write_job_status(job_dir, hc.job.num, list(hc.overrides.task), "FAILED", why, math.nan,
                     _read_json(sweep_dir / MULTIRUN_MARK).get("id"), results_current=False)
    write_sweep_report(sweep_dir)
