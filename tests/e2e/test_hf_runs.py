"""Hugging Face transformers models on 2 gloo ranks under torchrun (extra [hf]; skipped without it): a meta-built,
FSDP-sharded Llama with activation checkpointing starts from exactly the weights one process draws (its step-1 loss
is the single-process run's on the same 8 samples); Llama and GPT-2 train under DDP and FSDP with auto units and
activation checkpointing; a 2-rank FSDP resume ends bit-identical; +experiment=hf_llama_tiny's loss falls >= 20 % in
its first 60 steps; +experiment=hf_sft_tiny's response-only eval/loss is under half the first loss by step 50.
In-process checks (init, pretrained, export, bad input): tests/unit/test_hf.py."""
from __future__ import annotations

import math

import pytest

from helpers import (
    Sweep,
    assert_same_tensors,
    ckpt_of,
    load_weights,
    log_of,
    requires,
    results,
    run,
    sweep_runs,
    tb_scalars,
)

pytestmark = requires("hf")

HF_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
TINY = ["model=hf_causal_lm", "model.config.hidden_size=64", "model.config.intermediate_size=128",
        "model.config.max_position_embeddings=256", "device=cpu", "precision=fp32", "logger.peak_flops=1e11",
        "data.seq_len=64", "trainer.eval_every_n_steps=0", "trainer.eval_samples=8", "trainer.log_every_n_steps=1",
        "trainer.sample_tokens=0", "trainer.progress_bar=false", "scheduler.warmup_steps=1"]


def gpt2_config(where) -> str:
    """A tiny GPT-2's config.json written into ``where`` (model.config as a path: a sweep's overlay merges dicts, so
    an inline gpt2 config would keep the default llama keys)."""
    from transformers import GPT2Config

    GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=256).save_pretrained(str(where))
    return f"model.config={where / 'config.json'}"


def _env(cache_dir) -> dict:
    return {**HF_ENV, "HYDRATRAIN_CACHE": str(cache_dir)}


COMMON = [*TINY, "activation_checkpointing=true", "data.batch_size=4", "optim.lr=1e-2"]
RESUME = [*COMMON, "strategy=fsdp", "trainer.max_steps=6", "checkpoint.every_n_steps=3", "trainer.save_weights=true"]


@pytest.fixture(scope="module")
def hf_runs(tmp_path_factory, cache_dir) -> Sweep:
    """The 2-rank runs that start from nothing, as the jobs of one sweep: Llama and GPT-2 under DDP and FSDP for 8
    steps (FSDP builds on meta), and the 6-step FSDP run that checkpoints at step 3 (``resume_a``)."""
    base = tmp_path_factory.mktemp("hf_runs")
    gpt2 = gpt2_config(base / "gpt2")
    runs = {"llama_ddp": [*COMMON, "trainer.max_steps=8", "strategy=ddp"],
            "llama_fsdp": [*COMMON, "trainer.max_steps=8", "strategy=fsdp"],
            "gpt2_ddp": [*COMMON, "trainer.max_steps=8", "strategy=ddp", gpt2],
            "gpt2_fsdp": [*COMMON, "trainer.max_steps=8", "strategy=fsdp", gpt2], "resume_a": RESUME}
    return sweep_runs(runs, base / "sweep", env=_env(cache_dir), common=[])  # (+debug=fast_gpt sets GPT keys)


