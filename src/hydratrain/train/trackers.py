"""Experiment trackers beside TensorBoard: MLflow, Weights & Biases and a CSV file (``logger=[...]``,
docs/tracking.md).

:class:`Trackers` is what the loop writes to (``StepLogger.trackers``): TensorBoard
(:class:`~hydratrain.metrics.TensorBoardLogger`, which keeps its purge and hparams rows) and the other chosen
trackers, each of which gets every scalar TensorBoard gets, at the same step. Rank 0 alone has trackers
(:func:`start_trackers` starts none elsewhere).

A :class:`Tracker` takes the run's parameters once (the flat config and the command-line overrides), the scalars of
each logged step, and a summary at the end (the figures results.json holds, ``objective`` among them, as
``final/<name>``); its ``id`` is kept in ``<run dir>/trackers.json``, so a resumed run continues the same tracker run.

A tracker that fails to start is a :class:`~hydratrain.errors.ConfigError` naming the key and value that chose where
it logs (``logger.mlflow.tracking_uri``, ``$MLFLOW_TRACKING_URI``, ``logger.wandb.mode``), before training; one that
fails later is one warning, and the run goes on without it. MLflow's HTTP retries are bounded so that either comes
in seconds (:attr:`MLflowTracker.HTTP_START`, :attr:`MLflowTracker.HTTP_RUN`).

Credentials: hydratrain reads none (each library reads its own variables: $WANDB_API_KEY, $MLFLOW_TRACKING_PASSWORD)
and logs no environment variable; a URI is logged with its ``user:password@`` removed (:func:`scrub`), and so is
every parameter value.
"""
from __future__ import annotations

import contextlib
import csv
import json
import logging
import math
import os
import re
import time
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Optional

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from hydratrain.errors import ConfigError
from hydratrain.metrics import TensorBoardLogger

log = logging.getLogger("hydratrain.trackers")

IDS_FILE = "trackers.json"  # {tracker: id} in the run dir, for a resume
_USERINFO = re.compile(r"(?<=://)[^/@\s]*@")  # the user:password@ of a URI


def scrub(text: str) -> str:
    """``text`` with the ``user:password@`` of every URI in it removed."""
    return _USERINFO.sub("", text)


def flat(node: Any, prefix: str = "") -> dict[str, str]:
    """``{"optim.lr": "0.001", ...}``: the leaves of a nested dict / list as strings (lists by index), scrubbed."""
    items: Iterable[tuple[Any, Any]] = node.items() if isinstance(node, dict) else enumerate(node)
    out: dict[str, str] = {}
    for key, value in items:
        name = f"{prefix}{key}"
        if isinstance(value, (dict, list)) and value:
            out.update(flat(value, name + "."))
        else:
            out[name] = scrub(str(value))
    return out


class Tracker:
    """One experiment tracker of rank 0. ``key``: its config key (in messages); ``id``: its run's id, kept for a
    resume (None: nothing to keep). The methods a tracker has nothing to do for are left as they are here."""

    key = "logger"
    name = "tracker"  # (in messages)
    where = ""  # where it logs (in the line that says it started), scrubbed
    id: Optional[str] = None

    def log_params(self, params: Mapping[str, str]) -> None:
        """The run's parameters, once per launch (a resumed run adds those it did not have)."""

    def start_at(self, step: int) -> None:
        """This launch logs the steps after ``step`` (0: a fresh start), as TensorBoard's purge point
        (:meth:`hydratrain.train.step_logger.StepLogger.start`)."""

    def log_metrics(self, step: int, values: Mapping[str, float]) -> None:
        raise NotImplementedError

    def log_summary(self, step: int, values: Mapping[str, float]) -> None:
        """The run's final figures (results.json's), at its last step."""

    def close(self, status: str) -> None:
        """``status``: ``finished``, ``failed`` or ``killed`` (preempted: a later launch resumes the run)."""


