"""The sweep report: one row per Hydra job of a multirun, in ``sweep_report.csv``, ``sweep_report.md`` and
``sweep_report.html`` in the sweep dir, and at the sweep's end its chart, ``sweep_report.png``
(``hydratrain.sweep_chart``).

Each job's rank 0 writes ``results.json`` (``Trainer.finish``); the sweep's Hydra callback
(:class:`hydratrain.sweep.SweepReportCallback`) writes ``status.json`` at the end of each job, in rank 0 or, for a
job that the torchrun launcher saw fail (a failed check, a dead rank), in the launcher's process;
:func:`write_sweep_report` joins them. How a sweep ends with it (the closing line, the exit hook) is
``hydratrain.exits``'s.
"""
from __future__ import annotations

import csv
import html
import json
import logging
import math
import os
import time
import uuid
from pathlib import Path
from typing import Any, List, Optional

from omegaconf import OmegaConf

from hydratrain.dist.run_dir import MULTIRUN_MARK, _read_json
from hydratrain.paths import resolve_path
from hydratrain.sweep_chart import CHART, write_chart

log = logging.getLogger("hydratrain.sweep")

COLUMNS = ["job", "overrides", "status", "steps", "train_loss", "eval_loss", "tokens_per_sec", "peak_memory_mb",
           "mfu", "seconds", "error"]


def mark_multirun(sweep_dir: Path, sampled: Optional[List[str]] = None, command: Optional[List[str]] = None) -> str:
    """Record in ``sweep_dir`` that a new multirun starts there (at its start, once, in the launching process);
    returns its id. The report then lists this multirun's jobs only: a re-run into an existing sweep dir with fewer
    or other jobs does not report (or fail on) the jobs of an earlier one. ``sampled``: the config keys the sweep
    varies (:func:`sampled_keys`; None: not known), which :func:`_hopeless` reads in whatever process learns of a
    failed job; ``command``: the sweep's command line (:func:`hydratrain.dist.launch.launch_command`), from which a
    job in any process says how to resume the sweep (:func:`hydratrain.dist.launch.resume_command`)."""
    sweep_dir.mkdir(parents=True, exist_ok=True)
    mark: dict[str, Any] = {"id": uuid.uuid4().hex, "started": time.time(), "sampled": sampled, "command": command}
    tmp = sweep_dir / f"{MULTIRUN_MARK}.tmp{os.getpid()}"
    tmp.write_text(json.dumps(mark))
    os.replace(tmp, sweep_dir / MULTIRUN_MARK)
    (sweep_dir / CHART).unlink(missing_ok=True)  # an earlier multirun's picture: the report no longer shows its jobs
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


def write_sweep_report(sweep_dir: Path, chart: bool = False) -> Optional[Path]:
    """(Re)write ``sweep_report.csv``, ``sweep_report.md`` and ``sweep_report.html`` in ``sweep_dir`` from the job dirs
    found there; with ``chart`` (the end of the sweep, a job that stopped it) also draw ``sweep_report.png``
    (:func:`hydratrain.sweep_chart.write_chart`), which the md and html show under the table once it exists.

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
        if all(r.get("tokens_per_sec") in (None, "") for r in rows):  # datasets only: no token column to leave empty
            columns.remove("tokens_per_sec")
            for r in rows:
                r.pop("tokens_per_sec", None)
    csv_path = sweep_dir / "sweep_report.csv"
    tmp = sweep_dir / f".sweep_report.csv.tmp{os.getpid()}"
    with tmp.open("w", newline="") as f:
        writer = csv.DictWriter(f, columns, restval="")
        writer.writeheader()
        writer.writerows(rows)
    os.replace(tmp, csv_path)
    if chart:
        try:
            write_chart(sweep_dir, rows)
        except Exception as err:  # noqa: BLE001 (the table matters more than its picture: one line, no traceback)
            log.warning("the sweep report has no chart (%s): %s: %s", CHART, type(err).__name__, err)
    picture = (sweep_dir / CHART).exists()  # (this multirun's: mark_multirun removes an earlier one's)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(r.get(c, "")) for c in columns) + " |" for r in rows]
    if picture:
        lines += ["", f"![train/loss and the objective of every job; the objective against each swept key]({CHART})"]
    _write(sweep_dir / "sweep_report.md", "\n".join(lines) + "\n")
    _write(sweep_dir / "sweep_report.html", _html(sweep_dir.name, columns, rows, picture))
    return csv_path


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _html(title: str, columns: List[str], rows: List[dict], picture: bool) -> str:
    """The report as a page a browser opens: the table (figures as in the md) and, once drawn, the chart."""
    def cell(value: Any) -> str:
        return html.escape(_cell(value).replace("\\|", "|"))

    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "\n".join("<tr>" + "".join(f"<td>{cell(r.get(c, ''))}</td>" for c in columns) + "</tr>" for r in rows)
    image = f'<p><img src="{CHART}" alt="the sweep\'s curves and objective"></p>\n' if picture else ""
    return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{html.escape(title)}: sweep report</title>\n"
            "<style>table{border-collapse:collapse;font:13px sans-serif}td,th{border:1px solid #ccc;padding:2px 6px}"
            "img{max-width:100%}</style></head>\n"
            f"<body><table>\n<tr>{head}</tr>\n{body}\n</table>\n{image}</body></html>\n")


def _cell(value: Any) -> str:
    """A markdown table cell: floats to 5 significant digits (the CSV keeps every digit), ``|`` escaped."""
    if isinstance(value, float):
        return f"{value:.5g}" if abs(value) < 1e5 else f"{value:,.0f}"
    return str(value).replace("|", "\\|")


def _job_dir(hc: Any) -> Path:
    """This job's run dir (``hydra.runtime.output_dir``), made absolute the same way as :func:`_sweep_dir`."""
    return resolve_path(str(hc.runtime.output_dir), Path(str(hc.runtime.cwd)))


#: what a sweep of one job refused before its workers started leaves in its sweep dir (and the job's sub-dir)
LEFT_BY_A_REFUSED_JOB = ("multirun.yaml", "sweep_report.csv", "sweep_report.md", "sweep_report.html", CHART,
                         MULTIRUN_MARK, "status.json")


def log_report(sweep_dir: Path, chart: bool = True) -> None:
    """Refresh the report (with its chart, unless not ``chart``) and log it (the table, on the console in the
    sweeping process)."""
    path = write_sweep_report(sweep_dir, chart)
    if path:
        table = path.with_suffix(".md").read_text().split("\n\n")[0]  # (the chart's link follows a blank line)
        chart_line = f" (chart: {sweep_dir / CHART})" if (sweep_dir / CHART).exists() else ""
        log.info("sweep report: %s%s\n%s", path, chart_line, table.rstrip("\n") + "\n")


def closing_line(sweep_dir: Path) -> str:
    """``hydratrain: N of M sweep job(s) failed (see .../sweep_report.md); first: job ...``, or '' when none
    failed."""
    rows = sweep_rows(sweep_dir)
    failed = [r for r in rows if r["status"] == "FAILED"]
    if not failed:
        return ""
    first = failed[0]
    return (f"hydratrain: {len(failed)} of {len(rows)} sweep job(s) failed (see {sweep_dir / 'sweep_report.md'}); "
            f"first: job {first['job']} ({first['overrides']}): {first['error']}")
