"""Start-up: from the command to the first optimizer step, against bare ``import torch`` + process-group init.

    python bench/startup.py                      # 5 interleaved rounds, 1 rank and 2 ranks (torchrun)
    python bench/startup.py --rounds 2 --ranks 1

Per rank count, three commands run in each round (order rotated per round), after one unrecorded warm-up of each
(page cache, the CPU peak FLOP/s cache):

- ``pg``: ``bench/startup_baseline.py pg`` -- import torch, init a gloo (nccl) process group, barrier;
- ``loop``: ``bench/startup_baseline.py loop`` -- the same plus the smallest hand-written loop to its first optimizer
  step (what any torch.optim loop pays on top: torch.optim imports torch._dynamo);
- ``hydratrain``: ``train.py +debug=fast_gpt trainer.max_steps=1`` (``strategy=single`` for 1 rank, the default fsdp
  for 2), timed to the end of its first optimizer step (``results.json``'s ``startup_s``), with its own breakdown:
  launcher (torchrun's start before the worker process), python + hydra + compose, imports, checks, device +
  distributed setup, data, model, optimizer, peak FLOP/s, logger/checkpoints/trainer, first step.

Times are wall seconds from just before the command is started; the table gives medians over rounds and the ratio
hydratrain / pg (the issue's bar: at most 1.5). Results: ``<out>/results.jsonl`` and ``<out>/results.md``.

``--compare DIR`` (repeatable) adds the same hydratrain command run from another checkout (its train.py with
``PYTHONPATH=DIR/src``), e.g. the commit before a change, interleaved with the others; a checkout whose
results.json has no ``startup_s`` is timed to the ``step 1/`` line of its rank-0 log (written just after the first
step) and shows no breakdown.
"""
from __future__ import annotations

import argparse
import datetime
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib import (
    BENCH,
    ROOT,
    Recorder,
    at_least,
    clean_env,
    command,
    csv_of,
    fmt,
    load,
    median_min_max,
    out_dir,
    rotated,
    table,
    write_report,
)

STEP_1 = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]\[hydratrain\.trainer\]\[INFO\] - step 1/",
                    re.MULTILINE)


