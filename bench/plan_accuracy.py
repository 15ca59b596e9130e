"""Accuracy of the memory planner: predicted vs measured per-rank peak memory, on CPU.

    python bench/plan_accuracy.py            # the configurations below, a few steps each (~15 min on 2 busy cores)
    python bench/plan_accuracy.py --tiny     # the same shapes of run, tiny (the smoke test runs this)
    python bench/plan_accuracy.py --only single_fp32_ac --out /tmp/acc

Two kinds of model: hydratrain's GPT (its own analytic memory model, ``hydratrain.models.gpt_memory``), and models
that are not a GPT, planned by the generic plan (``hydratrain.stepsim``): ``+experiment=digits_cnn`` (a CNN with
BatchNorm) and ``examples/own_model`` (a residual MLP, run from its dir with ``--config-dir my_conf``), each as it
ships (``digits_*``, ``own_*``: the process's baseline makes most of the peak) and scaled up so that activations do
(``digits_big_*``, ``own_big_*``).

Allocator: glibc's malloc keeps freed memory in its heap, and on CPU the resident peak of a training step ends up
40-120% above the bytes of the tensors alive at any moment (heap fragmentation, growing over the first steps; see
docs/memory-planner.md, "CPU and glibc"). The planner predicts the tensors. With ``--malloc mmap`` (the default here)
every run gets ``MALLOC_MMAP_THRESHOLD_=131072``: each allocation of 128 KiB or more is mapped on its own and returned
when freed, so the resident set measures what the tensors need; ``--malloc default`` measures glibc as it comes.

Each configuration trains for ``--steps`` optimizer steps (>= 2: from step 2 on AdamW's moments exist during forward
and backward) on synthetic data; samples, weights, checkpoints and TensorBoard off, one eval at the end on 8 samples.
``predicted`` is the plan the run logs at its start (``results.json``: ``planned_peak_memory_bytes``, max over ranks),
``measured`` the peak resident set of each rank (``VmHWM`` since the run's start, ``peak_memory_bytes``, max over
ranks). The error is (predicted - measured) / measured. Writes ``<out>/plan_accuracy.jsonl`` (one JSON line per
configuration) and ``<out>/plan_accuracy.md`` (the table), and prints the table.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib import at_least

ROOT = Path(__file__).resolve().parents[1]
MIB = 2 ** 20
MMAP_THRESHOLD = 2 ** 17  # MALLOC_MMAP_THRESHOLD_ of --malloc mmap: every allocation of 128 KiB or more is its own mmap
# A GPT of 8 x 512 (26M parameters, 0.4 GB of fp32 weights + gradients + AdamW moments on one rank), so that the
# model and its activations, not the ~0.3 GB process baseline, make most of the peak.
MODEL = ["model.d_model=512", "model.n_layer=8", "model.n_head=8", "model.max_seq_len=512"]
TINY = ["model.d_model=64", "model.n_layer=2", "model.n_head=2", "model.max_seq_len=64"]
COMMON = ["data=synthetic", "device=cpu", "trainer.eval_every_n_steps=0", "trainer.sample_tokens=0",
          "trainer.save_weights=false", "trainer.progress_bar=false", "trainer.log_every_n_steps=1",
          "trainer.eval_samples=8",
          "checkpoint.every_n_steps=0", "logger.tensorboard=false", "logger.peak_flops=1e11",
          "scheduler=constant"]

# name, ranks, overrides (batch x seq given per config; --tiny scales them down)
CONFIGS = [
    ("single_fp32", 1, ["strategy=single", "precision=fp32", "data.batch_size=8", "data.seq_len=512"]),
    ("single_fp32_ac", 1, ["strategy=single", "precision=fp32", "data.batch_size=8", "data.seq_len=512",
                           "activation_checkpointing=true"]),
    ("single_bf16_b4_t256", 1, ["strategy=single", "precision=bf16", "data.batch_size=4", "data.seq_len=256"]),
    ("single_fp32_vocab16k", 1, ["strategy=single", "precision=fp32", "data.batch_size=4", "data.seq_len=512",
                                 "model.vocab_size=16384"]),
    ("ddp2_fp32", 2, ["strategy=ddp", "precision=fp32", "data.batch_size=4", "data.seq_len=512"]),
    ("fsdp1_fp32", 1, ["strategy=fsdp", "precision=fp32", "data.batch_size=8", "data.seq_len=256"]),
    ("fsdp2_fp32", 2, ["strategy=fsdp", "precision=fp32", "data.batch_size=8", "data.seq_len=512"]),
    ("fsdp4_fp32_ac", 4, ["strategy=fsdp", "precision=fp32", "data.batch_size=8", "data.seq_len=512",
                          "activation_checkpointing=true"]),
    ("fsdp2_bf16_accum2", 2, ["strategy=fsdp", "precision=bf16", "data.batch_size=2", "data.seq_len=256",
                              "trainer.grad_accum_steps=2"]),
]
# models that are not a GPT: name, ranks, overrides, the example they run (EXAMPLES: launch dir, its own overrides)
EXAMPLES = {"digits": (".", ["+experiment=digits_cnn"]),
            "own_model": ("examples/own_model", ["--config-dir", "my_conf", "+experiment=spirals"])}
EXAMPLE_COMMON = ["device=cpu", "trainer.eval_every_n_steps=0", "trainer.save_weights=false",
                  "trainer.progress_bar=false", "trainer.log_every_n_steps=1", "trainer.eval_samples=64",
                  "checkpoint.every_n_steps=0", "logger.tensorboard=false", "logger.peak_flops=1e11",
                  "scheduler=constant"]
DIGITS_BIG = ["model.channels=128", "model.depth=6"]  # 1024 x 128 x 8 x 8 fp32 = 32 MiB per conv output
OWN_BIG = ["model.width=512", "model.depth=6", "data.n=20000"]  # 2048 x 2048 fp32 = 16 MiB per hidden layer
EXAMPLE_CONFIGS = [
    ("digits_single_fp32", 1, "digits", ["strategy=single", "precision=fp32"]),
    ("digits_single_bf16", 1, "digits", ["strategy=single", "precision=bf16"]),
    ("digits_ddp2_fp32", 2, "digits", ["strategy=ddp", "precision=fp32"]),
    ("digits_fsdp2_fp32", 2, "digits", ["strategy=fsdp", "precision=fp32"]),
    ("digits_fsdp2_bf16", 2, "digits", ["strategy=fsdp", "precision=bf16"]),
    ("own_single_fp32", 1, "own_model", ["strategy=single", "precision=fp32"]),
    ("own_ddp2_fp32", 2, "own_model", ["strategy=ddp", "precision=fp32"]),
    ("own_fsdp2_fp32", 2, "own_model", ["strategy=fsdp", "precision=fp32"]),
    ("digits_big_single_fp32", 1, "digits", [*DIGITS_BIG, "strategy=single", "precision=fp32", "data.batch_size=1024"]),
    ("digits_big_single_bf16_ac", 1, "digits", [*DIGITS_BIG, "strategy=single", "precision=bf16",
                                                "data.batch_size=1024", "activation_checkpointing=true"]),
    ("digits_big_ddp2_fp32", 2, "digits", [*DIGITS_BIG, "strategy=ddp", "precision=fp32", "data.batch_size=512"]),
    ("digits_big_fsdp2_bf16", 2, "digits", [*DIGITS_BIG, "strategy=fsdp", "precision=bf16", "data.batch_size=512"]),
    ("own_big_single_fp32", 1, "own_model", [*OWN_BIG, "strategy=single", "precision=fp32", "data.batch_size=2048"]),
    ("own_big_ddp2_fp32", 2, "own_model", [*OWN_BIG, "strategy=ddp", "precision=fp32", "data.batch_size=2048"]),
    ("own_big_fsdp2_fp32_ac", 2, "own_model", [*OWN_BIG, "strategy=fsdp", "precision=fp32", "data.batch_size=2048",
                                               "activation_checkpointing=true"]),
]


def tiny(overrides: list[str]) -> list[str]:
    """The same configuration, tiny: batch 2, sequence 32, vocabulary at most 512."""
    out = []
    for o in overrides:
        key, _, value = o.partition("=")
        if key == "data.batch_size":
            o = "data.batch_size=2"
        elif key == "data.seq_len":
            o = "data.seq_len=32"
        elif key == "model.vocab_size":
            o = "model.vocab_size=512"
        out.append(o)
    return out


def run_config(name: str, ranks: int, overrides: list[str], out: Path, steps: int, malloc: str,
               cwd: Path = ROOT) -> dict:
    run_dir = out / name
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"] \
        if ranks > 1 else [sys.executable]
    cmd = [*launcher, str(ROOT / "train.py"), *overrides, f"trainer.max_steps={steps}", f"hydra.run.dir={run_dir}"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT", "LOCAL_WORLD_SIZE")}
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    if malloc == "mmap":
        env["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=str(cwd), env=env, capture_output=True, text=True)
    seconds = time.monotonic() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{name}: exit {proc.returncode}: {' '.join(cmd)}\n{(proc.stdout + proc.stderr)[-3000:]}")
    res = json.loads((run_dir / "results.json").read_text())
    log = (run_dir / "train_rank0.log").read_text()
    moment = next((line.split(" at ", 1)[1].split(" (")[0] for line in log.splitlines()
                   if "memory plan: peak" in line), "?")
    predicted, measured = res["planned_peak_memory_bytes"], res["peak_memory_bytes"]
    return {"name": name, "ranks": ranks, "overrides": overrides, "steps": steps, "malloc": malloc,
            "predicted_bytes": predicted,
            "measured_bytes": measured, "error": (predicted - measured) / measured, "moment": moment,
            "seconds": round(seconds, 1)}


def table(rows: list[dict]) -> str:
    lines = ["| config | ranks | overrides | predicted (MiB) | measured (MiB) | error | peak at |",
             "| --- | --- | --- | ---: | ---: | ---: | --- |"]
    for r in rows:
        shown = " ".join(o for o in r["overrides"] if not o.startswith(("strategy=",)))
        lines.append(f"| {r['name']} | {r['ranks']} | `{shown}` | {r['predicted_bytes'] / MIB:,.0f} | "
                     f"{r['measured_bytes'] / MIB:,.0f} | {r['error']:+.1%} | {r['moment']} |")
    worst = max(abs(r["error"]) for r in rows)
    lines.append(f"\nlargest error: {worst:.1%} over {len(rows)} configurations")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny sizes (smoke test)")
    ap.add_argument("--steps", type=at_least(2), default=3, help="optimizer steps per configuration (>= 2)")
    ap.add_argument("--only", nargs="*", choices=[c[0] for c in CONFIGS + EXAMPLE_CONFIGS],
                    help="configuration names to run")
    ap.add_argument("--malloc", choices=("mmap", "default"), default="mmap",
                    help="mmap: glibc's mmap threshold fixed at 128 KiB, so the resident set tracks the tensors "
                         "(default); default: glibc as it comes (heap fragmentation included)")
    ap.add_argument("--out", type=Path, default=None, help="output dir (default: a temporary dir)")
    args = ap.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="plan_accuracy_"))
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, ranks, *example, overrides in CONFIGS + [(n, r, e, o) for n, r, e, o in EXAMPLE_CONFIGS
                                                       if not args.tiny or "_big_" not in n]:
        if args.only and name not in args.only:
            continue
        if example:  # a model that is not a GPT: its own launch dir and overrides
            where, own = EXAMPLES[example[0]]
            row = run_config(name, ranks, [*own, *EXAMPLE_COMMON, *overrides], out, args.steps, args.malloc,
                             cwd=ROOT / where)
            row["overrides"] = overrides
        else:
            full = COMMON + (TINY + tiny(overrides) if args.tiny else MODEL + overrides)
            row = run_config(name, ranks, full, out, args.steps, args.malloc)
            row["overrides"] = tiny(overrides) if args.tiny else overrides
        rows.append(row)
        print(f"{name}: predicted {row['predicted_bytes'] / MIB:,.0f} MiB, measured {row['measured_bytes'] / MIB:,.0f}"
              f" MiB, error {row['error']:+.1%} ({row['seconds']} s)", flush=True)
        with open(out / "plan_accuracy.jsonl", "a") as fh:
            fh.write(json.dumps(row) + "\n")
    text = table(rows)
    (out / "plan_accuracy.md").write_text(text + "\n")
    print(text)
    print(f"written: {out / 'plan_accuracy.jsonl'}, {out / 'plan_accuracy.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
