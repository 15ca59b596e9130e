"""Side by side on a GPU: hydratrain's defaults against the hand-written loop at the same precision (bf16 on both
sides), eager and compiled, for gpt_small (single and fsdp) and llama_1b (fsdp, seq 2048), each model at the
micro-batch the memory planner picks (``data.batch_size=auto``). One launch per row (``bench/train_worker.py``).

    python bench/gpu_table.py                     # on the GPU(s): the plan below, within --budget-s (420 s)
    python bench/gpu_table.py --dry-run           # the same plan, tiny, on CPU (gloo); compile disabled and the
                                                  #   hand compiled rows skipped unless --dry-compile
                                                  #   (torch.compile is covered by tests/e2e/test_compile)
    python bench/gpu_table.py --print-plan [--dry-run]    # the plan only
    python bench/gpu_table.py --rows fp8          # only the fp8 row set (below)
    python bench/gpu_table.py --rows hf_trainer   # only hydratrain against transformers.Trainer (below)
    python bench/gpu_table.py --rows save         # only asynchronous against synchronous checkpoint saves (below)
    python bench/gpu_table.py --rows torchtitan   # only torchtitan's trainer against hydratrain (below)

The plan (N = the GPUs, at most ``--max-nproc``; fsdp rows run on N ranks under torchrun):

1. the batch per model: ``train_worker.py --impl plan`` (what ``data.batch_size=auto`` picks: gpt_small at seq 1024
   for ``single``, llama_1b at seq 2048 for ``fsdp`` on N ranks as hydratrain trains it), used by every row of it;
2. rows, most important first: gpt_small single (hand eager, hydratrain defaults, hand with the whole model
   compiled), llama_1b fsdp (hydratrain defaults with a short profile, hand eager, hand compiled per block),
   gpt_small fsdp (hand eager; hydratrain's defaults, or with N = 1 hydratrain with FSDP kept at one rank, since its
   defaults train as ``single`` there, which the gpt_small single row measured; hand compiled per block). hydratrain
   rows run with no override but model, data, batch, seq, strategy and the bench's step
   counts (so ``precision=auto``, ``trainer.compile=auto``, ``strategy.shard_on_one_rank=auto``: on one GPU
   ``strategy=fsdp`` trains as ``single``, which the "trained as" column shows).

Row sets (``--rows``, default all, in this order; the budget drops the rows it cannot fit, last first):

- ``vs_hand``: the rows above;
- ``fp8``: llama_1b, ``precision=fp8`` (torchao's float8, tensorwise) against ``precision=bf16``, both hydratrain
  with its defaults otherwise (compile, strategy=fsdp as the llama_1b rows), at the same batch (the plan's, at most
  :data:`FP8_MAX_BATCH`), :data:`FP8_STEPS` steps each (10 untimed): tokens/s and the loss at the last step (the
  mean train loss of its logging window, the last 10 steps; synthetic data, the same batches on both sides). Alone
  (``--rows fp8``, ``TABLE_ROWS=fp8 bench/gpu.sh``) it fits one 8-minute call; in the dry run fp8 is emulated
  (``precision.fp8_emulate=true``) and converts every layer (``precision.fp8_size_rule=false``: gpt_tiny is below
  torchao's size rule), a few steps;
- ``hf_trainer``: hydratrain ``model=hf_causal_lm`` (its defaults: compile, precision; ``strategy=single``) against
  ``transformers.Trainer`` (``bench/hf_trainer_worker.py``: ``bf16=True``, its own defaults otherwise, no compile)
  on one GPU, the same Llama of 1,038,682,112 parameters (:data:`HF_LLAMA_1B`: llama_1b's shape, SDPA attention on
  both sides), the same :data:`HF_BATCH` x 2048 tokens of ``data=synthetic`` per step (labels = inputs on the
  Trainer's side), lr, weight decay, clipping and schedule, :data:`HF_STEPS` steps each (:data:`HF_WARM` untimed).
  A fixed batch, no plan launch: 4 x 2048 is about 45 GB for the eager Trainer in bf16 without activation
  checkpointing (16.6 GB of fp32 weights, gradients and AdamW state, about 23 GB of activations, 3 GB of logits and
  their loss), within an H100's 80 GB; 8 x 2048 would be about 70 GB. Estimated about 2.5 minutes on one H200 (the
  llama_1b rows of vs_hand: 80 s with 49 s of compilation for hydratrain, 33 s eager), so alone (``--rows
  hf_trainer``, ``TABLE_ROWS=hf_trainer bench/gpu.sh``) it fits one 8-minute call; after vs_hand (397 s of the
  420 s budget on one H200) the budget drops it. In the dry run a tiny Llama (:data:`HF_TINY`), 2 x 64 tokens, a few
  steps, each side's ``auto`` precision (fp32 on a CPU without native bf16). Both sides need transformers (extra
  [hf]); without it the rows are skipped.
- ``save``: llama_1b (hydratrain's defaults, the fp8 rows' batch) saving one checkpoint after step :data:`SAVE_AT`,
  synchronously and with ``checkpoint.async_save=true``, :data:`SAVE_STEPS` steps each (:data:`SAVE_WARM`
  untimed): the step after the save (which holds what the save blocked) against the median of the other timed
  steps; the target: the async save's step within :data:`SAVE_TARGET` of a normal step. Alone (``--rows save``,
  ``TABLE_ROWS=save bench/gpu.sh``) it fits one 8-minute call.
- ``torchtitan``: torchtitan's Llama-3 trainer (``bench/torchtitan_worker.py``: its ``Llama3Model`` with llama_1b's
  dimensions, FSDP2 with bf16 parameters, each block compiled, every block's activations recomputed, causal SDPA)
  as it ships (one CUDA graph per step) and with CUDA graphs off, against hydratrain's defaults with
  ``activation_checkpointing=true`` (and, on one GPU, with FSDP kept), the same batch (the plan's, at most
  :data:`TT_MAX_BATCH`) and :data:`TT_STEPS` steps each (:data:`TT_WARM` untimed): tokens/s, MFU, peak memory and
  parameter count; the targets (:data:`TT_TARGETS`): hydratrain >= 1.0x torchtitan's tokens/s at <= 1.05x its
  peak memory, against torchtitan's faster row. torchtitan is not a dependency of hydratrain: ``bash
  bench/torchtitan_deps.sh wheels`` puts its wheels in bench/wheels, which bench/gpu.sh unpacks (or
  ``TORCHTITAN_SITE=DIR``); without it the rows are skipped. Alone (``--rows torchtitan``, ``TABLE_ROWS=torchtitan
  bench/gpu.sh``) it fits one 8-minute call; the dry run runs its first two rows, compile off on both sides.

Each row: tokens/s over steps ``--warm``+1..``--steps`` (a device synchronisation after each step), MFU (the
model's FLOPs per token over the device's datasheet peak, ``hydratrain.metrics``), peak memory over the timed steps,
and compile seconds (the first step's seconds minus a timed step's). The budget is kept by construction: each launch
gets at most the time left (``--budget-s`` in all), and a row that would start with less than ``--min-case-s`` left
is reported as skipped. Results: ``<out>/results.jsonl`` (machine, plan, one line per row, the targets) and
``<out>/results.md`` (the table, the speed targets with their measured values, notes).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchlib import BENCH, Recorder, clean_env, command, fmt, out_dir, run_json, table, write_report


@dataclass
class Model:
    key: str  # the name the table uses (gpt_small, llama_1b)
    preset: str  # the conf/model preset the launches train (a tiny one in the dry run)
    seq: int
    plan_strategy: str  # the strategy the batch is planned for
    batch: int = 0  # a fixed batch for every row of the model (no plan launch)
    hf_config: dict = field(default_factory=dict)  # model=hf_causal_lm: the transformers config both sides build


@dataclass
class Row:
    group: str  # "gpt_small single": rows compared with the group's hand-written rows
    side: str  # hand eager | hand compiled | hydratrain defaults | hydratrain, FSDP kept
    model: str  # Model.key
    impl: str  # hand | hydratrain (bench/train_worker.py) | hf_trainer (bench/hf_trainer_worker.py) | torchtitan
    #   (bench/torchtitan_worker.py)
    strategy: str
    compile: str  # train_worker --compile: default | none | model | blocks (torchtitan: blocks = its own compile)
    overrides: list = field(default_factory=list)
    profile: int = 0
    steps: int = 0  # steps of this row (0: the table's --steps), the first `warm` untimed
    warm: int = 0
    max_batch: int = 0  # at most this batch (0: the plan's)


# the targets on one H200 (bf16): (group, what, threshold)
TARGETS = [("gpt_small single", "hydratrain defaults / hand eager (tokens/s)", 1.10),
           ("gpt_small single", "hydratrain defaults / hand compiled (tokens/s)", 0.98),
           ("llama_1b fsdp", "hydratrain defaults MFU", 0.45)]

# the fp8 row set: steps per row on a GPU (the step whose loss is compared), untimed ones, the largest batch (8 x 2048
# tokens keeps both rows within one 8-minute call on one GPU, compile included, while each gemm's M stays 16k)
FP8_STEPS, FP8_WARM, FP8_MAX_BATCH = 100, 10, 8
FP8_TARGETS = (1.15, 0.01)  # fp8 / bf16 tokens/s at least; |loss_fp8 / loss_bf16 - 1| at most

# the hf_trainer row set: a Llama of llama_1b's shape as transformers builds it (1,038,682,112 parameters, the
# embedding tied to the head; keys of model=hf_causal_lm's model.config, vocab_size set through model.vocab_size so
# that data=synthetic draws from the same vocabulary), its tiny stand-in for the dry run, the batch (a fixed one: see
# the docstring), steps and untimed steps on a GPU, and the target (hydratrain / Trainer tokens/s at least)
HF_LLAMA_1B = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
               "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 2048,
               "tie_word_embeddings": True, "vocab_size": 32000}
HF_TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
           "tie_word_embeddings": True, "vocab_size": 256}
HF_BATCH, HF_STEPS, HF_WARM = 4, 30, 10
HF_TARGET = 1.10
HF_GROUP = "hf_llama_1b single"

# the save row set: llama_1b with one checkpoint saved after step SAVE_AT, synchronous against checkpoint.async_save;
# steps per row and untimed ones on a GPU (the save's step and 5 normal ones timed), the target (an async save's step
# over the median normal step, at most)
SAVE_STEPS, SAVE_WARM, SAVE_AT = 12, 5, 9
SAVE_TARGET = 1.10
SAVE_GROUP = "llama_1b save"

# the torchtitan row set: torchtitan's Llama-3 trainer (bench/torchtitan_worker.py) against hydratrain on llama_1b's
# shape, the same batch (the plan's, at most TT_MAX_BATCH), sequence, bf16, compile and full activation checkpointing
# on both sides; steps and untimed steps on a GPU; the targets: hydratrain / torchtitan tokens/s at least, peak
# memory at most
TT_STEPS, TT_WARM, TT_MAX_BATCH = 30, 10, 8
TT_TARGETS = (1.0, 1.05)
TT_GROUP = "llama_1b vs torchtitan"


def torchtitan_missing() -> str | None:
    """Why the torchtitan rows cannot run here, or None: torchtitan must be importable, from ``$TORCHTITAN_SITE``
    (``bench/torchtitan_deps.sh install DIR``) or the environment."""
    site = os.environ.get("TORCHTITAN_SITE")
    if (site and (Path(site) / "torchtitan").is_dir()) or importlib.util.find_spec("torchtitan") is not None:
        return None
    return ("skipped: torchtitan is not installed (bash bench/torchtitan_deps.sh install DIR, then "
            "TORCHTITAN_SITE=DIR)")


def models(dry: bool) -> list[Model]:
    if dry:
        return [Model("gpt_small", "gpt_tiny", 64, "single"), Model("llama_1b", "gpt_tiny", 128, "fsdp"),
                Model("hf_llama_1b", "hf_causal_lm", 64, "single", batch=2, hf_config=HF_TINY)]
    return [Model("gpt_small", "gpt_small", 1024, "single"), Model("llama_1b", "llama_1b", 2048, "fsdp"),
            Model("hf_llama_1b", "hf_causal_lm", 2048, "single", batch=HF_BATCH, hf_config=HF_LLAMA_1B)]


def hf_overrides(config: dict) -> list[str]:
    """hydratrain's overrides that build the transformers model ``config`` describes with ``model=hf_causal_lm``:
    its vocabulary as ``model.vocab_size`` (which data=synthetic draws from too), the other keys under
    ``model.config`` (the preset's keys: each one is set)."""
    rest = [f"model.config.{k}={json.dumps(v)}" for k, v in config.items() if k != "vocab_size"]
    return [f"model.vocab_size={config['vocab_size']}", *rest]


def rows(nproc: int) -> list[Row]:
    out = [Row("gpt_small single", "hand eager", "gpt_small", "hand", "single", "none"),
           Row("gpt_small single", "hydratrain defaults", "gpt_small", "hydratrain", "single", "default", profile=2),
           Row("gpt_small single", "hand compiled (whole model)", "gpt_small", "hand", "single", "model"),
           Row("llama_1b fsdp", "hydratrain defaults", "llama_1b", "hydratrain", "fsdp", "default", profile=2),
           Row("llama_1b fsdp", "hand eager", "llama_1b", "hand", "fsdp", "none"),
           Row("llama_1b fsdp", "hand compiled (per block)", "llama_1b", "hand", "fsdp", "blocks"),
           Row("gpt_small fsdp", "hand eager", "gpt_small", "hand", "fsdp", "none")]
    if nproc == 1:  # the same work as the hand-written FSDP rows: FSDP at world size 1, compiled per block (the
        # defaults train as single there: the gpt_small single row, not run twice)
        out.append(Row("gpt_small fsdp", "hydratrain, FSDP kept (strategy.shard_on_one_rank=true)", "gpt_small",
                       "hydratrain", "fsdp", "default", ["strategy.shard_on_one_rank=true"]))
    else:
        out.append(Row("gpt_small fsdp", "hydratrain defaults", "gpt_small", "hydratrain", "fsdp", "default"))
    return out + [Row("gpt_small fsdp", "hand compiled (per block)", "gpt_small", "hand", "fsdp", "blocks")]


def fp8_rows(dry: bool) -> list[Row]:
    """llama_1b at precision=bf16 and precision=fp8, the same batch and steps (the ``fp8`` row set)."""
    steps, warm = (5, 2) if dry else (FP8_STEPS, FP8_WARM)
    fp8 = ["precision=fp8", *(["precision.fp8_emulate=true", "precision.fp8_size_rule=false"] if dry else [])]
    return [Row("llama_1b fp8", side, "llama_1b", "hydratrain", "fsdp", "default", overrides, steps=steps, warm=warm,
                max_batch=FP8_MAX_BATCH) for side, overrides in (("bf16", ["precision=bf16"]), ("fp8", fp8))]


def hf_rows(dry: bool) -> list[Row]:
    """transformers.Trainer and hydratrain's defaults on the same Llama, batch and steps, one rank (the
    ``hf_trainer`` row set)."""
    steps, warm = (4, 2) if dry else (HF_STEPS, HF_WARM)
    return [Row(HF_GROUP, "transformers.Trainer", "hf_llama_1b", "hf_trainer", "single", "none", steps=steps,
                warm=warm),
            Row(HF_GROUP, "hydratrain defaults", "hf_llama_1b", "hydratrain", "single", "default", steps=steps,
                warm=warm)]


def save_rows(dry: bool) -> list[Row]:
    """llama_1b saving one checkpoint after step ``at``, synchronously and with ``checkpoint.async_save=true``, the
    same batch as the fp8 rows (the ``save`` row set). No final save: the end waits for nothing but the one save."""
    steps, warm, at = (6, 2, 3) if dry else (SAVE_STEPS, SAVE_WARM, SAVE_AT)
    return [Row(SAVE_GROUP, side, "llama_1b", "hydratrain", "fsdp", "default",
                [f"checkpoint.every_n_steps={at}", "checkpoint.save_last=false", f"checkpoint.async_save={flag}"],
                steps=steps, warm=warm, max_batch=FP8_MAX_BATCH)
            for side, flag in (("synchronous save", "false"), ("async save", "true"))]


def save_step(row: dict) -> tuple[float, float] | None:
    """(the save's step seconds, the median of the other timed steps' seconds) of a ``save`` row: the checkpoint
    saved after step ``checkpoint.every_n_steps`` lands in the next step's seconds (``step_seconds``: steps 2..N)."""
    at = int(next(o for o in row["overrides"] if o.startswith("checkpoint.every_n_steps=")).split("=")[1])
    seconds, warm = row.get("step_seconds") or [], row["steps"] - row["timed_steps"]
    timed = {step: seconds[step - 2] for step in range(warm + 1, row["steps"] + 1) if 2 <= step <= len(seconds) + 1}
    if at + 1 not in timed or len(timed) < 2:
        return None
    save = timed.pop(at + 1)
    return save, statistics.median(timed.values())


def torchtitan_rows(nproc: int, dry: bool) -> list[Row]:
    """torchtitan's Llama-3 trainer and hydratrain on llama_1b's shape, both compiled, with every block's
    activations recomputed, at the same batch (the ``torchtitan`` row set). torchtitan runs as it ships (its forward
    and backward captured as one CUDA graph) and with CUDA graphs off; hydratrain runs its defaults otherwise, and on
    one GPU, where ``strategy=fsdp`` trains as ``single``, also with FSDP kept (torchtitan's work there); the dry
    run, on a CPU, the first two. A torchtitan row's overrides are worker flags."""
    steps, warm = (4, 2) if dry else (TT_STEPS, TT_WARM)
    ac = ["activation_checkpointing=true"]
    same = {"steps": steps, "warm": warm, "max_batch": TT_MAX_BATCH}
    out = [Row(TT_GROUP, "torchtitan", "llama_1b", "torchtitan", "fsdp", "blocks", **same),
           Row(TT_GROUP, "hydratrain defaults", "llama_1b", "hydratrain", "fsdp", "default", ac, **same)]
    if dry:  # (a CPU has no CUDA graph, and keeps FSDP at one rank: the other two rows would repeat these)
        return out
    out.append(Row(TT_GROUP, "torchtitan, CUDA graphs off", "llama_1b", "torchtitan", "fsdp", "blocks",
                   ["--cuda-graphs", "off"], **same))
    if nproc == 1:
        out.append(Row(TT_GROUP, "hydratrain, FSDP kept (strategy.shard_on_one_rank=true)", "llama_1b", "hydratrain",
                       "fsdp", "default", ["strategy.shard_on_one_rank=true", *ac], **same))
    return out


ROW_SETS = ("vs_hand", "fp8", "hf_trainer", "save", "torchtitan")


def planned(nproc: int, dry: bool, sets=ROW_SETS) -> list[Row]:
    """The rows of the chosen row sets, in :data:`ROW_SETS` order."""
    return ((rows(nproc) if "vs_hand" in sets else []) + (fp8_rows(dry) if "fp8" in sets else []) +
            (hf_rows(dry) if "hf_trainer" in sets else []) + (save_rows(dry) if "save" in sets else []) +
            (torchtitan_rows(nproc, dry) if "torchtitan" in sets else []))


def gpu_count() -> int:
    import subprocess

    code = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    return int(out.stdout.strip() or 0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="tiny, on CPU (gloo)")
    p.add_argument("--dry-compile", action="store_true", help="dry run: compile for real (minutes on a CPU)")
    p.add_argument("--print-plan", action="store_true")
    p.add_argument("--budget-s", type=float, default=None, help="seconds for the whole table, launches included "
                   "(default 420: with a machine's start-up, within one 8-minute call; dry run 1800)")
    p.add_argument("--min-case-s", type=float, default=30.0, help="do not start a row with less than this left")
    p.add_argument("--case-timeout", type=float, default=240.0, help="seconds per launch at most")
    p.add_argument("--max-nproc", type=int, default=8)
    p.add_argument("--steps", type=int, default=None, help="steps per row (default 12; dry run 5)")
    p.add_argument("--warm", type=int, default=None, help="untimed steps (default 5; dry run 2)")
    p.add_argument("--rows", default=",".join(ROW_SETS), help=f"row sets, comma-separated: {', '.join(ROW_SETS)}")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    sets = [x for x in args.rows.split(",") if x]
    if not sets or set(sets) - set(ROW_SETS):
        p.error(f"--rows {args.rows}: row sets are {', '.join(ROW_SETS)}")
    t_start = time.perf_counter()
    dry = args.dry_run
    if args.budget_s is None:
        args.budget_s = 1800.0 if dry else 420.0
    steps = args.steps or (5 if dry else 12)
    warm = args.warm or (2 if dry else 5)
    if not 1 <= warm < steps:
        p.error(f"--warm {warm} must be in [1, --steps {steps})")
    nproc = 1 if dry else min(gpu_count(), args.max_nproc)
    if not dry and nproc < 1:
        print("bench/gpu_table.py: torch sees no CUDA GPU; --dry-run runs the plan tiny on CPU", file=sys.stderr)
        return 2
    device, precision = ("cpu", "auto") if dry else ("cuda", "bf16")
    plan = planned(nproc, dry, sets)
    mods = {m.key: m for m in models(dry) if any(r.model == m.key for r in plan)}
    if args.print_plan:
        for m in mods.values():
            if m.batch:
                print(f"batch: {m.key} ({m.preset}), seq {m.seq}: {m.batch} (fixed); hydratrain "
                      f"{' '.join(hf_overrides(m.hf_config))}")
                continue
            print(f"batch: {m.key} ({m.preset}), seq {m.seq}: data.batch_size=auto for strategy={m.plan_strategy} "
                  f"on {1 if m.plan_strategy == 'single' else nproc} rank(s)")
        for r in plan:
            print(f"row: {r.group:<18} {r.side:<58} impl={r.impl} strategy={r.strategy} compile={r.compile} "
                  f"{' '.join(r.overrides)}{' profile ' + str(r.profile) if r.profile else ''}"
                  f"{f' steps {r.steps}' if r.steps else ''}")
        print(f"{steps} steps per row ({warm} untimed); budget {args.budget_s:.0f} s")
        return 0
    out = out_dir("gpu_table", args.out)
    rec = Recorder(out, "gpu_table", {**vars(args), "steps": steps, "warm": warm, "nproc": nproc, "device": device})
    extra = {} if not dry or args.dry_compile else {"TORCH_COMPILE_DISABLE": "1"}
    env = clean_env(**extra)

    def left() -> float:
        return args.budget_s - (time.perf_counter() - t_start)

    batches: dict[str, int] = {}
    for m in mods.values():
        if m.batch:  # fixed: nothing to plan
            batches[m.key] = m.batch
            continue
        ranks = 1 if m.plan_strategy == "single" else nproc
        cmd = command([str(BENCH / "train_worker.py"), "--impl", "plan", "--model", m.preset, "--seq", str(m.seq),
                       "--strategy", m.plan_strategy, "--precision", precision, "--device", device, "--nproc",
                       str(ranks), *(["--max-batch", "4"] if dry else [])], 1)
        got, tail, seconds = run_json(cmd, env, min(args.case_timeout, max(1.0, left())))
        if got is None:
            print(f"plan {m.key}: FAILED ({seconds:.0f} s)\n{tail}", flush=True)
            rec.write({"kind": "plan", "model": m.key, "failed": tail[-2000:]})
            continue
        batches[m.key] = got["batch"]
        rec.write({"kind": "plan", "model": m.key, "preset": m.preset, "seq": m.seq, "strategy": m.plan_strategy,
                   "trained_as": got["trained_as"], "batch": got["batch"], "seconds": seconds})
        print(f"plan {m.key}: data.batch_size=auto picks {got['batch']} x {m.seq} tokens per rank "
              f"(strategy={m.plan_strategy}, trained as {got['trained_as']}; {seconds:.0f} s)", flush=True)

    results: list[dict] = []

    def keep(row: dict) -> None:
        rec.write(row)
        results.append(row)

    for r in plan:
        m = mods[r.model]
        base = {"kind": "row", "group": r.group, "side": r.side, "model": r.model, "preset": m.preset,
                "impl": r.impl, "strategy": r.strategy, "compile_flag": r.compile, "overrides": r.overrides}
        if r.model not in batches:
            keep({**base, "status": "skipped: no batch (its plan failed)"})
            continue
        if left() < args.min_case_s:
            keep({**base, "status": f"skipped: {left():.0f} s of the budget left"})
            continue
        if dry and not args.dry_compile and r.impl == "hand" and r.compile != "none":
            keep({**base, "status": "skipped: the dry run compiles nothing (--dry-compile does), so this row would "
                                    "be its hand eager row again"})
            continue
        if m.hf_config and importlib.util.find_spec("transformers") is None:
            keep({**base, "status": "skipped: transformers is not installed (pip install -e '.[hf]')"})
            continue
        if r.impl == "torchtitan" and torchtitan_missing():
            keep({**base, "status": torchtitan_missing()})
            continue
        ranks = 1 if r.strategy == "single" else nproc
        batch = min(batches[r.model], r.max_batch) if r.max_batch else batches[r.model]
        timed = ["--steps", str(r.steps or steps), "--warm", str(r.warm if r.steps else warm), "--device", device]
        if r.impl == "hf_trainer":  # the Trainer's worker: the transformers config, no hydratrain flags
            script = "hf_trainer_worker.py"
            flags = ["--config", json.dumps(m.hf_config), "--batch", str(batch), "--seq", str(m.seq), "--precision",
                     precision, *timed]
        elif r.impl == "torchtitan":  # torchtitan's trainer on the preset's shape (compile: see the dry run's env)
            script = "torchtitan_worker.py"
            flags = ["--model", m.preset, "--batch", str(batch), "--seq", str(m.seq), "--ac", "full", "--compile",
                     "off" if dry and not args.dry_compile else "on", *timed, *r.overrides]
        else:
            # hydratrain's first log step (TensorBoard's writer is made there) is not timed: it is step warm - 1 (a
            # row's own warm with its own steps)
            script = "train_worker.py"
            flags = ["--impl", r.impl, "--strategy", r.strategy, "--model", m.preset, "--seq", str(m.seq), "--batch",
                     str(batch), "--precision", precision if r.impl == "hand" else "auto", "--compile", r.compile,
                     *timed, "--log-every", str(r.warm if r.steps else max(1, warm - 1))]
            for o in (hf_overrides(m.hf_config) if m.hf_config else []) + r.overrides:
                flags += ["--override", o]
        if r.profile:
            flags += ["--profile", str(r.profile), "--profile-out", str(out / f"profile-{r.model}-{r.impl}.txt")]
        # (torchtitan's trainer reads its rank from torchrun's environment, even for one process)
        row, tail, seconds = run_json(command([str(BENCH / script), *flags], ranks, torchrun=r.impl == "torchtitan"),
                                      env, min(args.case_timeout, left()))
        if row is None:
            print(f"{r.group}: {r.side} FAILED ({seconds:.0f} s)\n{tail[-1500:]}", flush=True)
            keep({**base, "status": "FAIL", "seconds": seconds, "failed": tail[-2000:]})
            continue
        mfu = row["tokens_per_sec"] * row["flops_per_token"] / row["peak_flops_total"] \
            if row.get("peak_flops_total") else None
        keep({**base, **row, "kind": "row", "status": "PASS", "seconds": seconds, "nproc": ranks, "mfu": mfu,
              "steps": r.steps or steps})
        print(f"{r.group:<18} {r.side:<58} {row['tokens_per_sec']:>12,.0f} tokens/s  MFU "
              f"{fmt(100 * mfu if mfu else None, '.1f')} %  compile {row.get('compile_s', 0):.1f} s  "
              f"({seconds:.0f} s; {left():.0f} s left)", flush=True)

    text, targets = report(results, dry, nproc, steps, warm)
    for t in targets:
        rec.write({"kind": "target", **t})
    write_report(out, "bench/gpu_table.py: hydratrain's defaults against the hand-written loop", rec.rows[0], text,
                 " ".join(["python", "bench/gpu_table.py", *(argv if argv is not None else sys.argv[1:])]))
    print("\n" + (out / "results.md").read_text())
    print(f"bench/gpu_table.py: {time.perf_counter() - t_start:.0f} s; results in {out}")
    return 0 if all(r["status"] in ("PASS",) or r["status"].startswith("skipped") for r in results) \
        and any(r["status"] == "PASS" for r in results) else 1


def report(results: list[dict], dry: bool, nproc: int, steps: int, warm: int) -> tuple[str, list[dict]]:
    """The markdown body (the table, the targets, notes) and the targets' records."""
    def ref(group: str, side_prefix: str):
        return next((x for x in results if x["group"] == group and x["side"].startswith(side_prefix)
                     and x["status"] == "PASS"), None)

    lines = []
    for x in results:
        ok = x["status"] == "PASS"
        eager, compiled = ref(x["group"], "hand eager"), ref(x["group"], "hand compiled")
        vs = [fmt(x["tokens_per_sec"] / h["tokens_per_sec"], ".2f") + "x" if ok and h else "n/a"
              for h in (eager, compiled)]
        lines.append([x["group"], x["side"], x.get("trained_as", "") if ok else "", x.get("compiled", "") if ok else "",
                      f"{x.get('batch', '?')} x {x.get('seq', '?')}" if ok else "",
                      fmt(x.get("tokens_per_sec")) if ok else "", vs[0], vs[1],
                      fmt(100 * x["mfu"], ".1f") + " %" if ok and x.get("mfu") else "n/a",
                      fmt(x["peak_memory_bytes"] / 2**30, ".2f") + " GiB" if ok and x.get("peak_memory_bytes")
                      else "n/a", fmt(x.get("compile_s"), ".1f") if ok else "", x["status"]])
    body = table(["model, strategy", "side", "trained as", "compiled", "batch x seq", "tokens/s", "x hand eager",
                  "x hand compiled", "MFU", "peak memory", "compile s", "status"], lines)
    targets = []
    for group, what, threshold in TARGETS:
        defaults, eager, compiled = ref(group, "hydratrain defaults"), ref(group, "hand eager"), \
            ref(group, "hand compiled")
        value = None
        if defaults and "MFU" in what:
            value = defaults.get("mfu")
        elif defaults and "hand eager" in what and eager:
            value = defaults["tokens_per_sec"] / eager["tokens_per_sec"]
        elif defaults and "hand compiled" in what and compiled:
            value = defaults["tokens_per_sec"] / compiled["tokens_per_sec"]
        met = None if value is None else value >= threshold
        targets.append({"group": group, "what": what, "target": threshold, "value": value, "met": met})
    target_lines = [[t["group"], t["what"], f">= {t['target']:.2f}" if t["target"] > 1 or "MFU" not in t["what"]
                     else f">= {100 * t['target']:.0f} %",
                     "n/a" if t["value"] is None else (fmt(100 * t["value"], ".1f") + " %" if "MFU" in t["what"]
                                                       else fmt(t["value"], ".3f")),
                     "n/a" if t["met"] is None else ("met" if t["met"] else "NOT met")] for t in targets]
    fp8_text, fp8_targets = fp8_report(results)
    hf_text, hf_targets = hf_report(results)
    save_text, save_targets = save_report(results)
    tt_text, tt_targets = torchtitan_report(results)
    targets += fp8_targets + hf_targets + save_targets + tt_targets
    notes = [f"Steps {warm + 1}-{steps} of each launch timed (a device synchronisation after each step); "
             f"{'bf16 on both sides' if not dry else 'precision=auto on both sides'}; fsdp rows on {nproc} "
             "rank(s). Each model's batch is what data.batch_size=auto picks (the memory planner's largest fit "
             "with its error margin), the same for every row of the model. MFU: the model's FLOPs per token (6N "
             "plus attention) over the datasheet peak of the device (hydratrain.metrics). compile s: the first "
             "step's seconds minus a timed step's (cold inductor cache unless an earlier row compiled the same "
             "graph).",
             "hydratrain rows run its defaults: precision=auto (bf16 on a GPU), trainer.compile=auto (on CUDA the "
             "whole model under single, per block under fsdp), and strategy=fsdp on one GPU trains as single "
             "(strategy.shard_on_one_rank=auto; the 'FSDP kept' row is the same work as the hand-written FSDP "
             "rows). Where a target is not met, the profile files (profile-*.txt: top device kernels of the "
             "profiled steps; 'profile_busy' in results.jsonl: the share of those steps' wall time the device was "
             "busy) show what stands in the way: a busy share well below 1 is host overhead, a top kernel list led "
             "by attention or the head is the model's ceiling."]
    if dry:
        notes.insert(0, "DRY RUN on CPU: tiny models named after the GPU ones, compile disabled (the hand compiled "
                     "rows skipped) unless --dry-compile; the figures say nothing about speed.")
    text = (body + "\n\n## Targets (one H200, bf16)\n\n" +
            table(["model, strategy", "what", "target", "measured", "status"], target_lines) + fp8_text + hf_text +
            save_text + tt_text +
            "\n\n## Notes\n\n" + "\n\n".join(notes))
    return text, targets


def fp8_report(results: list[dict]) -> tuple[str, list[dict]]:
    """The fp8 row set's section (tokens/s and loss of both sides, the ratio, the targets) and its target records;
    nothing when neither row ran."""
    side = {x["side"]: x for x in results if x["group"] == "llama_1b fp8"}
    if not side:
        return "", []
    bf16, fp8 = (side.get(k) if side.get(k, {}).get("status") == "PASS" else None for k in ("bf16", "fp8"))
    speed = fp8["tokens_per_sec"] / bf16["tokens_per_sec"] if bf16 and fp8 else None
    loss = fp8["train_loss"] / bf16["train_loss"] - 1 if bf16 and fp8 and bf16.get("train_loss") else None
    targets = [{"group": "llama_1b fp8", "what": "fp8 / bf16 (tokens/s)", "target": FP8_TARGETS[0], "value": speed,
                "met": None if speed is None else speed >= FP8_TARGETS[0]},
               {"group": "llama_1b fp8", "what": "fp8 loss / bf16 loss - 1 (last step)", "target": FP8_TARGETS[1],
                "value": loss, "met": None if loss is None else abs(loss) <= FP8_TARGETS[1]}]
    lines = [[name, x["status"], fmt(x.get("tokens_per_sec")), fmt(x.get("train_loss"), ".4f"),
              f"{x.get('batch', '?')} x {x.get('seq', '?')}", x.get("steps", "?"),
              fmt(x["peak_memory_bytes"] / 2**30, ".2f") + " GiB" if x.get("peak_memory_bytes") else "n/a"]
             for name, x in side.items()]
    verdict = [["fp8 / bf16 tokens/s", f">= {FP8_TARGETS[0]:.2f}", fmt(speed, ".3f"),
                "n/a" if speed is None else ("met" if targets[0]["met"] else "NOT met")],
               ["fp8 loss vs bf16 loss at the last step", f"within {100 * FP8_TARGETS[1]:.0f} %",
                "n/a" if loss is None else f"{100 * loss:+.2f} %",
                "n/a" if loss is None else ("met" if targets[1]["met"] else "NOT met")]]
    return ("\n\n## precision=fp8 against bf16 (llama_1b)\n\n" +
            table(["precision", "status", "tokens/s", "loss at the last step", "batch x seq", "steps", "peak memory"],
                  lines) + "\n\n" + table(["what", "target", "measured", "status"], verdict) +
            "\n\nThe loss at the last step is the mean train loss of its logging window (the last 10 steps on a "
            "GPU); both runs see the same synthetic batches from the same initial weights."), targets


def hf_report(results: list[dict]) -> tuple[str, list[dict]]:
    """The hf_trainer row set's section (each side's tokens/s, MFU, peak memory; the ratio against
    :data:`HF_TARGET`) and its target record; nothing when neither row ran."""
    side = {x["side"]: x for x in results if x["group"] == HF_GROUP}
    if not side:
        return "", []
    ours, theirs = (side.get(k) if side.get(k, {}).get("status") == "PASS" else None
                    for k in ("hydratrain defaults", "transformers.Trainer"))
    ratio = ours["tokens_per_sec"] / theirs["tokens_per_sec"] if ours and theirs else None
    met = None if ratio is None else ratio >= HF_TARGET
    targets = [{"group": HF_GROUP, "what": "hydratrain defaults / transformers.Trainer (tokens/s)",
                "target": HF_TARGET, "value": ratio, "met": met}]
    lines = [[name, x["status"], x.get("compiled", ""), fmt(x.get("tokens_per_sec")),
              fmt(100 * x["mfu"], ".1f") + " %" if x.get("mfu") else "n/a",
              fmt(x["peak_memory_bytes"] / 2**30, ".2f") + " GiB" if x.get("peak_memory_bytes") else "n/a",
              f"{x.get('batch', '?')} x {x.get('seq', '?')}", x.get("steps", "?")] for name, x in side.items()]
    verdict = [["hydratrain defaults / transformers.Trainer tokens/s", f">= {HF_TARGET:.2f}", fmt(ratio, ".3f"),
                "n/a" if met is None else ("met" if met else "NOT met")]]
    return ("\n\n## hydratrain against transformers.Trainer (model=hf_causal_lm, a Llama of about 1B)\n\n" +
            table(["side", "status", "compiled", "tokens/s", "MFU", "peak memory", "batch x seq", "steps"], lines) +
            "\n\n" + table(["what", "target", "measured", "status"], verdict) +
            "\n\nThe same transformers LlamaForCausalLM (SDPA attention, float32 weights) on both sides, the same "
            "synthetic token windows per step, lr, weight decay, clipping and schedule: hydratrain with its defaults "
            "(precision=auto, trainer.compile=auto: the whole model compiled on CUDA), the Trainer with bf16=True "
            "and its own defaults (fused AdamW, no torch.compile). MFU: FLOPs per token counted on a meta copy of "
            "the model on both sides."), targets


def save_report(results: list[dict]) -> tuple[str, list[dict]]:
    """The save row set's section (each side's normal and save step, their ratio; the async side against
    :data:`SAVE_TARGET`) and its target record; nothing when neither row ran."""
    side = {x["side"]: x for x in results if x["group"] == SAVE_GROUP}
    if not side:
        return "", []
    steps = {name: save_step(x) if x["status"] == "PASS" else None for name, x in side.items()}
    ratio = {name: got[0] / got[1] if got else None for name, got in steps.items()}
    value = ratio.get("async save")
    met = None if value is None else value <= SAVE_TARGET
    targets = [{"group": SAVE_GROUP, "what": "async save step / normal step", "target": SAVE_TARGET, "value": value,
                "met": met}]
    lines = [[name, x["status"], fmt(steps[name][1], ".3f") if steps[name] else "n/a",
              fmt(steps[name][0], ".3f") if steps[name] else "n/a", fmt(ratio[name], ".2f"),
              f"{x.get('batch', '?')} x {x.get('seq', '?')}"] for name, x in side.items()]
    verdict = [["async save step / normal step", f"<= {SAVE_TARGET:.2f}", fmt(value, ".3f"),
                "n/a" if met is None else ("met" if met else "NOT met")]]
    return ("\n\n## Asynchronous against synchronous checkpoint saves (llama_1b)\n\n" +
            table(["side", "status", "normal step s (median)", "save step s", "save / normal", "batch x seq"],
                  lines) + "\n\n" + table(["what", "target", "measured", "status"], verdict) +
            "\n\nOne checkpoint (weights, AdamW state, run state; DCP) saved after the same step of each run; the save "
            "step is the step after it, whose seconds hold what the save blocked. Async: the state staged "
            "(pinned host memory on CUDA), the write in the background (checkpoint.async_save=true)."), targets


def torchtitan_report(results: list[dict]) -> tuple[str, list[dict]]:
    """The torchtitan row set's section (each side's tokens/s, MFU, peak memory, parameters; hydratrain's defaults
    against torchtitan: tokens/s against :data:`TT_TARGETS` [0], peak memory against [1]) and its target records;
    nothing when no row of it ran."""
    side = {x["side"]: x for x in results if x["group"] == TT_GROUP}
    if not side:
        return "", []
    passed = {k: x for k, x in side.items() if x["status"] == "PASS"}
    # torchtitan's fastest row that ran (as it ships, or with CUDA graphs off), the baseline of both targets
    theirs = max((x for x in passed.values() if x["impl"] == "torchtitan"), key=lambda x: x["tokens_per_sec"],
                 default=None)
    ours = passed.get("hydratrain defaults")
    speed = ours["tokens_per_sec"] / theirs["tokens_per_sec"] if ours and theirs else None
    memory = ours["peak_memory_bytes"] / theirs["peak_memory_bytes"] \
        if ours and theirs and theirs.get("peak_memory_bytes") else None
    same = ours["n_params"] == theirs["n_params"] if ours and theirs and "n_params" in ours else None
    targets = [{"group": TT_GROUP, "what": "hydratrain / torchtitan (tokens/s)", "target": TT_TARGETS[0],
                "value": speed, "met": None if speed is None else speed >= TT_TARGETS[0]},
               {"group": TT_GROUP, "what": "hydratrain / torchtitan (peak memory)", "target": TT_TARGETS[1],
                "value": memory, "met": None if memory is None else memory <= TT_TARGETS[1]},
               {"group": TT_GROUP, "what": "the same parameter count", "target": None,
                "value": same, "met": same}]
    lines = [[name, x["status"], x.get("trained_as", ""), fmt(x.get("tokens_per_sec")),
              fmt(100 * x["mfu"], ".1f") + " %" if x.get("mfu") else "n/a",
              fmt(x["peak_memory_bytes"] / 2**30, ".2f") + " GiB" if x.get("peak_memory_bytes") else "n/a",
              fmt(x.get("compile_s"), ".1f"), fmt(x.get("n_params")), f"{x.get('batch', '?')} x {x.get('seq', '?')}",
              x.get("steps", "?")] for name, x in side.items()]
    verdict = [[f"hydratrain / torchtitan tokens/s (against '{theirs['side'] if theirs else 'n/a'}')",
                f">= {TT_TARGETS[0]:.2f}", fmt(speed, ".3f"),
                "n/a" if speed is None else ("met" if targets[0]["met"] else "NOT met")],
               ["hydratrain / torchtitan peak memory", f"<= {TT_TARGETS[1]:.2f}", fmt(memory, ".3f"),
                "n/a" if memory is None else ("met" if targets[1]["met"] else "NOT met")],
               ["parameters", "equal", "n/a" if same is None else ("equal" if same else "DIFFER"),
                "n/a" if same is None else ("met" if same else "NOT met")]]
    return ("\n\n## hydratrain against torchtitan (llama_1b's shape, compiled, activations recomputed)\n\n" +
            table(["side", "status", "trained as", "tokens/s", "MFU", "peak memory", "compile s", "parameters",
                   "batch x seq", "steps"], lines) + "\n\n" + table(["what", "target", "measured", "status"], verdict) +
            "\n\ntorchtitan's Llama3Model built with llama_1b's dimensions (bench/torchtitan_worker.py: fused QKV, "
            "its init, the chunked cross-entropy of its Llama-3 recipe, FSDP2 over every rank with bf16 parameters "
            "and fp32 reductions, each block compiled, every block recomputed in backward, causal SDPA attention: "
            "the kernel hydratrain uses) against hydratrain's defaults with activation_checkpointing=true (on one "
            "GPU they train as single, the whole model compiled; the FSDP-kept row is torchtitan's work), the same "
            "batch, sequence and step counts, synthetic tokens on both sides. MFU: hydratrain's FLOPs per token "
            "for the shape on both sides. The targets compare hydratrain's defaults with torchtitan's faster row."
            ), targets


if __name__ == "__main__":
    sys.exit(main())
