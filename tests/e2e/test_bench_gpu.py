"""bench/gpu.sh: it parses; its side-by-side table (bench/gpu_table.py) plans the rows, computes the targets right
and its CPU dry run (the same plan, tiny, on gloo) writes the JSON lines and the table, the hf_trainer row set
(hydratrain against transformers.Trainer) on its own; the smoke helper compiles and judges results right, and the
smoke dry run (``--smoke``) passes."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import py_compile
import sys
from pathlib import Path

import pytest

from helpers import ROOT, Run, requires, sh

SCRIPT = ROOT / "bench" / "gpu.sh"
HELPER = ROOT / "bench" / "gpu_report.py"
ALL_CASES = ["fsdp_bf16", "fp16_scaler", "cpu_offload", "meta_llama_1b", "compile", "ac", "compile_ac", "ckpt_save",
             "ckpt_resume", "adamw8bit", "fsdp_bf16_x2", "ckpt_save_x2", "ckpt_resume_x2", "hsdp_x2"]


def _helper():
    spec = importlib.util.spec_from_file_location("gpu_report", HELPER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _dry_run(out: Path, cache: Path, cases: str = "", extra=(), timeout: int = 900, smoke: bool = True,
             rows: str = "") -> Run:
    env = {"DRY_RUN": "1", "CASES": cases, "PYTHON": sys.executable, "HYDRATRAIN_CACHE": str(cache),
           "TABLE_ROWS": rows}
    return sh(["bash", str(SCRIPT), *(["--smoke"] if smoke else []), "--out", str(out),
               *(["--", *extra] if extra else [])], env=env, timeout=timeout)


def _table_module():
    spec = importlib.util.spec_from_file_location("gpu_table", ROOT / "bench" / "gpu_table.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_table"] = module  # (its dataclasses look their module up there)
    sys.path.insert(0, str(ROOT / "bench"))  # its benchlib import
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "bench"))
    return module


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


def _table_rows(out: Path) -> dict[str, list[str]]:
    """{case: cells} of the first markdown table's body (the cases; the compile x AC matrix and vs_hand follow)."""
    text = (out / "results.md").read_text()
    first = text[text.index("\n| "):].split("\n\n")[0]
    lines = [line for line in first.splitlines() if line.startswith("| ")][1:]
    return {cells[0]: cells for cells in ([c.strip() for c in line.strip("|").split("|")] for line in lines)}


def test_script_parses_and_helper_compiles(tmp_path):
    sh(["bash", "-n", str(SCRIPT)]).ok()
    py_compile.compile(str(HELPER), cfile=str(tmp_path / "gpu_report.pyc"), doraise=True)
    assert os.access(SCRIPT, os.X_OK)
    out = sh(["bash", str(SCRIPT), "--help"]).ok().output
    assert "--dry-run" in out and "--smoke" in out and "ckpt_resume" in out


def test_table_plan_puts_the_targets_rows_first_and_fits_the_budget():
    """The rows the targets need run first (a budget cut drops the least important); the plan prints."""
    gt = _table_module()
    one = [(r.group, r.side) for r in gt.rows(1)]
    assert one[:6] == [("gpt_small single", "hand eager"), ("gpt_small single", "hydratrain defaults"),
                       ("gpt_small single", "hand compiled (whole model)"), ("llama_1b fsdp", "hydratrain defaults"),
                       ("llama_1b fsdp", "hand eager"), ("llama_1b fsdp", "hand compiled (per block)")]
    assert any("FSDP kept" in side for _, side in one)
    assert not any("FSDP kept" in r.side for r in gt.rows(8))  # on 8 GPUs the defaults shard
    defaults = [r.group for r in gt.rows(1) if r.side == "hydratrain defaults"]  # on one GPU fsdp trains as single
    assert defaults == ["gpt_small single", "llama_1b fsdp"] and len(gt.rows(8)) == len(gt.rows(1))
    assert {r.impl for r in gt.rows(1)} == {"hand", "hydratrain"}
    assert all(r.compile == "default" for r in gt.rows(1) if r.impl == "hydratrain")  # no compile override
    out = sh([sys.executable, str(ROOT / "bench" / "gpu_table.py"), "--print-plan"]).output
    assert "llama_1b" in out and "seq 2048" in out or "torch sees no CUDA GPU" in out
    out = sh([sys.executable, str(ROOT / "bench" / "gpu_table.py"), "--print-plan", "--dry-run"]).ok().output
    assert "budget 1800 s" in out and out.count("row: ") == len(gt.planned(1, True)) == len(gt.rows(1)) + 8
    out = sh([sys.executable, str(ROOT / "bench" / "gpu_table.py"), "--print-plan", "--dry-run", "--rows", "fp8"]).ok()
    assert out.output.count("row: ") == 2 and "llama_1b fp8" in out.output and "fp8_emulate=true" in out.output