@pytest.mark.slow  # the shared sweep's Llama FSDP job and an in-process run
def test_fsdp_meta_init_on_two_ranks_is_the_single_process_init(hf_runs, tmp_path, cli, monkeypatch):
    """2 ranks x 4 samples under FSDP (built on meta, each decoder layer its own unit, activations recomputed) and
    1 process x 8 samples see the same samples at step 1: equal step-1 losses mean equal initial weights."""
    for key, value in HF_ENV.items():
        monkeypatch.setenv(key, value)
    two = hf_runs.job("llama_fsdp")
    one = tmp_path / "one"
    cli([*TINY, "strategy=single", "data.batch_size=8", "trainer.max_steps=1"], one, fast=False).ok()
    log0 = log_of(two)
    assert "blocks: 2 LlamaDecoderLayer (from _no_split_modules)" in log0
    assert "activation checkpointing on 2 LlamaDecoderLayer" in log0
    assert "fsdp: sharded 3 modules (2 LlamaDecoderLayer by wrap_policy=auto + root)" in log0
    assert abs(results(two)["first_loss"] - results(one)["first_loss"]) < 1e-5, (results(two), results(one))
    assert math.isfinite(results(two)["mfu"])


@pytest.mark.slow  # the shared sweep's four Llama and GPT-2 jobs
def test_llama_and_gpt2_train_under_ddp_and_fsdp_with_activation_checkpointing(hf_runs):
    for name in ("llama_ddp", "llama_fsdp", "gpt2_ddp", "gpt2_fsdp"):
        job = hf_runs.job(name)
        res = results(job)
        assert res["train_loss"] < res["first_loss"] - 0.3, (name, res)
        block = "GPT2Block" if name.startswith("gpt2") else "LlamaDecoderLayer"
        assert f"activation checkpointing on 2 {block}" in log_of(job), name
        assert f"blocks: 2 {block} (from _no_split_modules)" in log_of(job), name


@pytest.mark.slow  # one 2-rank launch, resuming the shared sweep's resume_a
def test_fsdp_resume_on_two_ranks_is_bit_identical(hf_runs, tmp_path, cache_dir):
    a, b = hf_runs.job("resume_a"), tmp_path / "b"
    run([*RESUME, f"checkpoint.resume_from={ckpt_of(a, 3)}"], b, nproc=2, fast=False, env=_env(cache_dir)).ok()
    assert f"resumed from {ckpt_of(a, 3)}" in log_of(b)
    assert_same_tensors(load_weights(a / "model.safetensors"), load_weights(b / "model.safetensors"),
                        "final weights of a 2-rank FSDP run and of its resume from step 3")


@pytest.mark.slow  # ~30 s: the experiment as documented, its first 60 steps
def test_hf_llama_tiny_experiment_loss_falls(tmp_path, cache_dir):
    r = run(["+experiment=hf_llama_tiny", "strategy=fsdp", "trainer.progress_bar=false", "trainer.max_steps=60"],
            tmp_path / "x", nproc=2, fast=False, env=_env(cache_dir), timeout=600).ok()
    res = results(tmp_path / "x")
    assert res["steps"] == 60 and res["train_loss"] <= 0.8 * res["first_loss"], res
    assert (tmp_path / "x" / "export" / "config.json").is_file(), r.output[-2000:]


@pytest.mark.slow  # ~40 s: the experiment as documented, its first 100 steps
def test_hf_sft_tiny_experiment_response_only_eval_loss_falls(tmp_path, cache_dir):
    """python -m hydratrain.examples.arith arith, then +experiment=hf_sft_tiny on 2 FSDP ranks (packed windows) for
    100 of its 300 steps: the response-only eval/loss at step 50 is under half the first step's loss, and falls
    again by step 100."""
    from hydratrain.examples.arith import main as write_arith

    assert write_arith([str(tmp_path / "arith")]) == 0
    r = run(["+experiment=hf_sft_tiny", "trainer.progress_bar=false", "trainer.max_steps=100"], tmp_path / "x",
            nproc=2, fast=False, env=_env(cache_dir), cwd=tmp_path, timeout=600).ok()
    evals, first = tb_scalars(tmp_path / "x", "eval/loss"), results(tmp_path / "x")["first_loss"]
    assert sorted(evals) == [50, 100], r.output[-2000:]
    assert first > 5 and evals[50] < 0.5 * first and evals[100] < evals[50], (first, evals)
    assert "data=instruct train: " in log_of(tmp_path / "x")
