"""The trackers beside TensorBoard (hydratrain.train.trackers): each one fed the stream a StepLogger sends (a log
line's scalars, an evaluation at the same step, the end of the run's summary) and read back with its own reader;
config composition and checks of ``logger=[...]``. The runs on 2 ranks are in tests/e2e/test_trackers_runs.py."""
from __future__ import annotations

import csv
import importlib.util
import logging
import os
import socket
import time

import pytest

from hydratrain.config.validate import validate
from hydratrain.errors import ConfigError
from hydratrain.metrics import TensorBoardLogger
from hydratrain.train.trackers import CSVTracker, Tracker, Trackers, flat, scrub, start_trackers

# what a StepLogger sends: log lines at steps 1, 2 (timed: perf/), an eval at 2, a callback's scalar at 2
STREAM = [(1, {"train/loss": 5.5, "train/lr": 1e-4, "mem/peak": 1000.0}),
          (2, {"train/loss": 5.25, "train/lr": 2e-4, "mem/peak": 1024.0, "perf/tokens_per_sec": 900.5}),
          (2, {"eval/loss": 5.125, "eval/perplexity": 168.2}),
          (3, {"train/loss": 5.0, "train/lr": 3e-4, "mem/peak": 1024.0, "perf/tokens_per_sec": 910.25})]


def feed(tracker: Tracker, stream=STREAM) -> None:
    for step, values in stream:
        tracker.log_metrics(step, values)


def expected(stream=STREAM) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    for step, values in stream:
        out.setdefault(step, {}).update(values)
    return out


def read_csv(path) -> dict[int, dict[str, float]]:
    with path.open(newline="") as f:
        return {int(r.pop("step")): {k: float(v) for k, v in r.items() if v} for r in csv.DictReader(f)}


def test_csv_one_row_per_step_and_a_resume_drops_the_rows_after_its_step(tmp_path):
    path = tmp_path / "metrics.csv"
    tracker = CSVTracker(path)
    tracker.start_at(0)
    for n, (step, values) in enumerate(STREAM):  # each value is in the file once logged (a SIGKILL loses none)
        tracker.log_metrics(step, values)
        assert read_csv(path) == expected(STREAM[:n + 1])
    assert path.read_text().splitlines()[0] == "step,train/loss,train/lr,mem/peak,perf/tokens_per_sec,eval/loss," \
                                               "eval/perplexity"
    resumed = CSVTracker(path)  # a relaunch resumed from step 2's checkpoint: step 3 is trained again
    resumed.start_at(2)
    resumed.log_metrics(3, {"train/loss": 4.75, "test/loss": 4.5})
    resumed.close("finished")
    assert read_csv(path) == {**{k: v for k, v in expected().items() if k <= 2}, 3: {"train/loss": 4.75,
                                                                                      "test/loss": 4.5}}
    fresh = CSVTracker(path)  # a fresh start into the same run dir (step 0) replaces the file
    fresh.start_at(0)
    fresh.log_metrics(1, {"train/loss": 1.0})
    fresh.close("finished")
    assert read_csv(path) == {1: {"train/loss": 1.0}}


class Broken(Tracker):
    key = "logger.broken"

    def __init__(self):
        self.calls = 0

    def log_metrics(self, step, values):
        self.calls += 1
        raise ConnectionError("http://alice:hunter2@tracker.example/ is unreachable")


def test_a_tracker_failing_mid_run_costs_one_warning_and_the_others_go_on(tmp_path, caplog):
    broken, kept = Broken(), CSVTracker(tmp_path / "metrics.csv")
    trackers = Trackers(TensorBoardLogger(tmp_path / "tb", enabled=False), [broken, kept])
    with caplog.at_level(logging.WARNING, logger="hydratrain.trackers"):
        for step, values in STREAM:
            trackers.scalars(values, step)
        trackers.close()
    assert broken.calls == 1 and read_csv(tmp_path / "metrics.csv") == expected()
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("logger.broken failed (ConnectionError: ") and "hunter2" not in line


def test_credentials_are_scrubbed_from_uris_and_parameters():
    assert scrub("sqlite:///x.db and https://bob:s3cret@mlflow.example:5000/api") == \
        "sqlite:///x.db and https://mlflow.example:5000/api"
    assert flat({"a": {"b": [1, "https://u:p@h/"], "c": None, "d": []}}) == \
        {"a.b.0": "1", "a.b.1": "https://h/", "a.c": "None", "a.d": "[]"}


