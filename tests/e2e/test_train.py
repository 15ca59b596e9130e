"""End-to-end runs of train.py on 2 gloo ranks under torchrun, for DDP and FSDP2: every strategy x precision trains
and logs, FSDP = DDP = gradient accumulation (the same fp32 trajectory), TensorBoard holds the scalars and one hparams
row, the ranks agree on one run dir; plus the fp16 all-rank skip and the meta-device sharding of llama_1b.

The training runs are the jobs of one 2-rank sweep made once per session (``shared_sweep`` / ``two_rank_run`` in
conftest.py), each read by every test that asserts on it. Single-process runs are in-process:
tests/unit/test_single_process.py.
"""
from __future__ import annotations

import math
import re
import subprocess
import sys

import pytest

from helpers import SCRIPTS, log_of, results, sh, tb_all

TAGS = ["train/loss", "train/lr", "train/grad_norm", "perf/tokens_per_sec", "perf/mfu", "mem/peak", "eval/loss",
        "eval/perplexity"]
# (strategy, precision, wrap_policy, the shared run: helpers.SHARED_RUNS)
COMBOS = [("ddp", "fp32", "none", "ddp_fp32"), ("ddp", "bf16", "none", "ddp_bf16"), ("ddp", "fp16", "none", "ddp_fp16"),
          ("fsdp", "fp32", "none", "fsdp_fp32"), ("fsdp", "bf16", "transformer_block", "fsdp_bf16"),
          ("fsdp", "fp16", "size_based", "fsdp_fp16")]


@pytest.mark.parametrize("strategy,precision,wrap,name", COMBOS, ids=["-".join(c[:3]) for c in COMBOS])
def test_two_rank_run_trains_and_logs(two_rank_run, strategy, precision, wrap, name):
    run_dir = two_rank_run(name)
    res = results(run_dir)
    assert res["steps"] == 12 and res["train_loss"] < res["first_loss"] - 0.3, res
    assert res["eval_loss"] < res["first_loss"] and res["hparams"]["world_size"] == 2
    assert res["hparams"]["precision.name"] == precision and res["hparams"]["strategy.name"] == strategy
    scalars = tb_all(run_dir)
    assert set(TAGS) <= set(scalars), sorted(scalars)
    assert sorted(p.name for p in run_dir.glob("train_rank*.log")) == ["train_rank0.log", "train_rank1.log"]
    assert (run_dir / ".hydra" / "config.yaml").exists()
    log0 = log_of(run_dir)
    if strategy == "fsdp":
        n_units = {"none": 1, "transformer_block": 3}.get(wrap)
        m = re.search(r"fsdp: sharded (\d+) modules \((\d+)(?: Block)? by wrap_policy=(\w+) \+ root\)", log0)
        assert m and m.group(3) == wrap, log0
        if n_units:
            assert int(m.group(1)) == n_units
        else:
            assert int(m.group(2)) >= 1
    if wrap == "transformer_block":  # this run also recomputes activations
        assert "activation checkpointing on 2 Block" in log0
    if precision == "fp16":
        assert "train/skipped_steps" in scalars and "train/loss_scale" in scalars
        assert "skipped" in log0


def test_tensorboard_events_hold_scalars_and_one_hparams_row(two_rank_run):
    run_dir = two_rank_run("fsdp_fp32")  # 12 steps, eval every 3
    events = sorted(run_dir.rglob("events.out.tfevents.*"), key=lambda p: len(p.parts))
    (row,) = (run_dir / "tensorboard" / "hparams").iterdir()  # the hparams row: a run of its own
    assert [e.parent for e in events] == [run_dir / "tensorboard", row]  # no other sub-directories
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(events[0]), size_guidance={"scalars": 0})
    acc.Reload()
    scalars = {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}
    assert set(TAGS) <= set(scalars)
    assert [s for s, _ in scalars["train/loss"]] == list(range(1, 13))
    assert [s for s, _ in scalars["eval/loss"]] == [3, 6, 9, 12]
    assert all(v > 0 for _, v in scalars["perf/tokens_per_sec"]) and all(0 < v for _, v in scalars["perf/mfu"])
    assert scalars["mem/peak"][-1][1] > 1e6  # bytes
    ppl = dict(scalars["eval/perplexity"])
    for step, loss in scalars["eval/loss"]:
        assert abs(ppl[step] - math.exp(loss)) < 1e-2 * ppl[step]
    hparams = EventAccumulator(str(row), size_guidance={"scalars": 0})
    hparams.Reload()
    plugins = hparams.PluginTagToContent("hparams")
    assert "_hparams_/session_start_info" in plugins and "_hparams_/experiment" not in plugins  # typed from all runs
    ((step, value),) = [(e.step, e.value) for e in hparams.Scalars("hparam/eval_loss")]
    assert step == 12 and value == pytest.approx(scalars["eval/loss"][-1][1], rel=1e-6)