def test_fp8_rows_compare_like_with_like_and_judge_both_targets():
    """The fp8 row set: llama_1b at bf16 and at fp8, the same batch (capped) and steps (100 on a GPU), hydratrain
    both; its section reports the speed ratio and the loss difference against their targets."""
    gt = _table_module()
    bf16, fp8 = gt.fp8_rows(dry=False)
    assert (bf16.overrides, fp8.overrides) == (["precision=bf16"], ["precision=fp8"])
    assert bf16.steps == fp8.steps == 100 and bf16.max_batch == fp8.max_batch and bf16.model == fp8.model == "llama_1b"
    assert "precision.fp8_emulate=true" in gt.fp8_rows(dry=True)[1].overrides

    def row(side, tps, loss):
        return {"group": "llama_1b fp8", "side": side, "status": "PASS", "tokens_per_sec": tps, "train_loss": loss,
                "batch": 8, "seq": 2048, "steps": 100, "peak_memory_bytes": 2**30}

    text, targets = gt.fp8_report([row("bf16", 100.0, 4.0), row("fp8", 120.0, 4.02)])
    got = {t["what"]: (round(t["value"], 4), t["met"]) for t in targets}
    assert got == {"fp8 / bf16 (tokens/s)": (1.2, True), "fp8 loss / bf16 loss - 1 (last step)": (0.005, True)}
    _, targets = gt.fp8_report([row("bf16", 100.0, 4.0), row("fp8", 110.0, 4.1)])
    assert [t["met"] for t in targets] == [False, False]
    assert "| fp8 loss vs bf16 loss at the last step | within 1 % | +0.50 % | met |" in text
    assert gt.fp8_report([]) == ("", [])


def test_save_rows_time_the_step_after_the_one_save_against_the_other_timed_steps():
    """The save row set: llama_1b saving once after step 9 of 12, synchronously and asynchronously, nothing else
    different; the save's step (step 10: the trainer saves after logging step 9) against the median of the other
    timed steps (6-12), and the async side's ratio judged against 1.10."""
    gt = _table_module()
    sync, async_ = gt.save_rows(dry=False)
    assert [o for o in sync.overrides if "async" not in o] == [o for o in async_.overrides if "async" not in o] == \
        ["checkpoint.every_n_steps=9", "checkpoint.save_last=false"]
    assert (sync.overrides[-1], async_.overrides[-1]) == ("checkpoint.async_save=false", "checkpoint.async_save=true")
    assert sync.steps == async_.steps == 12 and sync.model == async_.model == "llama_1b"

    def row(side, save_s, overrides):  # step_seconds: steps 2..12, 1.0 s each but the save's step
        seconds = [1.0] * 11
        seconds[10 - 2] = save_s
        seconds[6 - 2] = 1.2  # a log step, outweighed by the median
        return {"group": "llama_1b save", "side": side, "status": "PASS", "overrides": overrides, "steps": 12,
                "timed_steps": 7, "step_seconds": seconds, "batch": 8, "seq": 2048}

    assert gt.save_step(row("x", 3.0, sync.overrides)) == (3.0, 1.0)
    text, targets = gt.save_report([row("synchronous save", 9.0, sync.overrides),
                                    row("async save", 1.05, async_.overrides)])
    assert [(t["what"], round(t["value"], 3), t["met"]) for t in targets] == [
        ("async save step / normal step", 1.05, True)]
    assert "| synchronous save | PASS | 1.000 | 9.000 | 9.00 | 8 x 2048 |" in text, text
    _, targets = gt.save_report([row("async save", 1.5, async_.overrides)])
    assert targets[0]["met"] is False
    assert gt.save_report([]) == ("", [])


