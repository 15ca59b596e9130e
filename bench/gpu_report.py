"""Helper of bench/gpu.sh: describe the machine, judge one train.py launch from its results.json, write the table.

    python bench/gpu_report.py env --out DIR [--dry-run]          # DIR/env.json; prints the CUDA device count
    python bench/gpu_report.py record --out DIR --case NAME ...   # appends one line to DIR/results.jsonl
    python bench/gpu_report.py table --out DIR                    # DIR/results.md; exit 1 if a case failed

Standard library only, except ``env``, which imports torch (and hydratrain's GPU peak table when installed).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Optional


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def cmd_env(args: argparse.Namespace) -> int:
    import torch

    info: dict[str, Any] = {"dry_run": args.dry_run, "torch": torch.__version__, "cuda": torch.version.cuda,
                            "cuda_available": torch.cuda.is_available(), "gpus": [], "date": time.strftime("%F %T")}
    if info["cuda_available"]:
        try:
            from hydratrain.metrics import gpu_peak
        except ImportError:
            gpu_peak = None
        for i in range(torch.cuda.device_count()):
            name = torch.cuda.get_device_name(i)
            entry = gpu_peak(name) if gpu_peak else None
            info["gpus"].append({"index": i, "name": name, "bf16_peak_flops": entry.bf16 if entry else None,
                                 "peak_source": entry.source if entry else None,
                                 "memory_bytes": torch.cuda.get_device_properties(i).total_memory})
    # MFU must be reported when every GPU is in the peak table with a bf16 figure (the cases' compute mode)
    info["mfu_required"] = bool(info["gpus"]) and all(g["bf16_peak_flops"] for g in info["gpus"])
    out = Path(args.out)
    (out / "env.json").write_text(json.dumps(info, indent=1))
    gpus = ", ".join(f"{g['index']}: {g['name']} (bf16 peak "
                     + (f"{g['bf16_peak_flops'] / 1e12:.1f} TFLOP/s" if g["bf16_peak_flops"] else "unknown: MFU NaN")
                     + ")" for g in info["gpus"]) or "none"
    print(f"torch {info['torch']} (CUDA {info['cuda']}); GPUs: {gpus}", file=sys.stderr)
    print(len(info["gpus"]))
    return 0


def judge(results: Optional[dict], rc: int, steps: int, this_launch: Optional[int], check: str,
          mfu_required: bool) -> list[str]:
    """Why a launch failed (empty when it passed). ``results`` is its results.json (None if missing)."""
    reasons = []
    if rc != 0:
        reasons.append(f"exit status {rc}" + (" (timed out)" if rc in (124, 137) else ""))
    if results is None:
        return reasons + ["no results.json"]
    if results.get("steps") != steps:
        reasons.append(f"steps {results.get('steps')} != {steps}")
    if this_launch is not None and results.get("steps_this_launch") != this_launch:
        reasons.append(f"steps_this_launch {results.get('steps_this_launch')} != {this_launch}")
    for key in ("train_loss", "eval_loss"):
        if not _finite(results.get(key)):
            reasons.append(f"{key} {results.get(key)} not finite")
    if not (_finite(results.get("tokens_per_sec")) and results["tokens_per_sec"] > 0):
        reasons.append(f"tokens_per_sec {results.get('tokens_per_sec')} not > 0")
    if not (_finite(results.get("peak_memory_bytes")) and results["peak_memory_bytes"] > 0):
        reasons.append(f"peak_memory_bytes {results.get('peak_memory_bytes')} not > 0")
    mfu = results.get("mfu")
    if mfu is None:
        if mfu_required:
            reasons.append("mfu missing although this GPU's peak is known")
    elif not (_finite(mfu) and 0 < mfu <= 1):
        reasons.append(f"mfu {mfu} not in (0, 1]")
    if check == "fp16" and not (_finite(results.get("skipped_steps")) and results["skipped_steps"] < steps):
        reasons.append(f"the grad scaler skipped {results.get('skipped_steps')} of {steps} steps")
    return reasons


def _tail(log: Path, lines: int = 3) -> str:
    try:
        text = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return " | ".join(text[-lines:])[-400:]


def cmd_record(args: argparse.Namespace) -> int:
    out = Path(args.out)
    env = json.loads((out / "env.json").read_text()) if (out / "env.json").exists() else {}
    results = None
    with_results = Path(args.run_dir) / "results.json"
    if with_results.exists():
        try:
            results = json.loads(with_results.read_text())
        except ValueError:
            results = None
    this_launch = args.this_launch if args.this_launch is not None and args.this_launch >= 0 else None
    reasons = judge(results, args.rc, args.steps, this_launch, args.check,
                    bool(env.get("mfu_required")) and not env.get("dry_run"))
    r = results or {}
    row = {"case": args.case, "nproc": args.nproc, "status": "FAIL" if reasons else "PASS", "reasons": reasons,
           "exit_status": args.rc, "seconds": args.seconds, "steps": r.get("steps"),
           "steps_this_launch": r.get("steps_this_launch"), "tokens_per_sec": r.get("tokens_per_sec"),
           "mfu": r.get("mfu"), "peak_memory_bytes": r.get("peak_memory_bytes"), "train_loss": r.get("train_loss"),
           "eval_loss": r.get("eval_loss"), "skipped_steps": r.get("skipped_steps"),
           "device": ", ".join(sorted({g["name"] for g in env.get("gpus", [])})) if not env.get("dry_run") else "cpu",
           "dry_run": bool(env.get("dry_run")), "overrides": args.overrides, "run_dir": args.run_dir,
           "log": args.log}
    if reasons:
        row["log_tail"] = _tail(Path(args.log))
    with (out / "results.jsonl").open("a") as fh:
        fh.write(json.dumps(row) + "\n")
    print(f"{row['status']} {args.case:<16} {args.nproc} rank(s)  {_fmt_tps(row)} tokens/s  MFU {_fmt_mfu(row)}  "
          f"peak memory {_fmt_mem(row)}  {args.seconds} s" + (f"  -- {'; '.join(reasons)}" if reasons else ""))
    if reasons and row.get("log_tail"):
        print(f"    log {args.log}: ... {row['log_tail']}")
    return 0


def _fmt_tps(row: dict) -> str:
    return f"{row['tokens_per_sec']:,.0f}" if _finite(row.get("tokens_per_sec")) else "n/a"


def _fmt_mfu(row: dict) -> str:
    return f"{100 * row['mfu']:.1f}%" if _finite(row.get("mfu")) else "n/a"


def _fmt_mem(row: dict) -> str:
    return f"{row['peak_memory_bytes'] / 2**30:.2f} GiB" if _finite(row.get("peak_memory_bytes")) else "n/a"


def cmd_table(args: argparse.Namespace) -> int:
    out = Path(args.out)
    rows = []
    if (out / "results.jsonl").exists():
        rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines() if line.strip()]
    env = json.loads((out / "env.json").read_text()) if (out / "env.json").exists() else {}
    gpus = [g["name"] for g in env.get("gpus", [])]
    where = "CPU dry run (gloo)" if env.get("dry_run") else (f"{len(gpus)} x {', '.join(sorted(set(gpus)))}"
                                                           if gpus else "no GPU")
    lines = ["# bench/gpu.sh", "",
             f"{where}; torch {env.get('torch', '?')} (CUDA {env.get('cuda')}); {env.get('date', '')}", "",
             "| case | ranks | status | tokens/s | MFU | peak memory | steps | seconds | overrides | notes |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        steps = f"{r['steps']}" + (f" ({r['steps_this_launch']} this launch)"
                                   if r.get("steps_this_launch") not in (None, r.get("steps")) else "")
        notes = "; ".join(r["reasons"]).replace("|", "/")
        lines.append(f"| {r['case']} | {r['nproc']} | {r['status']} | {_fmt_tps(r)} | {_fmt_mfu(r)} | "
                     f"{_fmt_mem(r)} | {steps if r.get('steps') is not None else 'n/a'} | {r['seconds']} | "
                     f"`{' '.join(r['overrides'])}` | {notes} |")
    failed = sum(r["status"] != "PASS" for r in rows)
    appended = Path(args.append) if args.append and Path(args.append).is_file() else None
    summary = f"{len(rows) - failed} passed, {failed} failed" + ("" if rows or appended else " (no case ran)")
    lines += ["", summary, ""]
    lines += matrix(rows)
    if appended is not None:
        lines += ["", appended.read_text().replace("# bench/overhead.py", "## vs_hand: bench/overhead.py", 1)]
    (out / "results.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 1 if failed or not (rows or appended) else 0


MATRIX = {("off", "off"): "fsdp_bf16", ("on", "off"): "compile", ("off", "on"): "ac", ("on", "on"): "compile_ac"}


def matrix(rows: list[dict]) -> list[str]:
    """The compile x activation-checkpointing table of the gpt_small bf16 fsdp cases (those that ran)."""
    by_case = {r["case"]: r for r in rows}
    if not any(name in by_case for name in MATRIX.values()):
        return []
    lines = ["## gpt_small, bf16, fsdp, 1 rank: compile x activation checkpointing", "",
             "| compile | activation checkpointing | case | tokens/s | MFU | peak memory | status |",
             "|---|---|---|---|---|---|---|"]
    for (compiled, ac), name in MATRIX.items():
        r = by_case.get(name)
        if r is not None:
            lines.append(f"| {compiled} | {ac} | {name} | {_fmt_tps(r)} | {_fmt_mfu(r)} | {_fmt_mem(r)} | "
                         f"{r['status']} |")
    return lines + [""]


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("env")
    p.add_argument("--out", required=True)
    p.add_argument("--dry-run", action="store_true")
    p = sub.add_parser("record")
    p.add_argument("--out", required=True)
    p.add_argument("--case", required=True)
    p.add_argument("--nproc", type=int, required=True)
    p.add_argument("--rc", type=int, required=True)
    p.add_argument("--seconds", type=int, required=True)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--log", required=True)
    p.add_argument("--steps", type=int, required=True, help="the step results.json must end at")
    p.add_argument("--this-launch", type=int, default=None, help="steps this launch trained (-1: do not check)")
    p.add_argument("--check", default="none", choices=["none", "fp16", "resume"])
    p.add_argument("overrides", nargs="*")
    p = sub.add_parser("table")
    p.add_argument("--out", required=True)
    p.add_argument("--append", default=None, help="a markdown file appended to results.md when it exists")
    args = parser.parse_args(argv)
    return {"env": cmd_env, "record": cmd_record, "table": cmd_table}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