def test_fsdp_ddp_and_grad_accumulation_give_the_same_fp32_trajectory(two_rank_run):
    """The same 8 samples per step, cut as 2 ranks x batch 4 or 2 ranks x 2 micro-batches of 2, under FSDP (once with
    CPU offload and no resharding after forward, which must not change the math either) and DDP."""
    losses = {name: tb_all(two_rank_run(name))["train/loss"]
              for name in ("fsdp_fp32", "ddp_fp32", "fsdp_fp32_accum", "ddp_fp32_accum")}
    ref = losses["fsdp_fp32"]
    assert sorted(ref) == list(range(1, 13)) and ref[12] < ref[1] - 0.3
    for name, got in losses.items():
        assert sorted(got) == sorted(ref)
        assert [got[s] for s in sorted(got)] == pytest.approx([ref[s] for s in sorted(ref)], rel=1e-4, abs=1e-4), \
            (name, got, ref)


def test_fsdp_with_cpu_offload_and_no_reshard_after_forward(two_rank_run):
    """The shared fsdp run offloads to the CPU (its trajectory is checked above); activation checkpointing is on in
    test_two_rank_run_trains_and_logs[fsdp-bf16-transformer_block]."""
    run_dir = two_rank_run("fsdp_fp32")
    log0 = log_of(run_dir)
    assert "cpu_offload=True" in log0 and "reshard_after_forward=False" in log0
    assert results(run_dir)["train_loss"] < results(run_dir)["first_loss"]


def test_ranks_share_one_run_dir_without_explicit_dir(shared_sweep):
    """The shared sweep is launched without hydra.sweep.dir: both ranks' files land in one time-stamped dir."""
    dirs = [p for p in shared_sweep.dir.parents[1].glob("*/*") if p.is_dir()]
    assert dirs == [shared_sweep.dir], dirs
    for job in shared_sweep.jobs.values():
        assert {p.name for p in job.iterdir()} >= {"train_rank0.log", "train_rank1.log", ".hydra", "tensorboard"}


def test_run_stamp_is_agreed_by_ranks_started_apart(tmp_path):
    """Two ranks that start 1.5 s apart (so their clocks' stamps differ) still agree via the store."""
    code = ("import time,sys,os; time.sleep(float(sys.argv[1])); "
            "from hydratrain.dist.run_dir import run_stamp; print(run_stamp())")
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {**__import__("os").environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
           "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "t1", "TORCHELASTIC_USE_AGENT_STORE": "True"}  # as torchrun
    env.pop("HYDRATRAIN_STAMP", None)
    procs = [subprocess.Popen([sys.executable, "-c", code, str(delay)], env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, text=True) for r, delay in enumerate((0.0, 1.5))]
    stamps = [p.communicate(timeout=60)[0].strip() for p in procs]
    assert stamps[0] == stamps[1] and re.fullmatch(r"\d{4}-\d\d-\d\d/\d\d-\d\d-\d\d", stamps[0])


@pytest.mark.slow  # a sibling of it runs by default; CI runs this too (default suite near 4 minutes)
def test_fp16_inf_on_one_rank_skips_the_step_on_every_rank():
    r = sh([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            str(SCRIPTS / "fp16_inf_skip.py")], timeout=120).ok()
    assert r.output.count("poison=True scale 1024 -> 512, params_changed=False") == 2, r.output


@pytest.mark.slow
def test_large_preset_is_built_on_meta_and_each_rank_holds_half():
    r = sh([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            str(SCRIPTS / "meta_shard_llama.py")], timeout=300).ok()
    rows = re.findall(r"rank (\d): local_param_bytes=(\d+) total_param_bytes=(\d+) max_rss_bytes=(\d+)", r.output)
    assert len(rows) == 2, r.output
    for _, local, total, rss in rows:
        local, total, rss = int(local), int(total), int(rss)
        assert total > 4e9  # ~1.1B fp32 parameters
        assert abs(local / total - 0.5) < 0.01
        assert rss < 0.8 * total  # never held the whole model
