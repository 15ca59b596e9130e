"""Overhead: hydratrain against a hand-written loop on the same model, per strategy and precision.

    python bench/overhead.py                                   # gpt_tiny, 16 x 256 tokens per rank, 4 rounds
    python bench/overhead.py --rounds 2 --strategies single --precisions fp32
    python bench/overhead.py --model gpt_small --batch 4 --seq 512 --device cuda --nproc 2

Each case is a pair of runs of bench/train_worker.py (``--impl hand`` and ``--impl hydratrain``): ``single`` as one
process, ``ddp`` and ``fsdp`` under torchrun with ``--nproc`` ranks. A round runs every run of every case once, the
order rotated by one run per round, so a drift of the machine's load does not favour one side. Per case and round,
ratio = hydratrain tokens/s / hand-written tokens/s over the same timed steps; the table gives the median ratio over
rounds with its min and max. Precisions: fp32, and bf16 where the device computes it natively (an AVX512-BF16/AMX
CPU, an Ampere or newer GPU). The precision rows run the same work on both sides (the hand loop uses the
AdamW implementation ``optim.impl=auto`` picks; hydratrain runs eager, ``trainer.compile=false``, where its
``auto`` would compile, i.e. on CUDA); the ``defaults`` rows compare hydratrain with no override (``precision=auto``,
``optim.impl=auto``, ``trainer.compile=auto``, ...) against the hand-written fp32 eager loop with torch's own AdamW
choice. bench/gpu_table.py sets the defaults against the hand-written loop at the same precision, eager and compiled.
Results: ``<out>/results.jsonl`` (one line per run, the first describes the machine) and ``<out>/results.md``.
"""
from __future__ import annotations

import argparse
import sys

