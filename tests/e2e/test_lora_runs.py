"""LoRA (+peft=lora; extras [peft] and [hf], skipped without them) on 2 gloo ranks under FSDP and HSDP: the base is
sharded with the adapters and left bit for bit, the checkpoint holds adapters only, and a 2-rank FSDP run SIGKILLed
after a save continues on 1 rank bit for bit. In-process checks: tests/unit/test_lora.py."""
from __future__ import annotations

import pytest
import torch

from helpers import FAULTY, ckpt_of, load_weights, log_of, requires, results, run, tb_scalars

pytestmark = requires("peft", "hf")

HF_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
BASE = ["model=hf_causal_lm", "device=cpu", "precision=fp32", "logger.peak_flops=1e11", "data.seq_len=64",
        "data.batch_size=4", "trainer.eval_every_n_steps=0", "trainer.eval_samples=8", "trainer.log_every_n_steps=1",
        "trainer.sample_tokens=0", "trainer.progress_bar=false", "scheduler.warmup_steps=1", "optim.lr=1e-2"]
LORA = ["+peft=lora", "peft.r=4", "peft.alpha=8"]
# every rank SIGKILLs itself right after step 3 and its save (tests/scripts/faulty_train.py)
KILL_AFTER_3 = {"HT_FAULT": "kill", "HT_FAULT_STEP": "3", "HT_FAULT_AT": "after_step", "HT_FAULT_RANK": "all"}


def pretrained_dir(path):
    """A save_pretrained dir of a tiny random Llama (2 x 64, byte vocabulary: the default corpus's)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                  tie_word_embeddings=True, vocab_size=256)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(path))
    return path


@pytest.mark.slow  # three launches, ~60 s
def test_fsdp_lora_killed_on_two_ranks_continues_bit_identically_on_one_rank(tmp_path, cache_dir):
    """Run A: 2 ranks x 1 sample under FSDP, 6 steps. Run B: the same, SIGKILLed on every rank right after its
    step-3 save (tests/scripts/faulty_train.py). Run C: B's step-3 checkpoint resumed on 1 rank with
    ``trainer.grad_accum_steps=2``, so each step sums the gradients of the same two samples, each halved, as A's
    reduce-scatter does (exact: a division by 2). C logs A's losses at steps 4-6 and ends with A's adapters, bit for
    bit: the adapters, their moments and the data position load exactly into another world size, and the base comes
    from model.pretrained again. The checkpoint holds adapters only, and every pretrained weight the adapters do not
    touch ends bit for bit."""
    from safetensors.torch import load_file

    from hydratrain.checkpoint.io import verify
    from hydratrain.checkpoint.manager import list_checkpoints

    env = {**HF_ENV, "HYDRATRAIN_CACHE": str(cache_dir)}
    src = pretrained_dir(tmp_path / "pre")
    args = [*BASE, *LORA, f"model.pretrained={src}", "~model.config", "strategy=fsdp", "trainer.max_steps=6",
            "checkpoint.every_n_steps=3", "trainer.save_weights=true", "data.batch_size=1",
            "trainer.grad_clip=0"]  # (no clipping: the norm of 2 shards and of the whole differ in the last bit)
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    run(args, a, nproc=2, fast=False, env=env).ok()
    assert "fsdp: sharded 3 modules (2 LlamaDecoderLayer by wrap_policy=auto + root)" in log_of(a)
    assert "the base frozen" in log_of(a)
    killed = run(args, b, nproc=2, script=FAULTY, fast=False, env={**env, **KILL_AFTER_3})
    assert killed.returncode != 0 and "SIGKILL" in killed.output, killed.output[-3000:]
    assert [p.name for _, p in list_checkpoints(b / "checkpoints")] == ["step_00000003"]
    saved = [k for k in verify(ckpt_of(b, 3)).state_dict_metadata if k.startswith("model.")]
    assert saved and all(".lora_A." in k or ".lora_B." in k for k in saved), saved[:4]
    run([*args, "trainer.grad_accum_steps=2", f"checkpoint.resume_from={ckpt_of(b, 3)}"], c, nproc=1, fast=False,
        env=env).ok()
    assert f"resumed from {ckpt_of(b, 3)}" in log_of(c)
    losses_a, losses_c = tb_scalars(a), tb_scalars(c)
    assert sorted(losses_c) == [4, 5, 6] and [losses_c[s] for s in (4, 5, 6)] == [losses_a[s] for s in (4, 5, 6)], \
        (losses_a, losses_c)
    assert results(c)["steps"] == 6

    adapters = [load_file(str(r / "adapter" / "adapter_model.safetensors")) for r in (a, c)]
    assert sorted(adapters[0]) == sorted(adapters[1])
    for key, value in adapters[0].items():
        assert torch.equal(value, adapters[1][key]), key
    pre = load_file(str(src / "model.safetensors"))
    adapted = {k.split(".lora_A.")[0].removeprefix("base_model.model.") for k in adapters[0] if ".lora_A." in k}
    kept = [k for k in pre if k.removesuffix(".weight") not in adapted]
    for r in (a, c):
        merged = load_weights(r / "model.safetensors")
        assert kept and all(torch.equal(merged[k], pre[k]) for k in kept), r


@pytest.mark.slow  # one 2-rank launch, ~15 s
def test_hsdp_lora_trains_the_adapters_of_a_frozen_base(tmp_path, cache_dir):
    """strategy=hsdp (2 replicas of 1-way shards on 2 ranks): the adapters train, every pretrained weight they do not
    touch ends bit for bit, and the adapter dir is written."""
    from safetensors.torch import load_file

    env = {**HF_ENV, "HYDRATRAIN_CACHE": str(cache_dir)}
    src = pretrained_dir(tmp_path / "pre")
    a = tmp_path / "a"
    run([*BASE, *LORA, f"model.pretrained={src}", "~model.config", "strategy=hsdp", "strategy.shard_size=1",
         "trainer.max_steps=2", "trainer.save_weights=true"], a, nproc=2, fast=False, env=env).ok()
    assert "hsdp: sharded 3 modules" in log_of(a), log_of(a)[-2000:]
    adapter = load_file(str(a / "adapter" / "adapter_model.safetensors"))
    assert any(".lora_B." in k and v.abs().max() > 0 for k, v in adapter.items())  # (B starts at zero: it trained)
    pre, merged = load_file(str(src / "model.safetensors")), load_weights(a / "model.safetensors")
    adapted = {k.split(".lora_A.")[0].removeprefix("base_model.model.") for k in adapter if ".lora_A." in k}
    kept = [k for k in pre if k.removesuffix(".weight") not in adapted]
    assert kept and all(torch.equal(merged[k], pre[k]) for k in kept)
