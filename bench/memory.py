"""Memory scaling of FSDP: per-rank parameter + gradient + optimizer-state bytes and peak memory at W = 1, 2, 4 ranks,
each as a ratio to 1/W of the single-process (strategy=single) figure.

    python bench/memory.py                                    # gpt_small (85M), fp32, 3 steps of 2 x 128 tokens
    python bench/memory.py --ranks 1,2 --model gpt_tiny --steps 2
    python bench/memory.py --device cuda --batch 8 --seq 1024 --ranks 1,2,4,8

Every run is ``bench/train_worker.py --impl hydratrain --memory`` (torchrun for W > 1): the figures are the maximum
over ranks of the local shards (``DTensor.to_local``) of the parameters, of the gradients just before the optimizer
step, and of the optimizer state (``hydratrain.optim.state_bytes``); peak memory is ``mem/peak`` (CUDA:
``max_memory_allocated``; CPU: the peak resident set size, whose fixed part -- the interpreter and torch's libraries
-- is also shown subtracted: "peak above start" is the growth from just before the model was built). On CPU glibc's
malloc keeps freed memory in its heap, so the resident peak of a 2-rank gpt_small run was 1952 MB above start with
its defaults against 858 MB with ``MALLOC_MMAP_THRESHOLD_=131072`` (``--malloc mmap``, the default here, as in
bench/plan_accuracy.py). An ideal
sharding gives ratio 1.00 for the model state; peak memory also holds unsharded activations and the gathered
parameters of the block being computed, so its ratio is above 1.
"""
from __future__ import annotations

import argparse
import sys

from benchlib import (
    BENCH,
    MODELS,
    Recorder,
    at_least,
    clean_env,
    command,
    csv_of,
    fmt,
    load,
    out_dir,
    run_json,
    table,
    write_report,
)

MB = 1e6


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=MODELS, default="gpt_small")
    p.add_argument("--ranks", type=csv_of(item=at_least(1)), default="1,2,4", help="FSDP world sizes")
    p.add_argument("--batch", type=at_least(1), default=2)
    p.add_argument("--seq", type=at_least(2), default=128)
    p.add_argument("--steps", type=at_least(2), default=3)
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32")
    p.add_argument("--device", default="auto")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--malloc", choices=["mmap", "default"], default="mmap",
                   help="mmap: MALLOC_MMAP_THRESHOLD_=131072 (freed tensors go back to the OS, so the CPU peak "
                        "measures tensors, not glibc's heap); default: glibc as it comes")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    malloc_env = {"MALLOC_MMAP_THRESHOLD_": str(2 ** 17)} if args.malloc == "mmap" else {}
    out = out_dir("memory", args.out)
    rec = Recorder(out, "memory", vars(args))
    runs = [("single", 1)] + [("fsdp", w) for w in args.ranks]
    common = ["--impl", "hydratrain", "--memory", "--model", args.model, "--batch", str(args.batch), "--seq",
              str(args.seq), "--steps", str(args.steps), "--warm", "1", "--precision", args.precision,
              "--device", args.device]
    got = {}
    for strategy, w in runs:
        cmd = command([str(BENCH / "train_worker.py"), "--strategy", strategy, *common], w)
        before = load()
        env = clean_env(**malloc_env)
        if args.malloc == "default":
            env.pop("MALLOC_MMAP_THRESHOLD_", None)
        row, tail, seconds = run_json(cmd, env, args.timeout)
        if row is None:
            print(f"{strategy} x{w} FAILED\n{tail}", flush=True)
            rec.write({"kind": "run", "strategy": strategy, "ranks": w, "failed": tail[-2000:]})
            continue
        row["state_bytes"] = row["param_bytes"] + row["grad_bytes"] + row["optim_bytes"]
        rec.write({"kind": "run", "ranks": w, "load_1min": before, "seconds": seconds, **row})
        got[(strategy, w)] = row
        print(f"{strategy:<6} x{w}: params {row['param_bytes'] / MB:.1f} MB, grads {row['grad_bytes'] / MB:.1f} MB, "
              f"optimizer {row['optim_bytes'] / MB:.1f} MB, peak {row['peak_memory_bytes'] / MB:.0f} MB per rank "
              f"({seconds:.0f} s)", flush=True)
    single = got.get(("single", 1))
    rows = []
    for (strategy, w), row in got.items():
        def ratio(key: str, row=row, w=w) -> str:
            return fmt(row[key] / (single[key] / w), ".2f") if single and single.get(key) else "n/a"

        rows.append([strategy, w, fmt(row["param_bytes"] / MB, ".1f"), fmt(row["grad_bytes"] / MB, ".1f"),
                     fmt(row["optim_bytes"] / MB, ".1f"), fmt(row["state_bytes"] / MB, ".1f"), ratio("state_bytes"),
                     fmt(row["peak_memory_bytes"] / MB, ".0f"), fmt(row["peak_above_start_bytes"] / MB, ".0f"),
                     ratio("peak_above_start_bytes")])
        rec.write({"kind": "summary", "strategy": strategy, "ranks": w,
                   "state_ratio_to_single_over_w": row["state_bytes"] / (single["state_bytes"] / w) if single else None,
                   "peak_above_start_ratio_to_single_over_w":
                       row["peak_above_start_bytes"] / (single["peak_above_start_bytes"] / w) if single else None})
    body = table(["strategy", "ranks W", "params MB", "grads MB", "optimizer MB", "state MB (sum)",
                  "state / (single / W)", "peak MB", "peak above start MB", "peak above start / (single / W)"], rows)
    n = got.get(("single", 1), {}).get("n_params")
    body += (f"\n\n{args.model}" + (f" ({n / 1e6:.1f}M parameters)" if n else "") + f", {args.precision}, "
             f"{args.batch} x {args.seq} tokens per rank, {args.steps} steps; per rank, max over ranks; "
             "MB = 1e6 bytes.")
    text = write_report(out, "bench/memory.py: FSDP memory per rank", rec.rows[0], body,
                        " ".join(["python", "bench/memory.py", *(argv if argv is not None else sys.argv[1:])]))
    print("\n" + text)
    return 0 if len(got) == len(runs) else 1


if __name__ == "__main__":
    sys.exit(main())
