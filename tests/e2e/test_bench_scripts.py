"""bench/'s CPU benchmarks in their smallest mode (gpt_tiny, tiny batches, one round, a few steps): each runs to the
end and writes its JSON lines (the machine first, a line per run, summaries) and its markdown table. The figures
are not checked: they mean nothing at these sizes. bench/plan_accuracy.py has its own smoke test
(e2e/test_plan_runs.py), bench/gpu.sh its CPU dry run (e2e/test_bench_gpu.py)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT, clean_env

pytestmark = pytest.mark.slow  # about 130 s on 2 busy cores: the four scripts start 10 processes between them

TINY = ["--model", "gpt_tiny", "--batch", "2", "--seq", "32"]
STEPS = ["--steps", "3", "--warm", "1"]


def bench(script: str, *args: str, timeout: int = 600) -> tuple[list[dict], str]:
    """Run ``bench/<script> ARGS`` (``--out`` is the last pair of ARGS); returns (its JSON lines, its markdown)."""
    out = Path(args[-1])
    r = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], cwd=str(ROOT), env=clean_env(),
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    md = (out / "results.md").read_text()
    assert rows[0]["kind"] == "machine" and rows[0]["cores"] >= 1 and "torch" in rows[0], rows[0]
    assert md.startswith(f"# bench/{script}") and "load average" in md and f"`python bench/{script}" in md, md
    return rows, md


def header(md: str) -> list[str]:
    """The cells of the first markdown table's header row."""
    line = next(line for line in md.splitlines() if line.startswith("| "))
    return [c.strip() for c in line.strip("|").split("|")]


def test_overhead(tmp_path):
    rows, md = bench("overhead.py", "--rounds", "1", "--strategies", "single", "--precisions", "fp32", *TINY, *STEPS,
                     "--out", str(tmp_path))
    runs = [r for r in rows if r["kind"] == "run"]
    assert {r["impl"] for r in runs} == {"hand", "hydratrain"} and all(r["tokens_per_sec"] > 0 for r in runs)
    summary = [r for r in rows if r["kind"] == "summary"]
    assert [r["case"].split(" ")[0] for r in summary] == ["fp32", "defaults"], summary
    assert all(r["rounds"] == 1 and r["ratio_median"] > 0 for r in summary), summary
    assert header(md)[:3] == ["strategy", "ranks", "precision"] and "ratio (median)" in header(md)
    assert md.count("| single | 1 |") == 2, md


def test_fastpaths(tmp_path):
    rows, md = bench("fastpaths.py", "--rounds", "1", "--no-compile", *TINY, *STEPS, "--out", str(tmp_path))
    cases = [r["case"] for r in rows if r["kind"] == "summary"]
    assert cases[0] == "eager fp32" and cases[-1] == "hydratrain defaults", cases
    assert {c.split(" ")[1] for c in cases if c.startswith("AdamW")} == {"for_loop", "foreach", "fused"}, cases
    assert header(md)[0] == "case" and "ceiling tokens/s (MFU 100 %)" in header(md)
    assert all(f"| {c} |" in md for c in cases), md


def test_memory(tmp_path):
    rows, md = bench("memory.py", "--ranks", "1,2", *TINY, "--steps", "2", "--out", str(tmp_path))
    summary = {(r["strategy"], r["ranks"]): r for r in rows if r["kind"] == "summary"}
    assert set(summary) == {("single", 1), ("fsdp", 1), ("fsdp", 2)}, summary
    assert all(r["state_ratio_to_single_over_w"] > 0 for r in summary.values()), summary
    assert "state / (single / W)" in header(md), md


def test_startup(tmp_path):
    rows, md = bench("startup.py", "--rounds", "1", "--ranks", "1", "--out", str(tmp_path))
    runs = [r for r in rows if r["kind"] == "run"]
    assert {r["what"] for r in runs} == {"pg", "loop", "hydratrain"} and all("total" in r for r in runs), runs
    ours = next(r for r in runs if r["what"] == "hydratrain")
    assert {"launcher", "imports", "data", "memory plan", "model", "first step"} <= set(ours["phases"]), ours
    summary = {r["what"]: r for r in rows if r["kind"] == "summary"}
    assert summary["hydratrain"]["ratio_to_pg"] > 0, summary
    assert "where the time goes" in md, md
