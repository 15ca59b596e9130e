"""The memory planner end to end: the start-of-run line, a run that runs out of memory (exit status 6 with the plan
and the changes that fit), ``python -m hydratrain.plan`` and the accuracy benchmark's smoke run."""
from __future__ import annotations

import json
import resource
import subprocess
import sys
import time

import pytest

from helpers import ROOT, clean_env, command, requires, results

# A 4 x 256 GPT whose activations at batch 64 x 256 need about 1.3 GB more than at batch 1.
OOM_MODEL = ["strategy=single", "device=cpu", "precision=fp32", "model.d_model=256", "model.n_layer=4",
             "model.n_head=4", "model.max_seq_len=256", "data.seq_len=256", "trainer.max_steps=2",
             "trainer.eval_every_n_steps=0", "trainer.eval_samples=8", "checkpoint.every_n_steps=0"]


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (torchrun's workers)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            with open(f"/proc/{p}/task/{p}/children") as fh:
                todo += [int(c) for c in fh.read().split()]
        except OSError:
            pass
    return out


def _vm_peak(pid: int) -> int:
    """Peak virtual size of process ``pid`` (``VmPeak``), bytes; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            return next((int(line.split()[1]) * 1024 for line in fh if line.startswith("VmPeak:")), 0)
    except OSError:
        return 0


def _run_limited(args, run_dir, limit_bytes=None, nproc=1, timeout=300):
    """Run train.py (FAST + args) with its address space limited to ``limit_bytes`` (RLIMIT_AS, inherited by
    torchrun's workers); returns (exit status, output, the peak virtual size seen, bytes)."""
    def limit():
        if limit_bytes is not None:
            resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))

    cmd = command([*args, f"hydra.run.dir={run_dir}"], nproc)
    proc = subprocess.Popen(cmd, cwd=str(ROOT), env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, preexec_fn=limit)
    vm_peak, t0 = 0, time.monotonic()
    while proc.poll() is None and time.monotonic() - t0 < timeout:
        vm_peak = max([vm_peak, *(_vm_peak(pid) for pid in _tree(proc.pid))])
        time.sleep(0.05)
    if proc.poll() is None:
        proc.kill()
    out, _ = proc.communicate()
    return proc.returncode, out, vm_peak


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc are Linux's")
def test_out_of_memory_exits_6_with_the_plan_and_changes_that_fit(tmp_path):
    """The same run at batch 1 fits; at batch 64, with the address space limited to batch 1's peak virtual size
    plus 256 MiB, the CPU allocator fails: one line with the planned breakdown and the changes that fit, exit 6."""
    code, out, vm_peak = _run_limited([*OOM_MODEL, "data.batch_size=1"], tmp_path / "fits")
    assert code == 0 and vm_peak > 0, out[-3000:]
    code, out, _ = _run_limited([*OOM_MODEL, "data.batch_size=64"], tmp_path / "oom", limit_bytes=vm_peak + 2**28)
    assert code == 6, out[-4000:]
    line = next(ln for ln in out.splitlines() if ln.startswith("hydratrain: out of memory:"))
    assert "can't allocate memory" in line and "planned peak" in line, line
    assert "activations" in line and "budget" in line and "fits with (a x2 margin for the planner's error" in line, line
    assert "data.batch_size=" in line or "activation_checkpointing=true" in line, line
    assert "memory plan per rank" in (tmp_path / "oom" / "train_rank0.log").read_text()  # the table, in the log


def test_every_run_starts_with_its_plan_and_records_it(tmp_path, cli):
    """In this process: the line and the record are the point, not a process of its own (the measured peak of one
    is: the next test)."""
    r = cli(["strategy=single", "device=cpu", "trainer.max_steps=2"], tmp_path)
    assert r.returncode == 0, r.output[-3000:]
    line = next(ln for ln in r.output.splitlines() if "memory plan: peak" in ln)
    assert "GiB per rank" in line and line.rstrip().endswith("fits"), line
    res = results(tmp_path)
    assert 0 < res["planned_peak_memory_bytes"] and res["peak_memory_bytes"] > 0


