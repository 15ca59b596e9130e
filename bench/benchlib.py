"""Shared by the bench/ scripts: the machine description, clean subprocess runs (one process or torchrun), JSON lines,
markdown tables, interleaved rounds and order statistics. Standard library only (torch is imported by the workers).
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterable, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
MODELS = sorted(p.stem for p in (ROOT / "conf" / "model").glob("*.yaml"))  # --model choices: the model presets


def at_least(low: int):
    """An argparse ``type``: an int >= ``low`` (tester 9: a 0 or a typo ran every launch of every round, each
    failing, or divided by zero at the end)."""
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise ValueError(text)
        return value

    parse.__name__ = f"int >= {low}"
    return parse


def csv_of(choices: Optional[Sequence[str]] = None, item=str):
    """An argparse ``type``: a comma-separated list, each item ``item(text)`` and, when ``choices`` is given, one of
    them."""
    def parse(text: str) -> list:
        items = [item(x) for x in text.split(",") if x]
        if not items or (choices is not None and any(x not in choices for x in items)):
            raise ValueError(text)
        return items

    parse.__name__ = f"comma-separated list of {', '.join(choices) if choices else item.__name__}"
    return parse


LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "HYDRATRAIN_STAMP",
               "GROUP_RANK", "ROLE_RANK")


def load() -> float:
    """The 1-minute load average (runnable processes; compare with the core count)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cores() -> int:
    """CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def machine() -> dict:
    """What the figures depend on: CPU model, cores, matmul-relevant flags, torch, load average now."""
    model = "unknown"
    try:
        with open("/proc/cpuinfo") as fh:
            model = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), model)
    except OSError:
        pass
    flags = cpu_flags()
    out = {"cpu": model, "cores": cores(),
           "flags": sorted(flags & {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_fp16",
                                    "amx_fp16", "fma"}),
           "python": sys.version.split()[0], "load_1min": round(load(), 2), "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        out["torch"] = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"],
                                      capture_output=True, text=True, timeout=120).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        out["torch"] = "?"
    return out


def clean_env(threads: Optional[int] = None, **extra: str) -> dict:
    """This environment without any launcher's variables (a bench run inside a torchrun job must not join it)."""
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCH_VARS and not k.startswith(("TORCHELASTIC_", "SUBMITIT_", "SLURM_"))}
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(BENCH), *filter(None, [env.get("PYTHONPATH")])])
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    env.update(extra)
    return env


def command(script: Sequence[str], nproc: int, torchrun: bool = False) -> list[str]:
    """``python SCRIPT...`` or ``python -m torch.distributed.run --standalone --nproc_per_node N SCRIPT...`` (for more
    than one process, or with ``torchrun``)."""
    if nproc > 1 or torchrun:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *script]
    return [sys.executable, *script]


def run_json(cmd: Sequence[str], env: dict, timeout: float, cwd: Path = ROOT) -> tuple[Optional[dict], str, float]:
    """Run ``cmd``; returns (the last stdout line that parses as a JSON object, or None; the output tail; seconds)."""
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(list(cmd), cwd=str(cwd), env=env, capture_output=True, text=True, timeout=timeout)
        out, err, rc = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        out, err, rc = (e.stdout or b""), (e.stderr or b""), "timeout"
        out = out.decode(errors="replace") if isinstance(out, bytes) else out
        err = err.decode(errors="replace") if isinstance(err, bytes) else err
    seconds = time.perf_counter() - t0
    row = None
    for line in reversed(out.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                row = json.loads(line)
                break
            except ValueError:
                continue
    tail = f"exit {rc}\n" + (out[-1500:] + "\n" + err[-3000:]).strip()
    return (row if rc == 0 else None), tail, seconds


def out_dir(name: str, given: Optional[str]) -> Path:
    path = Path(given) if given else BENCH / "out" / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    path.mkdir(parents=True, exist_ok=True)
    return path


class Recorder:
    """Appends one JSON object per line to ``<out>/results.jsonl``; the first line describes the machine."""

    def __init__(self, out: Path, bench: str, settings: dict):
        self.out, self.path = out, out / "results.jsonl"
        self.rows: list[dict] = []
        self.path.write_text("")
        self.write({"kind": "machine", "bench": bench, **machine(), "settings": settings})

    def write(self, row: dict) -> None:
        self.rows.append(row)
        with self.path.open("a") as fh:
            fh.write(json.dumps(row, default=str) + "\n")


def rotated(cases: Sequence, round_index: int) -> list:
    """``cases`` rotated by ``round_index`` (round r starts with case r mod n), so no case always runs first."""
    k = round_index % len(cases) if cases else 0
    return list(cases[k:]) + list(cases[:k])


def median_min_max(values: Iterable[float]) -> tuple[float, float, float]:
    vals = [v for v in values if v == v]
    if not vals:
        return float("nan"), float("nan"), float("nan")
    return statistics.median(vals), min(vals), max(vals)


def table(header: Sequence[str], rows: Iterable[Sequence]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_report(out: Path, title: str, machine_row: dict, body: str, command_line: str) -> str:
    """``<out>/results.md``: title, the machine and load, the command, then ``body``; returns the text."""
    m = machine_row
    text = (f"# {title}\n\n{m.get('cpu')} ({m.get('cores')} cores, {', '.join(m.get('flags', []))}); torch "
            f"{m.get('torch')}; load average {m.get('load_1min')} at start, {round(load(), 2)} at end; "
            f"{m.get('date')}\n\n`{command_line}`\n\n{body}\n")
    (out / "results.md").write_text(text)
    return text


def fmt(value: Optional[float], spec: str = ",.0f") -> str:
    return "n/a" if value is None or value != value else format(value, spec)


def auto_choices(device: str) -> tuple[str, str]:
    """What ``precision=auto`` and ``optim.impl=auto`` pick on this machine's ``device`` (a subprocess: the bench
    drivers do not import torch)."""
    code = ("import torch; from hydratrain.parallel.precision import auto_preset; from hydratrain.optim import "
            f"adamw_impl; d = torch.device('cuda' if {device!r} == 'cuda' or ({device!r} == 'auto' and "
            "torch.cuda.is_available()) else 'cpu'); print(auto_preset(d), adamw_impl('auto', [torch.ones(1, "
            "device=d)]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    return out[0], out[1]


def auto_compiles(device: str) -> bool:
    """Whether hydratrain's ``trainer.compile=auto`` compiles on this machine's ``device`` (on CUDA only; a
    subprocess when ``device`` is auto: the bench drivers do not import torch)."""
    if device != "auto":
        return device.startswith("cuda")
    code = "import torch; print(int(torch.cuda.is_available()))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return out.strip() == "1"
