"""End-to-end runs of train.py: 2 gloo ranks under torchrun for DDP and FSDP2, plain python for single."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FAST, ROOT, read_scalars, run_train

TAGS = ["train/loss", "train/lr", "train/grad_norm", "perf/tokens_per_sec", "perf/mfu", "mem/peak", "eval/loss",
        "eval/perplexity"]
COMBOS = [("ddp", "fp32", "none"), ("ddp", "bf16", "none"), ("ddp", "fp16", "none"),
          ("fsdp", "fp32", "none"), ("fsdp", "bf16", "transformer_block"), ("fsdp", "fp16", "size_based")]


def results(run_dir: Path) -> dict:
    return json.loads((run_dir / "results.json").read_text())


@pytest.mark.parametrize("strategy,precision,wrap", COMBOS, ids=["-".join(c) for c in COMBOS])
def test_two_rank_run_trains_and_logs(tmp_path, cache_dir, strategy, precision, wrap):
    args = [*FAST, f"strategy={strategy}", f"precision={precision}", f"wrap_policy={wrap}",
            *(["wrap_policy.min_num_params=5000"] if wrap == "size_based" else []), "trainer.max_steps=12",
            "optim.lr=1e-2", "scheduler.warmup_steps=2"]
    run_train(args, tmp_path, nproc=2, cache=cache_dir)
    res = results(tmp_path)
    assert res["steps"] == 12 and res["train_loss"] < res["first_loss"] - 0.3, res
    assert res["eval_loss"] < res["first_loss"] and res["hparams"]["world_size"] == 2
    scalars = read_scalars(tmp_path)
    assert set(TAGS) <= set(scalars), sorted(scalars)
    assert sorted(p.name for p in tmp_path.glob("train_rank*.log")) == ["train_rank0.log", "train_rank1.log"]
    assert (tmp_path / ".hydra" / "config.yaml").exists()
    log0 = (tmp_path / "train_rank0.log").read_text()
    if strategy == "fsdp":
        n_units = {"none": 1, "transformer_block": 3}.get(wrap)
        m = re.search(r"fsdp: sharded (\d+) modules \((\d+) by wrap_policy=(\w+) \+ root\)", log0)
        assert m and m.group(3) == wrap, log0
        if n_units:
            assert int(m.group(1)) == n_units
        else:
            assert int(m.group(2)) >= 1
    if precision == "fp16":
        assert "train/skipped_steps" in scalars and "train/loss_scale" in scalars
        assert "skipped" in log0


def test_tensorboard_events_hold_scalars_and_one_hparams_row(tmp_path, cache_dir):
    run_train([*FAST, "strategy=fsdp", "trainer.max_steps=6", "trainer.eval_every_n_steps=3"], tmp_path, nproc=2,
              cache=cache_dir)
    events = list(tmp_path.rglob("events.out.tfevents.*"))
    assert len(events) == 1 and events[0].parent == tmp_path / "tensorboard"  # no stray sub-directories
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(events[0]), size_guidance={"scalars": 0})
    acc.Reload()
    scalars = {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}
    assert set(TAGS) <= set(scalars)
    assert [s for s, _ in scalars["train/loss"]] == [1, 2, 3, 4, 5, 6]
    assert [s for s, _ in scalars["eval/loss"]] == [3, 6]
    assert all(v > 0 for _, v in scalars["perf/tokens_per_sec"]) and all(0 < v for _, v in scalars["perf/mfu"])
    assert scalars["mem/peak"][-1][1] > 1e6  # bytes
    ppl = dict(scalars["eval/perplexity"])
    for step, loss in scalars["eval/loss"]:
        assert abs(ppl[step] - __import__("math").exp(loss)) < 1e-2 * ppl[step]
    plugins = acc.PluginTagToContent("hparams")
    assert "_hparams_/experiment" in plugins and "_hparams_/session_start_info" in plugins
    assert "hparam/eval_loss" in scalars


def _losses(run_dir: Path) -> list[float]:
    return [v for _, v in read_scalars(run_dir)["train/loss"]]


def test_fsdp_ddp_and_grad_accumulation_give_the_same_fp32_trajectory(tmp_path, cache_dir):
    common = [*FAST, "trainer.max_steps=8", "trainer.eval_every_n_steps=0", "optim.lr=1e-2",
              "scheduler.warmup_steps=2"]
    runs = {"fsdp": ["strategy=fsdp", "data.batch_size=4"], "ddp": ["strategy=ddp", "data.batch_size=4"],
            "fsdp_accum": ["strategy=fsdp", "data.batch_size=2", "trainer.grad_accum_steps=2"],
            "ddp_accum": ["strategy=ddp", "data.batch_size=2", "trainer.grad_accum_steps=2"]}
    losses = {}
    for name, extra in runs.items():
        run_train([*common, *extra], tmp_path / name, nproc=2, cache=cache_dir)
        losses[name] = _losses(tmp_path / name)
    ref = losses["fsdp"]
    assert len(ref) == 8 and ref[-1] < ref[0] - 0.3
    for name, got in losses.items():
        assert got == pytest.approx(ref, rel=1e-4, abs=1e-4), (name, got, ref)


def test_single_process_run_with_epochs_and_grad_accumulation(tmp_path, cache_dir):
    run_train([*FAST, "strategy=single", "trainer.max_steps=null", "trainer.max_epochs=1",
               "data.synthetic_tokens=20000", "trainer.grad_accum_steps=2"], tmp_path, cache=cache_dir)
    res = results(tmp_path)
    # 19000 train tokens / 64 = 296 samples -> 74 micro-batches of 4 -> 37 steps of 2
    assert res["steps"] == 37 and res["hparams"]["world_size"] == 1
    assert "process group" not in (tmp_path / "train_rank0.log").read_text()


def test_fsdp_with_activation_checkpointing_and_cpu_offload(tmp_path, cache_dir):
    run_train([*FAST, "strategy=fsdp", "strategy.cpu_offload=true", "strategy.reshard_after_forward=false",
               "activation_checkpointing=true", "trainer.max_steps=6", "optim.lr=1e-2"], tmp_path, nproc=2,
              cache=cache_dir)
    log0 = (tmp_path / "train_rank0.log").read_text()
    assert "activation checkpointing on 2 blocks" in log0 and "cpu_offload=True" in log0
    assert results(tmp_path)["train_loss"] < results(tmp_path)["first_loss"]


def test_default_corpus_run_writes_weights_and_a_sample(tmp_path, cache_dir):
    """The main job's path on the stdlib corpus (shortened): weights file loads into a fresh GPT."""
    run_train(["strategy=fsdp", "precision=fp32", "trainer.max_steps=4", "data.batch_size=2", "data.seq_len=64",
               "trainer.eval_samples=8", "trainer.sample_tokens=16", "trainer.progress_bar=false",
               "logger.peak_flops=1e11"], tmp_path, nproc=2, cache=cache_dir)
    log0 = (tmp_path / "train_rank0.log").read_text()
    assert "sample:\ndef " in log0 and "data=python_stdlib" in log0
    from safetensors.torch import load_file

    from hydratrain.models.gpt import GPT, GPTConfig

    state = load_file(str(tmp_path / "model.safetensors"))
    model = GPT(GPTConfig())
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied: stored once or twice, both load
    assert state["blocks.0.attn.wq.weight"].shape == (128, 128)