class Trackers:
    """TensorBoard (``tb``) and the other trackers of this rank: each scalar goes to all of them at the same step.
    A tracker that raises is dropped with one warning; TensorBoard's errors are the run's, as before."""

    def __init__(self, tb: TensorBoardLogger, others: Iterable[Tracker] = ()):
        self.tb, self.others = tb, list(others)

    def start_at(self, step: int) -> None:
        self._each("start_at", step)

    def scalars(self, values: Mapping[str, float], step: int) -> None:
        self.tb.scalars(values, step)
        self._each("log_metrics", step, {tag: float(value) for tag, value in values.items()})

    def text(self, tag: str, text: str, step: int) -> None:
        self.tb.text(tag, text, step)

    def hparams(self, hparams: Mapping[str, object], metrics: Mapping[str, float], step: int,
                summary: Optional[Mapping[str, float]] = None) -> Optional[Path]:
        """TensorBoard's hparams row; the others get ``summary`` (``metrics`` when None), finite values only."""
        row = self.tb.hparams(hparams, metrics, step)
        final = {k: float(v) for k, v in (metrics if summary is None else summary).items()
                 if isinstance(v, (int, float)) and math.isfinite(v)}
        self._each("log_summary", step, final)
        return row

    def flush(self) -> None:
        self.tb.flush()

    def close(self, status: str = "finished") -> None:
        """Close TensorBoard and end the trackers' runs with ``status`` (once: later calls close TensorBoard only)."""
        self.tb.close()
        others, self.others = self.others, []
        for tracker in others:
            try:
                tracker.close(status)
            except Exception as err:  # a tracker's failure costs a warning, never the run
                log.warning("%s: could not end its run (%s: %s)", tracker.key, type(err).__name__, scrub(str(err)))

    def _each(self, method: str, *args: Any) -> None:
        for tracker in list(self.others):
            try:
                getattr(tracker, method)(*args)
            except Exception as err:  # a tracker's failure costs a warning, never the run
                log.warning("%s failed (%s: %s); it logs nothing more in this run, which goes on", tracker.key,
                            type(err).__name__, scrub(str(err)))
                self.others.remove(tracker)


# ------------------------------------------------------------------------------------------------------ CSV
class CSVTracker(Tracker):
    """``<run dir>/metrics.csv``: a ``step`` column, then one column per tag in the order first logged; one row per
    logged step (the scalars of a log line, an evaluation and the end of the run at one step share a row). The file
    holds every value as soon as it is logged (a killed launch loses none): a row is appended, the last row rewritten
    in place when its step gets more values, and the whole file rewritten (atomically) when a new column appears or
    an earlier row changes, and at a resume, whose rows after the resume point go as TensorBoard's do."""

    key = "logger.csv"
    name = "CSV"

    def __init__(self, path: Path):
        self.path = path
        self.rows: dict[int, dict[str, float]] = {}
        self.columns: list[str] = []
        self._header: list[str] = []  # the columns of the file's header
        self._last: Optional[tuple[int, int]] = None  # (step, byte offset) of the file's last row
        self._rewrite = True  # the file does not hold the rows as they are: write it whole

    def start_at(self, step: int) -> None:
        if step > 0 and self.path.is_file():
            with self.path.open(newline="") as f:
                reader = csv.DictReader(f)
                self.columns = [c for c in reader.fieldnames or () if c != "step"]
                for line in reader:
                    if int(line["step"]) <= step:
                        self.rows[int(line["step"])] = {c: float(v) for c, v in line.items() if c != "step" and v}
        self._rewrite = True

    def log_metrics(self, step: int, values: Mapping[str, float]) -> None:
        self.rows.setdefault(step, {}).update(values)
        self.columns += [tag for tag in values if tag not in self.columns]
        last = self._last[0] if self._last else None
        if self._rewrite or self._header != self.columns or (last is not None and step < last):
            tmp = self.path.with_name(f".{self.path.name}.tmp{os.getpid()}")
            with tmp.open("w", newline="") as f:
                steps = sorted(self.rows)
                self._write(f, steps[:-1], header=True)
                self._last = (steps[-1], f.tell())
                self._write(f, steps[-1:])
            os.replace(tmp, self.path)
            self._header, self._rewrite = list(self.columns), False
            return
        with self.path.open("r+", newline="") as f:
            if step == last:  # (self._last is set: the file has rows)
                f.seek(self._last[1])  # type: ignore[index]
                f.truncate()
            else:
                f.seek(0, os.SEEK_END)
                self._last = (step, f.tell())
            self._write(f, [step])

    def _write(self, f, steps: list[int], header: bool = False) -> None:
        writer = csv.writer(f)
        if header:
            writer.writerow(["step", *self.columns])
        for step in steps:
            row = self.rows[step]
            writer.writerow([step, *(repr(row[c]) if c in row else "" for c in self.columns)])
        f.flush()


