"""Start-up timeline: wall seconds from this process's start to the first optimizer step, phase by phase.

``run.main`` calls :func:`begin` on entry and :func:`mark` at the end of each start-up phase (imports, checks,
device + distributed setup, data, model, optimizer, peak FLOP/s, ...); the trainer marks ``first step`` and logs
:func:`summary` once. Each phase is charged the wall time since the previous mark; the first phase, ``python +
hydra + compose``, runs from the process's start (Linux: ``/proc/self/stat``) to :func:`begin`, so it holds the
interpreter, Hydra's import and the config composition. ``results.json`` keeps the figures (``startup_s``) and
``bench/startup.py`` reads them. Importing this module imports neither torch nor Hydra.
"""
from __future__ import annotations

import os
import time
from typing import Optional

_MARKS: list[tuple[str, float]] = []  # (phase that ended, time.time() when it ended)
_ORIGIN: Optional[float] = None  # time.time() the timeline starts from
_FROM = "process start"  # what _ORIGIN is
_IMPORTED = time.time()


def process_start_time() -> float:
    """``time.time()`` at which this process was started: ``/proc/self/stat``'s start time (clock ticks after
    boot) against ``/proc/uptime`` (10 ms resolution); where those are missing, when this module was imported."""
    try:
        with open("/proc/self/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        started_after_boot = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of proc(5); fields[0] is 3
        with open("/proc/uptime") as fh:
            uptime = float(fh.read().split()[0])
        return time.time() - (uptime - started_after_boot)
    except (OSError, ValueError, IndexError, AttributeError):
        return _IMPORTED


def begin(phase: str = "python + hydra + compose") -> None:
    """Start the timeline of a job. The first job of a process counts from the process's start (``phase`` is then
    what ran before this call); a later job of the same process (a sweep) starts from this call."""
    global _ORIGIN, _FROM
    now = time.time()
    if _ORIGIN is None:
        _ORIGIN = min(process_start_time(), now)
        _MARKS.clear()
        _MARKS.append((phase, now))
    else:
        _ORIGIN, _FROM = now, "the job's start"  # (a sweep's later jobs count from their own start, not the process's)
        _MARKS.clear()


def mark(phase: str) -> None:
    """End ``phase`` now (it is charged the time since the previous mark). A no-op before :func:`begin`."""
    if _ORIGIN is not None:
        _MARKS.append((phase, time.time()))


def phases() -> dict[str, float]:
    """``{phase: seconds}`` in order, plus ``total`` (seconds from the origin to the last mark). Phases marked more
    than once are summed."""
    out: dict[str, float] = {}
    if _ORIGIN is None or not _MARKS:
        return out
    previous = _ORIGIN
    for phase, at in _MARKS:
        out[phase] = out.get(phase, 0.0) + max(0.0, at - previous)
        previous = at
    out["total"] = _MARKS[-1][1] - _ORIGIN
    return out


def record() -> dict:
    """What ``results.json`` keeps (``startup_s``): ``phases`` (:func:`phases` without ``total``), ``total``,
    ``process_started_at`` and ``ended_at`` (``time.time()`` of the origin and of the last mark, so a benchmark can
    add the launcher's own time before the process started)."""
    p = phases()
    if not p:
        return {}
    total = p.pop("total")
    return {"phases": p, "total": total, "process_started_at": _ORIGIN, "ended_at": _MARKS[-1][1]}


def summary(until: str = "first optimizer step") -> str:
    """One line: ``2.41 s from process start to the first optimizer step (python + hydra + compose 0.52, ...)``."""
    p = phases()
    if not p:
        return ""
    total = p.pop("total")
    return f"{total:.2f} s from {_FROM} to the {until} (" + ", ".join(f"{k} {v:.2f}" for k, v in p.items()) + ")"
