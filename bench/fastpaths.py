"""Fast paths: what each candidate setting buys on this machine, in tokens/s and compile seconds, one process.

    python bench/fastpaths.py                        # gpt_tiny, 16 x 256 tokens, 3 interleaved rounds
    python bench/fastpaths.py --rounds 1 --steps 12 --warm 4 --no-compile
    python bench/fastpaths.py --model gpt_small --batch 8 --seq 1024 --device cuda

Cases (``bench/train_worker.py --impl hand`` unless marked; one process, ``strategy=single``):

- eager in fp32, and in bf16 where native (``torch.autocast``): the baseline and the precision candidate;
- ``torch.compile`` of each block (what ``trainer.compile=true`` does) and of the whole model, per precision:
  tokens/s after compilation, and the first step's seconds (compilation included);
- AdamW's for-loop, foreach and fused implementations (at the precision ``auto`` picks);
- CPU threads per process: 1 and all cores (at the precision ``auto`` picks; hydratrain's rule is all cores
  divided by the ranks on the node);
- hydratrain with its defaults (``--impl hydratrain``, ``precision=auto``).

Each row gives the median tokens/s over rounds, the ratio to eager fp32 (the hand-written loop a user starts with),
MFU (tokens/s x the model's FLOPs per token over the peak matmul rate of the dtype, measured per machine and
cached) and the ceiling: the tokens/s at which one step would take exactly its matmul-bound time (peak / FLOPs per
token, i.e. MFU 100 %).
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
    clean_env,
    command,
    cores,
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
    p.add_argument("--rounds", type=at_least(1), default=3)
    p.add_argument("--model", choices=MODELS, default="gpt_tiny")
    p.add_argument("--batch", type=at_least(1), default=16)
    p.add_argument("--seq", type=at_least(2), default=256)
    p.add_argument("--steps", type=at_least(2), default=31)
    p.add_argument("--warm", type=at_least(1), default=11)
    p.add_argument("--device", default="auto")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile cases (slow to start on CPU)")
    p.add_argument("--timeout", type=float, default=1200)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    auto, _ = auto_choices(args.device)
    precisions = ["fp32"] + (["bf16"] if auto == "bf16" else [])
    n_cores = cores()
    cases: list[tuple[str, list[str]]] = []
    for prec in precisions:
        cases.append((f"eager {prec}", ["--impl", "hand", "--precision", prec]))
        if not args.no_compile:
            cases.append((f"compile blocks {prec}", ["--impl", "hand", "--precision", prec, "--compile", "blocks"]))
            cases.append((f"compile model {prec}", ["--impl", "hand", "--precision", prec, "--compile", "model"]))
    for impl in ("for_loop", "foreach", "fused"):
        cases.append((f"AdamW {impl} ({auto})", ["--impl", "hand", "--precision", auto, "--adamw", impl]))
    if n_cores > 1 and not args.device.startswith("cuda"):  # CPU threads: no question on a GPU
        for threads in (1, n_cores):
            cases.append((f"{threads} thread(s) ({auto})", ["--impl", "hand", "--precision", auto, "--threads",
                                                            str(threads)]))
    cases.append(("hydratrain defaults", ["--impl", "hydratrain", "--precision", "auto"]))
    out = out_dir("fastpaths", args.out)
    rec = Recorder(out, "fastpaths", {**vars(args), "auto_precision": auto})
    common = ["--strategy", "single", "--model", args.model, "--batch", str(args.batch), "--seq", str(args.seq),
              "--steps", str(args.steps), "--warm", str(args.warm), "--device", args.device]
    print(f"bench/fastpaths.py: precision=auto picks {auto}; {len(cases)} cases x {args.rounds} rounds; results in "
          f"{out}", flush=True)
    got: dict[str, list[dict]] = {}
    for r in range(args.rounds):
        for name, flags in rotated(cases, r):
            before = load()
            row, tail, seconds = run_json(command([str(BENCH / "train_worker.py"), *flags, *common], 1),
                                          clean_env(), args.timeout)
            if row is None:
                print(f"round {r + 1}: {name} FAILED\n{tail}", flush=True)
                rec.write({"kind": "run", "round": r, "case": name, "failed": tail[-2000:], "load_1min": before})
                continue
            rec.write({"kind": "run", "round": r, "case": name, "load_1min": before, "seconds": seconds, **row})
            got.setdefault(name, []).append(row)
            print(f"round {r + 1}: {name:<28} {row['tokens_per_sec']:>10,.0f} tokens/s, first step "
                  f"{row.get('first_step_s', float('nan')):.1f} s (load {before:.1f})", flush=True)
    base = median_min_max(x["tokens_per_sec"] for x in got.get("eager fp32", []))[0]
    rows = []
    for name, _ in cases:
        xs = got.get(name, [])
        if not xs:
            rows.append([name, "failed", "", "", "", "", "", ""])
            continue
        tps, lo, hi = median_min_max(x["tokens_per_sec"] for x in xs)
        first = median_min_max(x.get("first_step_s", float("nan")) for x in xs)[0]
        fpt, peak = xs[0].get("flops_per_token"), xs[0].get("peak_flops_total")
        mfu = tps * fpt / peak if fpt and peak else float("nan")
        ceiling = peak / fpt if fpt and peak else float("nan")
        rows.append([name, xs[0].get("precision", "?"), fmt(tps), f"{fmt(lo)} - {fmt(hi)}",
                     fmt(tps / base if base == base else float("nan"), ".2f") + "x", fmt(first, ".1f"),
                     fmt(100 * mfu, ".1f") + " %", fmt(ceiling)])
        rec.write({"kind": "summary", "case": name, "tokens_per_sec": tps, "min": lo, "max": hi,
                   "ratio_to_eager_fp32": tps / base if base else None, "first_step_s": first, "mfu": mfu,
                   "ceiling_tokens_per_sec": ceiling, "threads": xs[0].get("threads")})
    body = table(["case", "precision", "tokens/s (median)", "min - max", "x eager fp32", "first step s", "MFU",
                  "ceiling tokens/s (MFU 100 %)"], rows)
    body += (f"\n\n{args.model}, {args.batch} x {args.seq} tokens per step, one process, steps {args.warm + 1}-"
             f"{args.steps} timed; precision=auto picks {auto} here; threads: {n_cores} unless stated; the ceiling is "
             "the measured peak matmul rate of the row's dtype over the model's FLOPs per token.")
    text = write_report(out, "bench/fastpaths.py: candidate fast paths", rec.rows[0], body,
                        " ".join(["python", "bench/fastpaths.py", *(argv if argv is not None else sys.argv[1:])]))
    print("\n" + text)
    return 0 if all(got.get(n) for n, _ in cases) else 1


if __name__ == "__main__":
    sys.exit(main())