def test_hf_trainer_rows_train_one_model_at_one_batch_after_fp8():
    """The hf_trainer row set: transformers.Trainer and hydratrain's defaults (no override but the model's) on one
    rank, the same Llama of llama_1b's shape, batch, sequence and steps; hydratrain gets the model through every key
    of model=hf_causal_lm's model.config (an override of a key the preset lacks would fail to compose); the set runs
    after fp8 and prints its fixed batch."""
    from omegaconf import OmegaConf

    gt = _table_module()
    trainer, ours = gt.hf_rows(dry=False)
    assert (trainer.impl, ours.impl, trainer.side, ours.side) == ("hf_trainer", "hydratrain", "transformers.Trainer",
                                                                  "hydratrain defaults")
    assert trainer.model == ours.model and trainer.strategy == ours.strategy == "single"
    assert ours.compile == "default" and not ours.overrides and (trainer.steps, trainer.warm) == (ours.steps, ours.warm)
    model = {m.key: m for m in gt.models(dry=False)}[ours.model]
    cfg = model.hf_config
    assert (model.preset, model.batch, model.seq) == ("hf_causal_lm", 4, 2048)
    assert [cfg[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                             "intermediate_size", "vocab_size")] == [2048, 16, 32, 8, 8192, 32000]
    preset = OmegaConf.load(ROOT / "conf" / "model" / "hf_causal_lm.yaml").config
    for config in (cfg, gt.HF_TINY):
        overrides = gt.hf_overrides(config)
        assert overrides[0] == f"model.vocab_size={config['vocab_size']}"
        assert sorted(o.split("=")[0].removeprefix("model.config.") for o in overrides[1:]) == sorted(preset)
    assert "model.config.tie_word_embeddings=true" in gt.hf_overrides(cfg)
    assert [r for r in gt.planned(1, True) if r.group == gt.HF_GROUP] == gt.hf_rows(dry=True)
    assert gt.ROW_SETS[1:3] == ("fp8", "hf_trainer")
    out = sh([sys.executable, str(ROOT / "bench" / "gpu_table.py"), "--print-plan", "--dry-run", "--rows",
              "hf_trainer"]).ok().output
    assert out.count("row: ") == 2 and "impl=hf_trainer" in out and "seq 64: 2 (fixed)" in out, out


def test_hf_trainer_report_judges_the_ratio():
    """The hf_trainer section: hydratrain's tokens/s over the Trainer's against 1.1x; n/a when a side failed."""
    gt = _table_module()

    def row(side, tps):
        return {"group": gt.HF_GROUP, "side": side, "status": "PASS", "tokens_per_sec": tps, "mfu": 0.4, "batch": 4,
                "seq": 2048, "steps": 30, "peak_memory_bytes": 2**30, "compiled": "none"}

    what = "hydratrain defaults / transformers.Trainer (tokens/s)"
    text, targets = gt.hf_report([row("transformers.Trainer", 100.0), row("hydratrain defaults", 115.0)])
    assert [(t["what"], round(t["value"], 3), t["met"]) for t in targets] == [(what, 1.15, True)]
    assert "| hydratrain defaults / transformers.Trainer tokens/s | >= 1.10 | 1.150 | met |" in text
    assert "| transformers.Trainer | PASS | none | 100 | 40.0 % | 1.00 GiB | 4 x 2048 | 30 |" in text
    _, targets = gt.hf_report([row("transformers.Trainer", 100.0), row("hydratrain defaults", 105.0)])
    assert targets[0]["met"] is False
    failed = {"group": gt.HF_GROUP, "side": "hydratrain defaults", "status": "FAIL"}
    text, targets = gt.hf_report([row("transformers.Trainer", 100.0), failed])
    assert (targets[0]["value"], targets[0]["met"]) == (None, None) and "| >= 1.10 | n/a | n/a |" in text
    assert gt.hf_report([]) == ("", [])
    text, targets = gt.report([row("transformers.Trainer", 100.0), row("hydratrain defaults", 120.0)], dry=False,
                              nproc=1, steps=12, warm=5)
    assert "## hydratrain against transformers.Trainer" in text and (targets[-1]["what"], targets[-1]["met"]) == (
        what, True)