# --------------------------------------------------------------------------------------------------- MLflow
class MLflowTracker(Tracker):
    """A run of the MLflow tracking server or store at ``uri``, in experiment ``experiment`` (created when absent);
    ``run_id``: the run to continue (a resume). Scalars are metrics at their step, parameters are MLflow params
    (string values, at most 6000 characters; a resumed run logs those it lacks: MLflow refuses changing one), the
    summary metrics ``final/<name>``."""

    key = "logger.mlflow"
    name = "MLflow"
    _PARAMS, _METRICS, _VALUE = 100, 1000, 6000  # MLflow's limits: params and metrics per batch, a param's length
    #: MLflow's HTTP settings (mlflow.environment_variables, which MLflow reads at each request) for this tracker's
    #: requests, each one only where the environment sets none: MLflow's own (7 retries backing off over ~4 minutes,
    #: 120 s a try) held a run's start-up 263 s against a server that does not answer. Starting: one retry at once,
    #: 5 s a try, so a dead server is a ConfigError within seconds; later: two retries (the second ~2 s later),
    #: 10 s a try, so a server gone mid-run costs a short stall, then the one warning of a failed tracker.
    HTTP_START = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": 1, "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": 1,
                  "MLFLOW_HTTP_REQUEST_TIMEOUT": 5}
    HTTP_RUN = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": 2, "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": 1,
                "MLFLOW_HTTP_REQUEST_TIMEOUT": 10}

    def __init__(self, uri: str, experiment: str, run_id: Optional[str], name: str, tags: Mapping[str, str]):
        from mlflow.entities import Metric, Param  # (extra [mlflow]; ~2 s to import: only in a run that uses it)
        from mlflow.tracking import MlflowClient

        self._metric, self._param = Metric, Param
        self.where = scrub(uri)
        self.client = MlflowClient(tracking_uri=uri)
        with _mlflow_http(self.HTTP_START):
            self.run_id: str = self._start(experiment, run_id, name, tags)
        self.id = self.run_id

    def _start(self, experiment: str, run_id: Optional[str], name: str, tags: Mapping[str, str]) -> str:
        """The id of run ``run_id`` set running again, or of a new run ``name`` in ``experiment``."""
        if run_id is not None:
            self.client.update_run(run_id, status="RUNNING")
        else:
            found = self.client.get_experiment_by_name(experiment)
            if found is None:
                try:
                    exp_id = self.client.create_experiment(experiment)
                except Exception:  # another job of the sweep created it just now
                    found = self.client.get_experiment_by_name(experiment)
                    if found is None:
                        raise
                    exp_id = found.experiment_id
            else:
                exp_id = found.experiment_id
            run_id = self.client.create_run(exp_id, run_name=name, tags=dict(tags)).info.run_id
        return run_id

    def log_params(self, params: Mapping[str, str]) -> None:
        with _mlflow_http(self.HTTP_RUN):
            have = self.client.get_run(self.run_id).data.params
            new = [self._param(k, v[:self._VALUE]) for k, v in params.items() if k not in have and len(k) <= 250]
            for i in range(0, len(new), self._PARAMS):
                self.client.log_batch(self.run_id, params=new[i:i + self._PARAMS])

    def log_metrics(self, step: int, values: Mapping[str, float]) -> None:
        now = int(time.time() * 1000)
        metrics = [self._metric(tag, value, now, step) for tag, value in values.items()]
        with _mlflow_http(self.HTTP_RUN):
            for i in range(0, len(metrics), self._METRICS):
                self.client.log_batch(self.run_id, metrics=metrics[i:i + self._METRICS])

    def log_summary(self, step: int, values: Mapping[str, float]) -> None:
        self.log_metrics(step, {f"final/{name}": value for name, value in values.items()})

    def close(self, status: str) -> None:
        with _mlflow_http(self.HTTP_RUN):
            self.client.set_terminated(self.run_id, status=status.upper())