def test_logger_options_compose_as_a_list(compose):
    cfg = compose(["logger=[tensorboard,mlflow,csv]"])
    assert cfg.logger.tensorboard and cfg.logger.csv and cfg.logger.mlflow.enabled and not cfg.logger.wandb.enabled
    alone = compose(["logger=wandb", "logger.wandb.mode=offline"])  # TensorBoard stays on unless turned off
    assert alone.logger.tensorboard and alone.logger.wandb.enabled and not alone.logger.csv
    # a list leaves the group out of Hydra's choices, as ~logger does: not taken for a removed group
    validate(compose(["logger=[tensorboard,csv]"], return_hydra_config=True))
    with pytest.raises(ConfigError, match="removed with ~logger"):
        validate(compose(["~logger"], return_hydra_config=True))


def test_a_missing_extra_and_a_password_in_the_uri_are_one_line_before_any_run(cli, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    r = cli(["logger=[tensorboard,mlflow]"])
    assert r.returncode == 2 and "logger='mlflow': needs the mlflow package: pip install 'hydratrain[mlflow]'" in r.err
    monkeypatch.setattr(importlib.util, "find_spec", real)
    r = cli(["logger=mlflow", "logger.mlflow.tracking_uri=https://alice:hunter2@mlflow.example"])
    assert r.returncode == 2 and "logger.mlflow.tracking_uri=" in r.err and "hunter2" not in r.output


def test_mlflow_run_holds_the_stream_params_and_summary_and_a_resume_continues_it(tmp_path):
    pytest.importorskip("mlflow", reason="logger=mlflow needs the extra: pip install 'hydratrain[mlflow]'")
    from mlflow.tracking import MlflowClient

    from hydratrain.train.trackers import MLflowTracker, _local_store

    uri = _local_store(tmp_path)
    tracker = MLflowTracker(uri, "tests", None, "outputs/run", {"sweep": "multirun/s"})
    tracker.log_params({"optim.lr": "0.001", "overrides": "optim.lr=1e-3"})
    feed(tracker, STREAM[:2])
    tracker.close("killed")
    again = MLflowTracker(uri, "tests", tracker.id, "outputs/run", {})
    again.log_params({"optim.lr": "0.001", "checkpoint.resume_from": "x"})  # a new key is added, the rest kept
    feed(again, STREAM[2:])
    again.log_summary(3, {"objective": 5.125})
    again.close("finished")
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("tests").experiment_id])
    assert run.info.run_id == tracker.id and run.info.status == "FINISHED" and run.info.run_name == "outputs/run"
    assert run.data.params == {"optim.lr": "0.001", "overrides": "optim.lr=1e-3", "checkpoint.resume_from": "x"}
    assert run.data.tags["sweep"] == "multirun/s" and run.data.metrics["final/objective"] == 5.125
    got: dict[int, dict[str, float]] = {}
    for tag in {t for _, values in STREAM for t in values}:
        for m in client.get_metric_history(run.info.run_id, tag):
            got.setdefault(m.step, {})[tag] = m.value
    assert got == expected()


@pytest.mark.slow  # a sweep of 2 jobs in this process
def test_each_sweep_job_is_an_mlflow_run_grouped_by_the_sweep_and_the_report_draws_them(cli, tmp_path):
    """Issue 38's sweep: one tracker run per job, grouped by the sweep, with its overrides and objective; the report's
    chart of the same jobs is a valid image."""
    pytest.importorskip("mlflow", reason="logger=mlflow needs the extra: pip install 'hydratrain[mlflow]'")
    from mlflow.tracking import MlflowClient

    sweep_dir = tmp_path / "multirun" / "lr"
    r = cli(["-m", "strategy=single", "trainer.max_steps=2", "optim.lr=1e-3,2e-3", "logger=[tensorboard,mlflow]",
             f"paths.output_dir={tmp_path}", f"hydra.sweep.dir={sweep_dir}"])
    assert r.returncode == 0, r.output
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("hydratrain").experiment_id], "tags.sweep = 'multirun/lr'")
    assert sorted(run.info.run_name for run in runs) == ["multirun/lr/0", "multirun/lr/1"]
    assert sorted(run.data.params["optim.lr"] for run in runs) == ["0.001", "0.002"]
    assert all("optim.lr=" in run.data.params["overrides"] and "final/objective" in run.data.metrics for run in runs)
    if importlib.util.find_spec("matplotlib") is not None:  # (the [report] extra draws the chart)
        from matplotlib.image import imread

        image = imread(sweep_dir / "sweep_report.png")
        assert image.shape[0] > 100 and image.shape[1] > 100
        assert "sweep_report.png" in (sweep_dir / "sweep_report.md").read_text()