@pytest.mark.slow
@requires("hf")
def test_hf_trainer_dry_run(tmp_path):
    """The hf_trainer row set end to end, tiny, on CPU: both sides train the same Llama (one parameter count, one
    FLOP count) at the same batch and steps, and the report judges the ratio (a CPU's figure, not a GPU's). The
    GPU rows' Llama has the parameter count gpu_table.py states (built on meta)."""
    # (the extra [hf]; torch with it: the rest of this module imports no torch)
    import torch
    from transformers import AutoModelForCausalLM

    from hydratrain.models.hf import hf_config

    out = tmp_path / "out"
    proc = sh([sys.executable, str(ROOT / "bench" / "gpu_table.py"), "--dry-run", "--rows", "hf_trainer", "--out",
               str(out)], env={"HYDRATRAIN_CACHE": str(tmp_path / "cache")}, timeout=300)
    assert proc.returncode == 0, proc.output[-9000:]
    rows = _rows(out)
    assert not [r for r in rows if r["kind"] == "plan"]  # a fixed batch
    trainer, ours = [r for r in rows if r["kind"] == "row"]
    assert (trainer["side"], ours["side"]) == ("transformers.Trainer", "hydratrain defaults")
    assert trainer["status"] == ours["status"] == "PASS", (trainer.get("failed"), ours.get("failed"))
    for r in (trainer, ours):
        assert (r["batch"], r["seq"], r["steps"], r["timed_steps"]) == (2, 64, 4, 2), r
        assert r["tokens_per_sec"] > 0 and r["peak_memory_bytes"] > 0 and math.isfinite(r["train_loss"]), r
    assert trainer["n_params"] == ours["n_params"] and trainer["flops_per_token"] == ours["flops_per_token"]
    assert trainer["precision"] == ours["precision"]  # each side's auto: bf16 where native, else fp32
    target = [r for r in rows if r["kind"] == "target"][-1]
    assert target["what"] == "hydratrain defaults / transformers.Trainer (tokens/s)" and target["value"] > 0
    text = (out / "results.md").read_text()
    assert "DRY RUN" in text and "## hydratrain against transformers.Trainer" in text

    gt = _table_module()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(gt.HF_LLAMA_1B, None))
    assert sum(p.numel() for p in model.parameters()) == 1_038_682_112


def test_torchtitan_rows_train_one_shape_at_one_batch_and_the_report_judges_speed_memory_and_size(tmp_path,
                                                                                                   monkeypatch):
    """The torchtitan row set: torchtitan's trainer (as it ships, and with CUDA graphs off) and hydratrain's defaults
    (activation checkpointing on, as on torchtitan's side; on one GPU also with FSDP kept) on llama_1b at one batch
    cap and one step count; the report judges hydratrain's defaults against torchtitan's faster row (tokens/s >=
    1.0x, peak memory <= 1.05x) and the parameter count; without torchtitan the rows are skipped with the command
    that fetches it."""
    gt = _table_module()
    theirs, ours, graphless, kept = every = gt.torchtitan_rows(1, dry=False)
    assert [r.impl for r in every] == ["torchtitan", "hydratrain", "torchtitan", "hydratrain"]
    assert {r.model for r in every} == {"llama_1b"} and {r.strategy for r in every} == {"fsdp"}
    assert ours.overrides == ["activation_checkpointing=true"] and ours.compile == "default"
    assert kept.overrides == ["strategy.shard_on_one_rank=true", "activation_checkpointing=true"]
    assert not theirs.overrides and graphless.overrides == ["--cuda-graphs", "off"]  # (worker flags)
    assert {(r.steps, r.warm, r.max_batch) for r in every} == {(gt.TT_STEPS, gt.TT_WARM, gt.TT_MAX_BATCH)}
    assert [r.side for r in gt.torchtitan_rows(8, dry=False)] == ["torchtitan", "hydratrain defaults",
                                                                  "torchtitan, CUDA graphs off"]
    assert gt.ROW_SETS[-1] == "torchtitan" and gt.planned(8, False, ["torchtitan"]) == gt.torchtitan_rows(8, False)

    def row(side, impl, tps, gib, n_params=1_038_682_112):
        return {"group": gt.TT_GROUP, "side": side, "impl": impl, "status": "PASS", "tokens_per_sec": tps,
                "mfu": 0.4, "peak_memory_bytes": gib * 2**30, "n_params": n_params, "batch": 8, "seq": 2048,
                "steps": 30, "trained_as": "single", "compile_s": 40.0}

    kept_side = "hydratrain, FSDP kept (strategy.shard_on_one_rank=true)"
    text, targets = gt.torchtitan_report([row("torchtitan", "torchtitan", 100.0, 20), row(
        "hydratrain defaults", "hydratrain", 102.0, 20.8), row(kept_side, "hydratrain", 90.0, 30)])
    assert [(t["what"], t["value"] if t["target"] is None else round(t["value"], 3), t["met"]) for t in targets] == [
        ("hydratrain / torchtitan (tokens/s)", 1.02, True), ("hydratrain / torchtitan (peak memory)", 1.04, True),
        ("the same parameter count", True, True)]
    assert "| hydratrain / torchtitan tokens/s (against 'torchtitan') | >= 1.00 | 1.020 | met |" in text
    assert "| torchtitan | PASS | single | 100 | 40.0 % | 20.00 GiB | 40.0 | 1,038,682,112 | 8 x 2048 | 30 |" in text
    _, targets = gt.torchtitan_report([row("torchtitan", "torchtitan", 100.0, 20), row(
        "hydratrain defaults", "hydratrain", 99.0, 22, n_params=1)])
    assert [t["met"] for t in targets] == [False, False, False]
    text, targets = gt.torchtitan_report([row("torchtitan", "torchtitan", 100.0, 20), row(  # the faster one counts
        "hydratrain defaults", "hydratrain", 104.0, 20), row("torchtitan, CUDA graphs off", "torchtitan", 110.0, 19)])
    assert [round(t["value"], 3) for t in targets[:2]] == [0.945, 1.053]
    assert "(against 'torchtitan, CUDA graphs off')" in text
    failed = {"group": gt.TT_GROUP, "side": "torchtitan", "impl": "torchtitan", "status": "FAIL"}
    text, targets = gt.torchtitan_report([failed, row("hydratrain defaults", "hydratrain", 99.0, 22)])
    assert {t["met"] for t in targets} == {None} and "| >= 1.00 | n/a | n/a |" in text
    assert gt.torchtitan_report([]) == ("", [])
    monkeypatch.setenv("TORCHTITAN_SITE", str(tmp_path))
    if importlib.util.find_spec("torchtitan") is None:
        assert gt.torchtitan_missing().startswith("skipped: torchtitan is not installed (bash bench/torchtitan_deps")
    (tmp_path / "torchtitan").mkdir()
    assert gt.torchtitan_missing() is None