@contextlib.contextmanager
def _mlflow_http(settings: Mapping[str, int]) -> Iterator[None]:
    """MLflow's HTTP environment variables ``settings`` ({name: value}) for the requests made inside, each one that
    the environment does not set already (a value the user set is theirs), and unset again after. urllib3's
    "Retrying ..." warnings are held back meanwhile: the retries are these bounded ones, and a request that still
    fails is one error (start-up) or one warning (later) of hydratrain's."""
    from mlflow import environment_variables  # (loaded with mlflow: only in a run that uses it)

    added = [var for var in (getattr(environment_variables, name) for name in settings) if not var.is_set()]
    for var in added:
        var.set(settings[var.name])
    pool = logging.getLogger("urllib3.connectionpool")
    pool.addFilter(_no_retry_warnings)
    try:
        yield
    finally:
        pool.removeFilter(_no_retry_warnings)
        for var in added:
            var.unset()


def _no_retry_warnings(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("Retrying")


# ------------------------------------------------------------------------------------------- Weights & Biases
class WandbTracker(Tracker):
    """A W&B run with its files under ``<run dir>/wandb`` (``mode=offline``: no network, no account; ``wandb sync``
    uploads them); ``run_id``: the run to continue (a resume, ``resume="allow"``). Scalars are logged at their step
    (W&B drops a step below one it has, so the steps a killed launch logged after its last checkpoint stay as that
    launch logged them), parameters are the run's config, the summary ``final/<name>``."""

    key = "logger.wandb"
    name = "W&B"

    def __init__(self, node: DictConfig, run_dir: Path, run_id: Optional[str], name: str, group: Optional[str]):
        import wandb  # (extra [wandb]: only in a run that uses it)

        # console="off": the log lines are in the run dir already; silent: hydratrain says where the run is
        self.run = wandb.init(project=node.project, entity=node.entity, group=node.group or group,
                              tags=list(node.tags) or None, name=name, dir=str(run_dir), mode=node.mode.value,
                              id=run_id, resume="allow" if run_id else None,
                              settings=wandb.Settings(silent=True, console="off"))
        self.id, self.where = self.run.id, f"mode {node.mode}"

    def log_params(self, params: Mapping[str, str]) -> None:
        self.run.config.update(dict(params), allow_val_change=True)

    def log_metrics(self, step: int, values: Mapping[str, float]) -> None:
        self.run.log(dict(values), step=step)

    def log_summary(self, step: int, values: Mapping[str, float]) -> None:
        self.run.summary.update({f"final/{name}": value for name, value in values.items()})

    def close(self, status: str) -> None:
        self.run.finish(exit_code=0 if status == "finished" else 1)


# ---------------------------------------------------------------------------------------------------- start
def start_trackers(cfg: DictConfig, run_dir: Path, output_dir: Path, resuming: bool) -> list[Tracker]:
    """Rank 0's chosen trackers (TensorBoard aside), started, with the run's parameters logged: MLflow and W&B
    continue the runs ``<run dir>/trackers.json`` names when ``resuming``, and their ids are written there. Raises
    :class:`ConfigError` naming the key of a tracker that fails to start."""
    node = cfg.logger
    ids = _read_ids(run_dir) if resuming else {}
    overrides, sweep_dir = _hydra_job()
    name = _relative(run_dir, output_dir)
    group = _relative(sweep_dir, output_dir) if sweep_dir is not None else None
    params = flat(OmegaConf.to_container(cfg, resolve=True, enum_to_str=True))
    params["overrides"] = scrub(" ".join(overrides))
    started: list[tuple[Tracker, str, Any]] = []  # (tracker, the key and value that chose where it logs)
    if node.csv:
        started.append((CSVTracker(run_dir / "metrics.csv"), "logger.csv", True))
    if node.mlflow.enabled:
        key, value, uri = _mlflow_uri(node.mlflow.tracking_uri, output_dir)
        where = f" (its local store {uri})" if value is None else ""
        started.append(_started(MLflowTracker, key, value, where, "", uri, node.mlflow.experiment, ids.get("mlflow"),
                                name, {"sweep": group} if group else {}))
    if node.wandb.enabled:
        mode = node.wandb.mode
        hint = "" if mode == "offline" else "; allowed: online, offline (logger.wandb.mode=offline needs no " \
            "account or network: `wandb sync` uploads its run later)"
        started.append(_started(WandbTracker, "logger.wandb.mode", mode, "", hint, node.wandb, run_dir,
                                ids.get("wandb"), name, group))
    for tracker, key, value in started:
        try:
            tracker.log_params(params)
        except Exception as err:
            raise ConfigError(key, _shown(value), f"{tracker.name} could not log the run's parameters: "
                              f"{_error(err)}") from None
    trackers = [tracker for tracker, _, _ in started]
    kept = {t.key.removeprefix("logger."): t.id for t in trackers if t.id is not None}
    if kept:
        _write_ids(run_dir, {**ids, **kept})
    return trackers


def _started(kind, key: str, value: Any, where: str, hint: str, *args) -> tuple[Tracker, str, Any]:
    """(``kind(*args)``, ``key``, ``value``): the tracker started, with the config key (or environment variable) and
    value that chose where it logs. Raises :class:`ConfigError` ``key=value`` when it does not start: ``where`` and
    ``hint`` follow the tracker's error."""
    try:
        tracker = kind(*args)
    except Exception as err:
        raise ConfigError(key, _shown(value), f"{kind.name} did not start{where}: {_error(err)}{hint}") from None
    log.info("%s: run %s (%s)", tracker.key, tracker.id, tracker.where)
    return tracker, key, value


def _mlflow_uri(tracking_uri: Optional[str], output_dir: Path) -> tuple[str, Optional[str], str]:
    """(the key that chose MLflow's store, its value, the store's URI): ``logger.mlflow.tracking_uri`` when set, else
    ``$MLFLOW_TRACKING_URI`` when set, else ``logger.mlflow.tracking_uri=None`` and the local store
    (:func:`_local_store`)."""
    if tracking_uri:
        return "logger.mlflow.tracking_uri", tracking_uri, tracking_uri
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return "$MLFLOW_TRACKING_URI", os.environ["MLFLOW_TRACKING_URI"], os.environ["MLFLOW_TRACKING_URI"]
    return "logger.mlflow.tracking_uri", None, _local_store(output_dir)


def _shown(value: Any) -> Any:
    """``value`` for a message: a string scrubbed of credentials, anything else (an option, None) as it is."""
    return scrub(value) if type(value) is str else value


def _error(err: BaseException) -> str:
    """``<type>: <message>`` of ``err`` on one line, scrubbed of credentials."""
    return f"{type(err).__name__}: {' '.join(scrub(str(err)).split())}"


def _local_store(output_dir: Path) -> str:
    """MLflow's default store: ``sqlite:///<output_dir>/mlruns/mlflow.db`` (MLflow 3 refuses a plain ``mlruns/``
    file store), shared by the runs and sweeps under ``output_dir``, so ``mlflow ui`` compares them."""
    store = output_dir / "mlruns"
    store.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{(store / 'mlflow.db').resolve()}"


def _hydra_job() -> tuple[list[str], Optional[Path]]:
    """(the job's command-line overrides, its sweep dir in a multirun) from Hydra, or ``([], None)`` outside it."""
    if not HydraConfig.initialized():
        return [], None
    hydra = HydraConfig.get()
    sweep = Path(str(hydra.sweep.dir)) if hydra.mode == RunMode.MULTIRUN else None
    return list(hydra.overrides.task), sweep


def _relative(path: Path, base: Path) -> str:
    path, base = Path(path).resolve(), Path(base).resolve()
    return str(path.relative_to(base)) if path.is_relative_to(base) else str(path)


def _read_ids(run_dir: Path) -> dict[str, str]:
    try:
        return dict(json.loads((run_dir / IDS_FILE).read_text()))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as err:
        log.warning("%s unreadable (%s): the trackers start new runs", run_dir / IDS_FILE, err)
        return {}


def _write_ids(run_dir: Path, ids: Mapping[str, str]) -> None:
    tmp = run_dir / f".{IDS_FILE}.tmp{os.getpid()}"
    tmp.write_text(json.dumps(dict(ids), indent=1) + "\n")
    os.replace(tmp, run_dir / IDS_FILE)