def test_ranks_share_one_run_dir_without_explicit_dir(tmp_path, cache_dir):
    run_train([*FAST, "strategy=ddp", "trainer.max_steps=2"], None, nproc=2, cwd=tmp_path, cache=cache_dir)
    dirs = [p for p in (tmp_path / "outputs").glob("*/*") if p.is_dir()]
    assert len(dirs) == 1, dirs
    assert {p.name for p in dirs[0].iterdir()} >= {"train_rank0.log", "train_rank1.log", ".hydra", "tensorboard"}


def test_run_stamp_is_agreed_by_ranks_started_apart(tmp_path):
    """Two ranks that start 1.5 s apart (so their clocks' stamps differ) still agree via the store."""
    code = ("import time,sys,os; time.sleep(float(sys.argv[1])); "
            "from hydratrain.dist.run_dir import run_stamp; print(run_stamp())")
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {**__import__("os").environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
           "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "t1", "TORCHELASTIC_USE_AGENT_STORE": "True"}  # as torchrun
    procs = [subprocess.Popen([sys.executable, "-c", code, str(delay)], env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, text=True) for r, delay in enumerate((0.0, 1.5))]
    stamps = [p.communicate(timeout=60)[0].strip() for p in procs]
    assert stamps[0] == stamps[1] and re.fullmatch(r"\d{4}-\d\d-\d\d/\d\d-\d\d-\d\d", stamps[0])


def test_fp16_inf_on_one_rank_skips_the_step_on_every_rank():
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(ROOT / "tests/scripts/fp16_inf_skip.py")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("poison=True scale 1024 -> 512, params_changed=False") == 2, proc.stdout


def test_large_preset_is_built_on_meta_and_each_rank_holds_half(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(ROOT / "tests/scripts/meta_shard_llama.py")], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = re.findall(r"rank (\d): local_param_bytes=(\d+) total_param_bytes=(\d+) max_rss_bytes=(\d+)", proc.stdout)
    assert len(rows) == 2, proc.stdout
    for _, local, total, rss in rows:
        local, total, rss = int(local), int(total), int(rss)
        assert total > 4e9  # ~1.1B fp32 parameters
        assert abs(local / total - 0.5) < 0.01
        assert rss < 0.8 * total  # never held the whole model


def test_env_report():
    out = subprocess.run([sys.executable, "-m", "hydratrain.env"], capture_output=True, text=True, check=True).stdout
    assert "torch 2." in out and "cuda available:" in out and "backends: gloo" in out
    assert "strategies: single, ddp, fsdp" in out and "precisions: fp32" in out


def test_text_files_relative_paths_resolve_against_the_launch_dir(tmp_path, cache_dir):
    (tmp_path / "notes").mkdir()
    for i in range(4):
        (tmp_path / "notes" / f"n{i}.txt").write_text(f"note {i}: the quick brown fox jumps over the lazy dog\n" * 60)
    run_train([*FAST, "strategy=single", "data=text_files", "data.paths=[notes/*.txt]", "data.val_fraction=0.3",
               "trainer.max_steps=3"], tmp_path / "run", cwd=tmp_path, cache=cache_dir)
    log0 = (tmp_path / "run" / "train_rank0.log").read_text()
    assert re.search(r"data=text_files: .* \(train \d files / \d+ tokens, val \d files", log0), log0