@pytest.mark.slow
def test_torchtitan_dry_run(tmp_path):
    """The torchtitan row set end to end, tiny, on CPU: torchtitan 0.3.0 unpacked by bench/torchtitan_deps.sh from
    the package registry (or ``$TORCHTITAN_SITE``) trains the same shape as hydratrain (one parameter count, one
    FLOP count) at the same batch and steps, under torchrun even for one process, triton stood in for where torch
    has none; the report judges the targets (a CPU's figures, not a GPU's)."""
    site = os.environ.get("TORCHTITAN_SITE")
    if not site:
        site = str(tmp_path / "site")
        got = sh(["bash", str(ROOT / "bench" / "torchtitan_deps.sh"), "install", site],
                 env={"PYTHON": sys.executable}, timeout=300)
        if got.returncode != 0:
            pytest.skip(f"torchtitan could not be fetched from the package registry: {got.output[-400:]}")
    out = tmp_path / "out"
    proc = sh([sys.executable, str(ROOT / "bench" / "gpu_table.py"), "--dry-run", "--rows", "torchtitan", "--out",
               str(out)], env={"HYDRATRAIN_CACHE": str(tmp_path / "cache"), "TORCHTITAN_SITE": site}, timeout=600)
    assert proc.returncode == 0, proc.output[-9000:]
    rows = _rows(out)
    assert [(p["model"], p["batch"]) for p in rows if p["kind"] == "plan"] == [("llama_1b", 4)]
    theirs, ours = every = [r for r in rows if r["kind"] == "row"]  # (the GPU's other two would repeat them here)
    assert [r["side"] for r in every] == ["torchtitan", "hydratrain defaults"] and not theirs["cuda_graphs"]
    assert {r["status"] for r in every} == {"PASS"}, [r.get("failed") for r in every]
    for r in every:
        assert (r["batch"], r["seq"], r["steps"], r["timed_steps"]) == (4, 128, 4, 2), r
        assert r["tokens_per_sec"] > 0 and r["peak_memory_bytes"] > 0 and math.isfinite(r["train_loss"]), r
        assert (r["n_params"], r["flops_per_token"]) == (theirs["n_params"], theirs["flops_per_token"])
    assert theirs["torchtitan"] == "0.3.0" and theirs["ac"] == "full" and theirs["attention"] == "sdpa"
    assert ("triton" in theirs["stand_ins"]) == (importlib.util.find_spec("triton") is None)
    targets = [r for r in rows if r["kind"] == "target"][-3:]
    assert [t["what"] for t in targets] == ["hydratrain / torchtitan (tokens/s)",
                                            "hydratrain / torchtitan (peak memory)", "the same parameter count"]
    assert targets[0]["value"] > 0 and targets[2]["met"] is True
    assert "## hydratrain against torchtitan" in (out / "results.md").read_text()