def logged_first_step(run_dir: Path) -> float:
    """``time.time()`` of the rank-0 log line of step 1 (millisecond resolution)."""
    stamp = STEP_1.search((run_dir / "train_rank0.log").read_text()).group(1)
    return datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def run_one(kind: str, nproc: int, timeout: float, extra: list[str], root: Path = ROOT) -> dict:
    """One start-up measurement; returns seconds to done (``total``) and the breakdown, or ``failed``."""
    env = clean_env()
    if kind.startswith("hydratrain"):
        if root != ROOT:
            env["PYTHONPATH"] = str(root / "src")
        tmp = Path(tempfile.mkdtemp(prefix="bench-startup-"))
        # the built-in GPT's run of seconds: +debug=fast_gpt, which a checkout from before it called +debug=fast
        debug = "fast_gpt" if (root / "conf" / "debug" / "fast_gpt.yaml").exists() else "fast"
        args = [str(root / "train.py"), f"+debug={debug}", "trainer.max_steps=1", "trainer.eval_samples=4",
                f"hydra.run.dir={tmp}", *(["strategy=single"] if nproc == 1 else []), *extra]
    else:
        args = [str(BENCH / "startup_baseline.py"), kind]
    cmd = command(args, nproc)
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=timeout)
    wall = time.time() - t0
    if proc.returncode != 0:
        return {"failed": (proc.stdout[-1000:] + proc.stderr[-3000:])}
    if kind.startswith("hydratrain"):
        res = json.loads((tmp / "results.json").read_text())
        s = res.get("startup_s")
        if not s:  # a checkout from before hydratrain.timing
            return {"total": logged_first_step(tmp) - t0, "phases": {}, "command_wall": wall}
        phases = {"launcher": max(0.0, s["process_started_at"] - t0), **s["phases"]}
        return {"total": s["ended_at"] - t0, "phases": phases, "command_wall": wall,
                "logged_step_1": logged_first_step(tmp) - t0}
    row = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    return {"total": row["done_at"] - t0, "command_wall": wall,
            "phases": {k: row[k] for k in ("import_torch_s", "process_group_s", "loop_s") if k in row}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=at_least(1), default=5)
    p.add_argument("--ranks", type=csv_of(item=at_least(1)), default="1,2")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--compare", action="append", default=[], help="another checkout to time too (repeatable)")
    p.add_argument("--out", default=None)
    p.add_argument("extra", nargs="*", help="extra train.py overrides")
    args = p.parse_args(argv)
    out = out_dir("startup", args.out)
    rec = Recorder(out, "startup", vars(args))
    roots = {"hydratrain": ROOT, **{f"hydratrain ({Path(d).resolve()})": Path(d).resolve() for d in args.compare}}
    kinds = ["pg", "loop", *roots]
    ranks = args.ranks
    cases = [(k, n) for n in ranks for k in kinds]
    print(f"bench/startup.py: {len(cases)} commands x {args.rounds} rounds (+1 warm-up); results in {out}", flush=True)
    for kind, nproc in cases:  # warm-up: page cache, CPU peak cache, corpus cache
        run_one(kind, nproc, args.timeout, args.extra, roots.get(kind, ROOT))
    got: dict[tuple, list[dict]] = {}
    for r in range(args.rounds):
        for kind, nproc in rotated(cases, r):
            before = load()
            row = run_one(kind, nproc, args.timeout, args.extra, roots.get(kind, ROOT))
            rec.write({"kind": "run", "round": r, "what": kind, "ranks": nproc, "load_1min": before, **row})
            if "failed" in row:
                print(f"round {r + 1}: {kind} x{nproc} FAILED\n{row['failed']}", flush=True)
                continue
            got.setdefault((kind, nproc), []).append(row)
            print(f"round {r + 1}: {kind:<10} x{nproc}  {row['total']:6.2f} s to done (load {before:.1f})", flush=True)

    rows, breakdown = [], []
    for nproc in ranks:
        base = median_min_max(x["total"] for x in got.get(("pg", nproc), []))[0]
        for kind in kinds:
            xs = got.get((kind, nproc), [])
            med, lo, hi = median_min_max(x["total"] for x in xs)
            rows.append([nproc, kind, fmt(med, ".2f"), f"{fmt(lo, '.2f')} - {fmt(hi, '.2f')}",
                         fmt(med / base if base == base else float("nan"), ".2f") + "x", len(xs)])
            rec.write({"kind": "summary", "what": kind, "ranks": nproc, "median_s": med, "min_s": lo, "max_s": hi,
                       "ratio_to_pg": med / base if base else None})
        xs = got.get(("hydratrain", nproc), [])
        if xs and xs[0]["phases"]:
            names = list(dict.fromkeys(k for x in xs for k in x["phases"]))
            cells = [fmt(median_min_max(x["phases"].get(k, 0.0) for x in xs)[0], ".2f") for k in names]
            breakdown.append((nproc, names, cells))
    body = table(["ranks", "command", "seconds to first step (median)", "min - max", "x pg", "rounds"], rows)
    for nproc, names, cells in breakdown:
        body += f"\n\nhydratrain, {nproc} rank(s): where the time goes (median seconds per phase, rank 0)\n\n"
        body += table(names, [cells])
    body += ("\n\npg: import torch + process group; loop: + a hand-written GPT/AdamW loop to its first step; "
             "hydratrain: `train.py +debug=fast_gpt trainer.max_steps=1` (strategy=single for 1 rank, fsdp for 2), "
             "timed to the end of its first optimizer step; hydratrain (DIR): the same from checkout DIR, timed to "
             "its step-1 log line.")
    text = write_report(out, "bench/startup.py: command to first optimizer step", rec.rows[0], body,
                        " ".join(["python", "bench/startup.py", *(argv if argv is not None else sys.argv[1:])]))
    print("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