@requires("examples")
def test_a_model_that_is_not_a_gpt_is_planned_within_15_percent_of_its_peak(tmp_path):
    """+experiment=digits_cnn (a CNN with BatchNorm: the generic plan, a simulated step on the data's shapes) logs
    its plan, and the run's measured peak resident set is within 15 % of it."""
    r = subprocess.run(command(["+experiment=digits_cnn", "strategy=single", "device=cpu", "precision=fp32",
                                "trainer.max_steps=3", "trainer.eval_every_n_steps=0", "trainer.eval_samples=64",
                                "logger.peak_flops=1e11", "logger.tensorboard=false", "checkpoint.every_n_steps=0",
                                f"hydra.run.dir={tmp_path}"], fast=False),
                       cwd=str(ROOT), env=clean_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    log = (tmp_path / "train_rank0.log").read_text()
    assert "memory plan per rank: model hydratrain.examples.digits.DigitsCNN" in log
    res = results(tmp_path)
    planned, measured = res["planned_peak_memory_bytes"], res["peak_memory_bytes"]
    assert abs(planned / measured - 1) < 0.15, (planned, measured)


@pytest.mark.slow
def test_a_run_over_its_budget_warns_with_changes_but_trains(tmp_path):
    r = subprocess.run(command(["strategy=single", "device=cpu", "trainer.max_steps=1", "plan.memory_gb=0.05",
                                f"hydra.run.dir={tmp_path}"]),
                       cwd=str(ROOT), env=clean_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    line = next(ln for ln in (r.stdout + r.stderr).splitlines() if "memory plan: peak" in ln)
    assert "EXCEEDS the budget" in line and "budget 0.05 GiB" in line, line


@pytest.mark.slow
def test_the_cli_plans_a_launch_and_lists_what_fits(tmp_path):
    def plan(*overrides):
        return subprocess.run([sys.executable, "-m", "hydratrain.plan", *overrides], cwd=str(tmp_path),
                              env=clean_env(), capture_output=True, text=True, timeout=300)

    big = ["model=gpt_small", "strategy=fsdp", "precision=bf16", "data.batch_size=8", "data.seq_len=1024",
           "plan.world_size=8", "device=cuda"]
    ok = plan(*big, "plan.memory_gb=80")
    assert ok.returncode == 0 and "fits" in ok.stdout and "fsdp buffers" in ok.stdout, ok.stdout + ok.stderr
    over = plan(*big, "plan.memory_gb=1")
    margin = "changes that fit (with a x1.15 margin for the planner's error on cuda), cheapest first:"
    assert over.returncode == 1 and margin in over.stdout, over.stdout + over.stderr
    assert "activation_checkpointing=true" in over.stdout
    tiny = plan(*big, "plan.memory_gb=1e-12")  # rounds to 0 bytes: still a verdict, not a ZeroDivisionError
    assert tiny.returncode == 1 and "EXCEEDS" in tiny.stdout and "Traceback" not in tiny.stderr, tiny.stderr
    auto = plan("model=gpt_small", "strategy=fsdp", "plan.world_size=8", "device=cuda")  # no GPU, no budget here
    assert auto.returncode == 0 and "precision=bf16" in auto.stdout and "no CUDA device here" in auto.stdout
    bad = plan("plan.memory_gb=-1")
    assert bad.returncode == 2 and "plan.memory_gb=-1" in bad.stderr, bad.stderr
    typo = plan("plan.memory_gib=3")
    assert typo.returncode == 2 and "memory_gib" in typo.stderr, typo.stderr


@pytest.mark.slow
def test_accuracy_benchmark_smoke(tmp_path):
    """bench/plan_accuracy.py with tiny sizes: it runs, and writes a JSON line and a table row per configuration."""
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "plan_accuracy.py"), "--tiny", "--steps", "2",
                        "--only", "single_fp32", "fsdp2_fp32", "--out", str(tmp_path)],
                       cwd=str(ROOT), env=clean_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "plan_accuracy.jsonl").read_text().splitlines()]
    assert [row["name"] for row in rows] == ["single_fp32", "fsdp2_fp32"]
    assert all(row["predicted_bytes"] > 0 and row["measured_bytes"] > 0 for row in rows)
    table = (tmp_path / "plan_accuracy.md").read_text()
    assert "| single_fp32 |" in table and "| fsdp2_fp32 |" in table


@pytest.mark.slow
def test_every_rank_that_runs_out_of_memory_exits_6(tmp_path):
    """DDP on 2 ranks, both out of memory: each rank stops with status 6 (torchrun's summary lists them); a rank
    that does not hit it would stop through the fail-fast path (status 5)."""
    args = [*OOM_MODEL, "strategy=ddp"]
    code, out, vm_peak = _run_limited([*args, "data.batch_size=1"], tmp_path / "fits", nproc=2)
    assert code == 0, out[-3000:]
    code, out, _ = _run_limited([*args, "data.batch_size=64"], tmp_path / "oom", limit_bytes=vm_peak + 2**28,
                                nproc=2)
    assert code != 0 and "exitcode  : 6" in out, out[-4000:]
    assert "hydratrain: out of memory:" in out