def test_table_targets_and_ratios():
    gt = _table_module()

    def row(group, side, tps, mfu=0.2):
        return {"group": group, "side": side, "status": "PASS", "tokens_per_sec": tps, "mfu": mfu, "batch": 8,
                "seq": 1024, "trained_as": "single", "compiled": "none", "peak_memory_bytes": 2**30,
                "compile_s": 1.0}

    results = [row("gpt_small single", "hand eager", 100.0), row("gpt_small single", "hydratrain defaults", 120.0),
               row("gpt_small single", "hand compiled (whole model)", 125.0),
               row("llama_1b fsdp", "hydratrain defaults", 50.0, mfu=0.41),
               {"group": "llama_1b fsdp", "side": "hand eager", "status": "skipped: 3 s of the budget left"}]
    text, targets = gt.report(results, dry=False, nproc=1, steps=12, warm=5)
    got = {t["what"]: (round(t["value"], 3), t["met"]) for t in targets}
    assert got == {"hydratrain defaults / hand eager (tokens/s)": (1.2, True),
                   "hydratrain defaults / hand compiled (tokens/s)": (0.96, False),
                   "hydratrain defaults MFU": (0.41, False)}
    assert "| gpt_small single | hydratrain defaults | single | none | 8 x 1024 | 120 | 1.20x | 0.96x |" in text
    assert "NOT met" in text and "skipped: 3 s of the budget left" in text


@pytest.mark.slow
def test_table_dry_run(tmp_path):
    """The side-by-side table end to end, tiny, on CPU (compile disabled: tests/e2e/test_compile compiles)."""
    out = tmp_path / "out"
    # (hf_trainer: a test of its own)
    proc = _dry_run(out, tmp_path / "cache", smoke=False, timeout=1200, rows="vs_hand,fp8,save")
    assert proc.returncode == 0, proc.output[-9000:]
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    plans = [r for r in rows if r["kind"] == "plan"]
    assert [(p["model"], p["batch"]) for p in plans] == [("gpt_small", 4), ("llama_1b", 4)]
    every = [r for r in rows if r["kind"] == "row"]
    skipped = [r["side"] for r in every if r["status"].startswith("skipped: the dry run compiles nothing")]
    assert skipped == ["hand compiled (whole model)", "hand compiled (per block)", "hand compiled (per block)"]
    table = [r for r in every if not r["status"].startswith("skipped")]
    assert len(table) == 10 and all(r["status"] == "PASS" for r in table), [r.get("failed") for r in table]
    fp8 = [r for r in table if r["group"] == "llama_1b fp8"]  # emulated, every layer converted
    assert [r["precision"] for r in fp8] == ["bf16", "fp8"] and all(r["train_loss"] > 0 for r in fp8)
    assert all(r["tokens_per_sec"] > 0 and r["peak_memory_bytes"] > 0 and r["batch"] == 4 for r in table)
    defaults = [r for r in table if r["side"] == "hydratrain defaults"]
    assert [r["trained_as"] for r in defaults] == ["single", "fsdp"]  # the CPU keeps FSDP at one rank
    assert defaults[0]["profile_top"] and (out / "profile-gpt_small-hydratrain.txt").exists()
    targets = [r for r in rows if r["kind"] == "target"]
    assert len(targets) == 6 and targets[-1]["what"] == "async save step / normal step" and targets[-1]["value"] > 0
    saves = [r for r in table if r["group"] == "llama_1b save"]  # each saved once, after step 3 of 6
    assert [r["side"] for r in saves] == ["synchronous save", "async save"] and all(len(r["step_seconds"]) == 5
                                                                                    for r in saves)
    text = (out / "results.md").read_text()
    assert "DRY RUN" in text and "## Targets" in text and "x hand compiled" in text
    assert "## Asynchronous against synchronous checkpoint saves (llama_1b)" in text