from benchlib import (
    BENCH,
    MODELS,
    Recorder,
    at_least,
    auto_choices,
    auto_compiles,
    clean_env,
    command,
    csv_of,
    fmt,
    load,
    median_min_max,
    out_dir,
    rotated,
    run_json,
    table,
    write_report,
)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=at_least(1), default=4)
    p.add_argument("--strategies", type=csv_of(("single", "ddp", "fsdp")), default="single,ddp,fsdp")
    p.add_argument("--precisions", type=csv_of(("fp32", "bf16", "fp16")), default="fp32,bf16",
                   help="bf16 is skipped where it is not native")
    p.add_argument("--model", choices=MODELS, default="gpt_tiny")
    p.add_argument("--batch", type=at_least(1), default=16)
    p.add_argument("--seq", type=at_least(2), default=256)
    p.add_argument("--steps", type=at_least(2), default=31)
    p.add_argument("--warm", type=at_least(1), default=11)
    p.add_argument("--nproc", type=at_least(1), default=2, help="ranks for ddp and fsdp")
    p.add_argument("--device", default="auto")
    p.add_argument("--no-defaults", action="store_true", help="skip the defaults-vs-hand-written-fp32 rows")
    p.add_argument("--timeout", type=float, default=900, help="seconds per run")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.warm >= args.steps:
        p.error(f"--warm {args.warm}: must be below --steps {args.steps} (the steps after it are timed)")

    auto, adamw = auto_choices(args.device)
    precisions = [x for x in args.precisions if x != "bf16" or auto == "bf16"]
    strategies = args.strategies
    out = out_dir("overhead", args.out)
    rec = Recorder(out, "overhead", {**vars(args), "auto_precision": auto, "auto_adamw": adamw})
    # runs: (impl, strategy, precision flag, --adamw). Overhead pairs run the same work on both sides: the hand loop
    # gets the AdamW implementation hydratrain's optim.impl=auto picks. A hydratrain run at the precision auto picks
    # is its defaults run; the defaults rows compare it with the hand loop as a user writes it (torch's AdamW choice).
    # Where trainer.compile=auto compiles (CUDA), the precision rows' hydratrain runs are eager (--compile none, the
    # same work as the eager hand loop) and the defaults run is another run; on a CPU auto is eager, so one run
    # serves both.
    compiles = auto_compiles(args.device)
    eager = ("none",) if compiles else ()

    def defaults_run(s: str) -> tuple:
        return ("hydratrain", s, "auto", "default") + (("default",) if compiles else ())

    runs = []
    for s in strategies:
        for prec in precisions:
            runs.append(("hand", s, prec, adamw))
            runs.append(("hydratrain", s, "auto" if prec == auto else prec, "default") + eager)
        if not args.no_defaults and defaults_run(s) not in runs:
            runs.append(defaults_run(s))
        if not args.no_defaults:
            runs.append(("hand", s, "fp32", "default"))
    common = ["--model", args.model, "--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps),
              "--warm", str(args.warm), "--device", args.device]
    print(f"bench/overhead.py: precision=auto picks {auto} and optim.impl=auto picks {adamw} AdamW here; "
          f"{len(runs)} runs x {args.rounds} rounds; results in {out}", flush=True)
    tps: dict[tuple, list[float]] = {}
    for r in range(args.rounds):
        for run in rotated(runs, r):
            impl, s, prec, opt = run[:4]
            nproc = 1 if s == "single" else args.nproc
            compile_flag = ["--compile", run[4]] if len(run) > 4 else []
            cmd = command([str(BENCH / "train_worker.py"), "--impl", impl, "--strategy", s, "--precision", prec,
                           "--adamw", opt, *compile_flag, *common], nproc)
            before = load()
            row, tail, seconds = run_json(cmd, clean_env(), args.timeout)
            if row is None:
                print(f"round {r + 1}: {impl} {s} {prec} {opt} FAILED ({seconds:.0f} s)\n{tail}", flush=True)
                rec.write({"kind": "run", "round": r, "impl": impl, "strategy": s, "precision_flag": prec,
                           "adamw": opt, "failed": tail[-2000:], "load_1min": before})
                continue
            rec.write({"kind": "run", "round": r, "precision_flag": prec, "load_1min": before, "seconds": seconds,
                       **row})
            tps.setdefault(run, [None] * args.rounds)[r] = row["tokens_per_sec"]
            print(f"round {r + 1}: {impl:<10} {s:<6} {prec:<4} adamw {opt:<8} {row['tokens_per_sec']:>10,.0f} "
                  f"tokens/s (load {before:.1f})", flush=True)

    def ratios(a: tuple, b: tuple) -> list[float]:
        xs, ys = tps.get(a, []), tps.get(b, [])
        return [x / y for x, y in zip(xs, ys) if x and y]

    rows, summary = [], []
    for s in strategies:
        nproc = 1 if s == "single" else args.nproc
        cases = [(f"{prec}", ("hydratrain", s, "auto" if prec == auto else prec, "default") + eager,
                  ("hand", s, prec, adamw)) for prec in precisions]
        if not args.no_defaults:
            cases.append((f"defaults (auto = {auto}, {adamw} AdamW{', compiled' if compiles else ''}) vs "
                          "hand-written fp32", defaults_run(s), ("hand", s, "fp32", "default")))
        for label, ht, hand in cases:
            rs = ratios(ht, hand)
            med, lo, hi = median_min_max(rs)
            ht_med = median_min_max(v for v in tps.get(ht, []) if v)[0]
            hand_med = median_min_max(v for v in tps.get(hand, []) if v)[0]
            rows.append([s, nproc, label, fmt(ht_med), fmt(hand_med), fmt(med, ".3f"),
                         f"{fmt(lo, '.3f')} - {fmt(hi, '.3f')}", len(rs)])
            summary.append({"kind": "summary", "strategy": s, "nproc": nproc, "case": label, "ratio_median": med,
                            "ratio_min": lo, "ratio_max": hi, "rounds": len(rs), "hydratrain_tokens_per_sec": ht_med,
                            "hand_tokens_per_sec": hand_med})
    for row in summary:
        rec.write(row)
    body = table(["strategy", "ranks", "precision", "hydratrain tokens/s", "hand-written tokens/s",
                  "ratio (median)", "ratio min - max", "rounds"], rows)
    body += (f"\n\n{args.model}, {args.batch} x {args.seq} tokens per rank and step, steps {args.warm + 1}-"
             f"{args.steps} timed; tokens/s are medians over rounds (all ranks together); precision=auto picks "
             f"{auto} on this machine. Precision rows: both sides use {adamw} AdamW (what optim.impl=auto picks "
             "here); defaults rows: the hand-written loop uses torch's own AdamW choice, as a user's loop would.")
    text = write_report(out, "bench/overhead.py: hydratrain vs a hand-written loop", rec.rows[0], body,
                        " ".join(["python", "bench/overhead.py", *(argv if argv is not None else sys.argv[1:])]))
    print("\n" + text)
    return 0 if all(r.get("rounds") for r in summary) else 1


if __name__ == "__main__":
    sys.exit(main())
