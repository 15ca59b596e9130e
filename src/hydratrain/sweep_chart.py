"""The sweep report's picture, ``sweep_report.png``: every job's ``train/loss`` and objective against steps, and the
objective against each swept key, read from what each job already wrote (its TensorBoard events under
``<job dir>/tensorboard``, its ``.hydra/config.yaml`` for ``trainer.objective``). Failed jobs are drawn dashed and
named "failed" in the legend. Written by :func:`hydratrain.sweep_report.write_sweep_report` at the end of a sweep and
when a job stops it; needs matplotlib (``pip install -e ".[report]"``), without which the report has no picture.
"""
from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from omegaconf import OmegaConf

log = logging.getLogger("hydratrain.sweep")

CHART = "sweep_report.png"

Curve = List[Tuple[int, float]]


def write_chart(sweep_dir: Path, rows: List[dict]) -> Optional[Path]:
    """Draw ``sweep_dir/sweep_report.png`` for the report's ``rows`` (:func:`hydratrain.sweep_report.sweep_rows`);
    returns its path, or None when matplotlib is not installed or no job has a curve or an objective to draw."""
    try:
        # (an optional extra, imported only to draw: the report's table needs none of it)
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        log.info("the sweep report has no chart (%s): matplotlib is not installed (pip install -e \".[report]\")",
                 CHART)
        return None
    jobs = chart_jobs(sweep_dir, rows)
    if not jobs:
        return None
    objective = jobs[0]["objective_tag"]
    keys = swept_keys([j["overrides"] for j in jobs])
    ncols = min(2 + len(keys), 4)
    nrows = math.ceil((2 + len(keys)) / ncols)
    fig = Figure(figsize=(5.0 * ncols, 3.8 * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax, tag, curve in ((axes[0], "train/loss", "train"), (axes[1], objective, "objective")):
        for n, job in enumerate(jobs):
            if job[curve]:
                steps, values = zip(*job[curve])
                ax.plot(steps, values, color=f"C{n % 10}", linestyle="--" if job["failed"] else "-",
                        marker="o" if len(steps) < 8 else None, label=job["label"])
        ax.set(title=f"{tag} against steps", xlabel="step", ylabel=tag)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    legend = next((ax for ax in axes[:2] if ax.lines), None)  # (jobs without events: no line, no legend)
    if legend is not None:
        legend.legend(fontsize="small")
    for ax, key in zip(axes[2:], keys):
        _against_key(ax, key, jobs, objective)
    for ax in axes[2 + len(keys):]:
        ax.set_axis_off()
    fig.suptitle(sweep_dir.name)
    path = sweep_dir / CHART
    tmp = sweep_dir / f".{CHART}.tmp{os.getpid()}.png"
    fig.savefig(tmp, dpi=90)
    os.replace(tmp, path)
    return path


def chart_jobs(sweep_dir: Path, rows: List[dict]) -> List[Dict[str, Any]]:
    """What the chart draws of each report row that has a curve or an objective: its curves (``train``,
    ``objective``: ``[(step, value), ...]``), its final objective (``value``), whether it ``failed`` (drawn dashed,
    a cross) and its legend ``label`` (ending in "(failed)" for a failed job)."""
    jobs = [_job(sweep_dir, row) for row in rows]
    jobs = [j for j in jobs if j["train"] or j["objective"] or j["value"] is not None]
    keys = swept_keys([j["overrides"] for j in jobs])
    for job in jobs:  # (the label names what differs between the jobs, not every override they share)
        swept = " ".join(o for o in job["overrides"] if _split(o)[0] in keys)
        job["label"] = f"{job['job']}: {swept or '(no overrides)'}" + (" (failed)" if job["failed"] else "")
    return jobs


def _job(sweep_dir: Path, row: dict) -> Dict[str, Any]:
    """:func:`chart_jobs` of one row: its final objective is the last point of the objective's curve, else the
    report's eval or train loss."""
    job_dir = sweep_dir / row["job"].split(" (job ")[0]  # (a refused job's row names the dir it was refused)
    objective = _objective_tag(job_dir)
    scalars = _scalars(job_dir / "tensorboard") if " (job " not in row["job"] else {}
    curve = scalars.get(objective, [])
    value: Optional[float] = curve[-1][1] if curve else next(
        (row[k] for k in ("eval_loss", "train_loss") if isinstance(row.get(k), float)), None)
    return {"job": row["job"], "train": scalars.get("train/loss", []), "objective": curve, "objective_tag": objective,
            "value": value, "failed": row["status"] == "FAILED", "overrides": row["overrides"].split()}


def _objective_tag(job_dir: Path) -> str:
    """The job's ``trainer.objective`` (its ``.hydra/config.yaml``), ``eval/loss`` when it cannot be read."""
    try:
        return str(OmegaConf.select(OmegaConf.load(job_dir / ".hydra" / "config.yaml"), "trainer.objective",
                                    default="eval/loss"))
    except Exception:  # noqa: BLE001 (no config written yet, or not a mapping: the default objective)
        return "eval/loss"


def _scalars(tb_dir: Path) -> Dict[str, Curve]:
    """``{tag: [(step, value), ...]}`` of the scalars in ``tb_dir``'s event files; a resumed run's steps that a later
    launch wrote again are those of the later launch (TensorBoard's own purge)."""
    if not tb_dir.is_dir():
        return {}
    # (start-up: tensorboard's event reader imports in ~1.8 s; the report's table needs none of it)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    quiet = logging.getLogger("tensorboard")  # its directory watcher says "No path found after <the last file>" at
    level, quiet.level = quiet.level, logging.ERROR  # the end of every read: a note of its own, no fault of the job
    try:
        events.Reload()
    finally:
        quiet.setLevel(level)
    return {tag: [(e.step, e.value) for e in events.Scalars(tag) if math.isfinite(e.value)]
            for tag in events.Tags().get("scalars", [])}


def swept_keys(overrides: List[List[str]]) -> List[str]:
    """The keys whose values differ between the jobs' ``key=value`` overrides (a key some jobs lack counts too), in
    the order of their first appearance."""
    values: Dict[str, set] = {}
    for job in overrides:
        given = dict(_split(o) for o in job)
        for key in dict.fromkeys([*values, *given]):
            values.setdefault(key, set()).add(given.get(key))
    return [k for k, v in values.items() if len(v) > 1]


def _split(override: str) -> Tuple[str, str]:
    key, _, value = override.partition("=")
    return key.lstrip("+~"), value


def _against_key(ax: Any, key: str, jobs: List[dict], objective: str) -> None:
    """A scatter of each job's final objective against its value of ``key``: numbers on a numeric axis (a log one
    when they are positive and span a factor 10 or more:
    a learning rate's 1e-3, 3e-3, 1e-2), anything else as categories in the order first seen.
    Failed jobs are crosses."""
    points = [(dict(_split(o) for o in j["overrides"]).get(key, "(default)"), j["value"], j["failed"])
              for j in jobs if j["value"] is not None]
    numbers = [_number(v) for v, _, _ in points]
    if points and all(x is not None for x in numbers):
        xs: List[Any] = numbers
        positive = [x for x in numbers if x is not None and x > 0]
        if len(positive) == len(numbers) and max(positive) >= 10 * min(positive):
            ax.set_xscale("log")
    else:
        categories = list(dict.fromkeys(v for v, _, _ in points))
        xs = [categories.index(v) for v, _, _ in points]
        ax.set_xticks(range(len(categories)), categories, rotation=20 if len(categories) > 3 else 0)
        ax.set_xlim(-0.5, len(categories) - 0.5)
    for failed in (False, True):
        chosen = [(x, y) for x, (_, y, f) in zip(xs, points) if f == failed]
        if chosen:
            ax.scatter(*zip(*chosen), marker="x" if failed else "o", color="C3" if failed else "C0",
                       label="failed" if failed else "completed")
    ax.set(title=f"{objective} against {key}", xlabel=key, ylabel=objective)
    ax.grid(alpha=0.3)
    if any(f for _, _, f in points):
        ax.legend(fontsize="small")


def _number(value: str) -> Optional[float]:
    try:
        x = float(value)
    except ValueError:
        return None
    return x if math.isfinite(x) else None