def test_judge_catches_what_a_smoke_test_must():
    judge = _helper().judge
    good = {"steps": 20, "steps_this_launch": 10, "train_loss": 2.0, "eval_loss": 2.1, "tokens_per_sec": 1e5,
            "mfu": 0.4, "peak_memory_bytes": 2**30, "skipped_steps": 1}
    assert judge(good, 0, 20, 10, "fp16", mfu_required=True) == []
    assert judge(None, 1, 20, None, "none", False) == ["exit status 1", "no results.json"]
    assert "timed out" in judge(good, 124, 20, None, "none", False)[0]
    bad = {**good, "steps": 10, "train_loss": None, "tokens_per_sec": 0, "mfu": 1.7, "peak_memory_bytes": 0}
    reasons = " / ".join(judge(bad, 0, 20, 10, "none", False))
    for part in ("steps 10 != 20", "train_loss", "tokens_per_sec", "mfu 1.7", "peak_memory_bytes"):
        assert part in reasons
    assert judge({**good, "mfu": None}, 0, 20, 10, "none", mfu_required=False) == []  # a GPU without a known peak
    assert judge({**good, "mfu": None}, 0, 20, 10, "none", mfu_required=True) == [
        "mfu missing although this GPU's peak is known"]
    assert judge({**good, "steps_this_launch": 20}, 0, 20, 10, "none", False) == ["steps_this_launch 20 != 10"]
    assert "skipped 20 of 20" in judge({**good, "skipped_steps": 20}, 0, 20, None, "fp16", False)[0]


#: the smoke cases whose plumbing differs from a single launch's: one launch resuming another's checkpoint in its run
#: dir, on one rank and on two. Each other case is one launch like fsdp_bf16 with other overrides, and what those
#: overrides do is tested where it belongs (test_compile, test_checkpoint, test_hsdp, test_adamw8bit_runs, ...).
CHAINED = ["ckpt_save", "ckpt_resume", "ckpt_save_x2", "ckpt_resume_x2"]


@pytest.mark.slow
def test_dry_run_chained_cases_and_a_failing_one(tmp_path):
    """The resume cases end to end on one and two ranks (the CPU peak cached for later launches), then a launch
    that fails (a config error) must give FAIL and exit status 1."""
    out = tmp_path / "ok"
    proc = _dry_run(out, tmp_path / "cache", cases=",".join(CHAINED))
    assert proc.returncode == 0, proc.output[-9000:]
    assert f"{len(CHAINED)} passed, 0 failed" in proc.output
    rows = {r["case"]: r for r in _rows(out)}
    assert list(rows) == CHAINED
    for r in rows.values():
        assert r["status"] == "PASS" and r["tokens_per_sec"] > 0 and 0 < r["mfu"] <= 1, r
        assert r["peak_memory_bytes"] > 0, r
    assert rows["ckpt_resume"]["steps"] == 8 and rows["ckpt_resume"]["steps_this_launch"] == 4
    assert rows["ckpt_resume_x2"]["steps_this_launch"] == 4 and rows["ckpt_save_x2"]["nproc"] == 2
    assert (out / "runs" / "ckpt" / "checkpoints" / "step_00000004" / ".metadata").exists()
    assert (tmp_path / "cache" / "cpu_peak_flops.json").exists()
    table = _table_rows(out)
    assert list(table) == CHAINED and table["ckpt_resume"][6] == "8 (4 this launch)"

    proc = _dry_run(tmp_path / "bad", tmp_path / "cache", cases="fsdp_bf16", extra=["optim.lr=-1"])
    assert proc.returncode == 1, proc.output
    cells = _table_rows(tmp_path / "bad")["fsdp_bf16"]
    assert cells[2] == "FAIL" and "exit status 2" in cells[-1], cells
    assert "optim.lr" in _rows(tmp_path / "bad")[0]["log_tail"]


def test_every_case_name_is_known_to_the_script():
    """The case names the docs and CASES use are the script's: an unknown one is refused, naming them."""
    r = sh(["bash", str(SCRIPT), "--smoke", "--out", "/nonexistent"], env={"DRY_RUN": "1", "CASES": "nope"})
    assert r.returncode == 2 and "unknown case 'nope'" in r.output, r.output
    named = r.output.replace("_xR", "_x2")
    assert all(f" {case} " in named or f" {case}," in named for case in ALL_CASES), r.output