def test_a_tracker_that_fails_to_start_is_one_line_naming_its_key(compose, tmp_path, monkeypatch):
    pytest.importorskip("mlflow", reason="logger=mlflow needs the extra: pip install 'hydratrain[mlflow]'")
    cfg = compose(["logger=[tensorboard,csv,mlflow]", "logger.mlflow.tracking_uri=nosuchstore://u:hunter2@host/x"])
    with pytest.raises(ConfigError) as err:
        start_trackers(cfg, tmp_path, tmp_path, resuming=False)
    assert str(err.value).startswith("logger.mlflow.tracking_uri='nosuchstore://host/x': MLflow did not start: ")
    assert "\n" not in str(err.value) and "hunter2" not in str(err.value)
    assert not (tmp_path / "trackers.json").exists()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "nosuchstore://u:hunter2@host/y")  # the URI from the environment
    with pytest.raises(ConfigError) as err:
        start_trackers(compose(["logger=[tensorboard,mlflow]"]), tmp_path, tmp_path, resuming=False)
    assert str(err.value).startswith("$MLFLOW_TRACKING_URI='nosuchstore://host/y': MLflow did not start: ")
    assert "\n" not in str(err.value) and "hunter2" not in str(err.value)


def closed_port() -> int:
    """A local TCP port nothing listens on (bound, then closed): a connection to it is refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


HTTP_VARS = ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "MLFLOW_HTTP_REQUEST_TIMEOUT")


@pytest.fixture
def mlflow_requests(monkeypatch):
    """(max_retries, backoff_factor, timeout) of each HTTP request MLflow makes, which then goes out as it would;
    none of MLflow's HTTP variables is set (a test sets its own)."""
    pytest.importorskip("mlflow", reason="logger=mlflow needs the extra: pip install 'hydratrain[mlflow]'")
    from mlflow.utils import rest_utils

    for name in (*HTTP_VARS, "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(name, raising=False)
    seen = []
    real = rest_utils._get_http_response_with_retries

    def spy(method, url, max_retries, backoff_factor, *args, **kwargs):
        seen.append((max_retries, backoff_factor, kwargs["timeout"]))
        return real(method, url, max_retries, backoff_factor, *args, **kwargs)

    monkeypatch.setattr(rest_utils, "_get_http_response_with_retries", spy)
    return seen


def test_an_mlflow_server_that_does_not_answer_stops_the_start_in_seconds_and_the_users_settings_hold(
        compose, tmp_path, monkeypatch, mlflow_requests, caplog):
    """MLflow's own retries (7, backing off over ~4 minutes) held the start 263 s before the config error: now one
    retry, at once, and a short timeout, except where the user set MLflow's variable (the timeout here)."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "3")
    uri = f"http://127.0.0.1:{closed_port()}"
    cfg = compose(["logger=[tensorboard,mlflow]", f"logger.mlflow.tracking_uri={uri}"])
    start = time.monotonic()
    with caplog.at_level(logging.WARNING), pytest.raises(ConfigError) as err:
        start_trackers(cfg, tmp_path, tmp_path, resuming=False)
    assert time.monotonic() - start < 15
    assert str(err.value).startswith(f"logger.mlflow.tracking_uri='{uri}': MLflow did not start: MlflowException: ")
    # no urllib3 "Retrying ..." line before it
    assert "\n" not in str(err.value) and not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert mlflow_requests == [(1, 1, 3)]  # the user's 3 s timeout kept
    assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "3" and not any(os.environ.get(n) for n in HTTP_VARS[:2])


def test_an_mlflow_server_gone_mid_run_costs_a_short_stall_and_one_warning(tmp_path, mlflow_requests, caplog):
    from mlflow.tracking import MlflowClient

    from hydratrain.train.trackers import MLflowTracker, _local_store

    tracker = MLflowTracker(_local_store(tmp_path), "tests", None, "outputs/run", {})
    tracker.client = MlflowClient(f"http://127.0.0.1:{closed_port()}")  # its server went away
    kept = CSVTracker(tmp_path / "metrics.csv")
    trackers = Trackers(TensorBoardLogger(tmp_path / "tb", enabled=False), [tracker, kept])
    start = time.monotonic()
    with caplog.at_level(logging.WARNING):
        for step, values in STREAM:
            trackers.scalars(values, step)
        trackers.close()
    assert time.monotonic() - start < 15 and read_csv(tmp_path / "metrics.csv") == expected()
    (line,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]  # no urllib3 "Retrying ..."
    assert line.startswith("logger.mlflow failed (MlflowException: ")
    assert mlflow_requests == [(2, 1, 10)]  # one request (two retries), then the tracker was dropped


def test_wandb_online_without_an_api_key_names_the_mode_and_offline(compose, tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="logger=wandb needs the extra: pip install 'hydratrain[wandb]'")
    for name in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc, no wandb settings with a key
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{closed_port()}")  # a request would be refused, not sent
    cfg = compose(["logger=[tensorboard,wandb]"])
    assert cfg.logger.wandb.mode == "online"
    with pytest.raises(ConfigError) as err:
        start_trackers(cfg, tmp_path, tmp_path, resuming=False)
    line = str(err.value)
    assert line.startswith("logger.wandb.mode='online': W&B did not start: UsageError: No API key configured")
    assert "logger.wandb.mode=offline needs no account" in line and "\n" not in line
