"""LoRA (+peft=lora; extras [peft] and [hf], skipped without them) on 2 gloo ranks under FSDP, and its resume on 1
rank: the base is sharded with the adapters and left bit for bit, the checkpoint holds adapters only, and the
1-rank continuation from the 2-rank step-3 checkpoint starts from exactly its state. In-process checks:
tests/unit/test_lora.py."""
from __future__ import annotations

import pytest
import torch

from helpers import ckpt_of, load_weights, log_of, requires, results, run, tb_scalars

pytestmark = requires("peft", "hf")

HF_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
BASE = ["model=hf_causal_lm", "device=cpu", "precision=fp32", "logger.peak_flops=1e11", "data.seq_len=64",
        "data.batch_size=4", "trainer.eval_every_n_steps=0", "trainer.eval_samples=8", "trainer.log_every_n_steps=1",
        "trainer.sample_tokens=0", "trainer.progress_bar=false", "scheduler.warmup_steps=1", "optim.lr=1e-2"]
LORA = ["+peft=lora", "peft.r=4", "peft.alpha=8"]


def pretrained_dir(path):
    """A save_pretrained dir of a tiny random Llama (2 x 64, byte vocabulary: the default corpus's)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                  tie_word_embeddings=True, vocab_size=256)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(path))
    return path


@pytest.mark.slow  # two launches, ~40 s
def test_fsdp_lora_on_two_ranks_resumes_on_one_rank(tmp_path, cache_dir):
    """2 ranks x 4 samples under FSDP for 6 steps (a checkpoint at 3), then 1 rank x 8 samples from that
    checkpoint: its step-4 loss is the 2-rank run's (the adapters, their moments and the data position load exactly
    into another world size; the base comes from model.pretrained again), and both runs end with the pretrained
    weights, every one the adapters do not touch bit for bit, and adapters within 1e-5 of each other."""
    from safetensors.torch import load_file

    env = {**HF_ENV, "HYDRATRAIN_CACHE": str(cache_dir)}
    src = pretrained_dir(tmp_path / "pre")
    args = [*BASE, *LORA, f"model.pretrained={src}", "~model.config", "strategy=fsdp", "trainer.max_steps=6",
            "checkpoint.every_n_steps=3", "trainer.save_weights=true"]
    a, b = tmp_path / "a", tmp_path / "b"
    run(args, a, nproc=2, fast=False, env=env).ok()
    assert "fsdp: sharded 3 modules (2 LlamaDecoderLayer by wrap_policy=auto + root)" in log_of(a)
    assert "the base frozen" in log_of(a)
    run([*args, "data.batch_size=8", f"checkpoint.resume_from={ckpt_of(a, 3)}"], b, nproc=1, fast=False,
        env=env).ok()
    assert f"resumed from {ckpt_of(a, 3)}" in log_of(b)
    assert abs(tb_scalars(b)[4] - tb_scalars(a)[4]) < 1e-6, (tb_scalars(a), tb_scalars(b))
    assert results(b)["steps"] == 6

    pre = load_file(str(src / "model.safetensors"))
    adapters = [load_file(str(r / "adapter" / "adapter_model.safetensors")) for r in (a, b)]
    adapted = {k.split(".lora_A.")[0].removeprefix("base_model.model.") for k in adapters[0] if ".lora_A." in k}
    for r in (a, b):
        merged = load_weights(r / "model.safetensors")
        kept = [k for k in pre if k.removesuffix(".weight") not in adapted]
        assert kept and all(torch.equal(merged[k], pre[k]) for k in kept), r
    for key, value in adapters[0].items():
        assert torch.allclose(value, adapters[1][key], atol=1e-5), key
