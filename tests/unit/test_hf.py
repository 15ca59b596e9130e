"""Hugging Face transformers models and datasets files, in this process (extra [hf]; skipped without it):
the model's own init driven exactly (eager = meta), a pretrained dir written by save_pretrained fine-tunes from
exactly its weights, the export round-trips to the same logits, resume is bit-identical, the hf_dataset token cache
is reused and rebuilt when its inputs change, and every bad input is one line naming its key, exit 2, before any
process group. (Two gloo ranks: tests/e2e/test_hf_runs.py.)"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from helpers import assert_same_tensors, ckpt_of, load_weights, log_of, requires, results

pytestmark = requires("hf")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True)
GPT2 = dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, n_positions=256)
# a run of seconds: the tiny Llama, 64-token windows, no sample, fp32 on the CPU
BASE = ["model=hf_causal_lm", "model.config.hidden_size=64", "model.config.intermediate_size=128",
        "model.config.max_position_embeddings=256", "device=cpu", "precision=fp32", "logger.peak_flops=1e11",
        "data.seq_len=64", "data.batch_size=4", "trainer.max_steps=4", "trainer.eval_every_n_steps=0",
        "trainer.eval_samples=8", "trainer.log_every_n_steps=1", "trainer.sample_tokens=0",
        "trainer.progress_bar=false", "scheduler.warmup_steps=1"]


def texts(n: int = 40) -> list[str]:
    """``n`` records of real text: functions of the standard library's json package."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"]) / "json"
    chunks = [c for f in sorted(root.glob("*.py")) for c in f.read_text().split("\ndef ") if len(c) > 200]
    return [chunks[i % len(chunks)] for i in range(n)]


def write_jsonl(path: Path, n: int = 40, field: str = "content") -> Path:
    path.write_text("".join(json.dumps({field: t, "id": i}) + "\n" for i, t in enumerate(texts(n))))
    return path


def pretrained_dir(path: Path, config: dict = LLAMA, vocab: int = 320) -> Path:
    """A save_pretrained dir: a tiny model of ``config`` with random weights and a byte-level BPE tokenizer.json of
    at most ``vocab`` tokens trained here."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hydratrain.data.tokenizer import train_bpe

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(**{**config, "vocab_size": vocab})
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(str(path))
    train_bpe(texts(), vocab, path / "tokenizer.json")
    return path


def built(config: dict, device: str, seed: int = 1234, **kwargs):
    """``causal_lm(config)`` built on ``device`` (meta: materialised on the CPU) and initialised by hydratrain's
    init protocol."""
    from hydratrain.models.hf import causal_lm
    from hydratrain.parallel import init

    with torch.device(device):
        model = causal_lm(config, **kwargs)
    if device == "meta":
        init.to_empty_keeping_ties(model, torch.device("cpu"))
    init.initialise(model, seed, torch.device("cpu"), built_on_meta=device == "meta")
    return model


# ------------------------------------------------------------------------------------------------ the model
@pytest.mark.parametrize("config", [LLAMA, GPT2], ids=["llama", "gpt2"])
def test_init_is_the_models_own_and_the_same_eager_and_on_meta(config):
    """transformers' own init (normal(0, initializer_range), GPT-2's residual projections scaled by 1/sqrt(2 n_layer),
    norms at 1, rotary tables) after a meta build equals the eager build's, bit for bit; tied weights stay tied."""
    eager, meta = built(config, "cpu", vocab_size=256), built(config, "meta", vocab_size=256)
    assert_same_tensors(eager.state_dict(), meta.state_dict(), "eager and meta-built initial weights")
    for a, b in zip(eager.buffers(), meta.buffers()):
        assert torch.equal(a, b)
    assert meta.lm_head.weight is meta.get_input_embeddings().weight
    params = dict(meta.named_parameters())
    if config["model_type"] == "gpt2":
        assert abs(params["transformer.h.0.attn.c_proj.weight"].std().item() - 0.02 / 2) < 0.003
        assert abs(params["transformer.h.0.attn.c_attn.weight"].std().item() - 0.02) < 0.003
    else:
        assert abs(params["model.layers.0.mlp.down_proj.weight"].std().item() - 0.02) < 0.003
        assert torch.equal(params["model.norm.weight"], torch.ones(64))
    other = built(config, "meta", seed=99, vocab_size=256)
    assert not torch.equal(other.lm_head.weight, meta.lm_head.weight)  # the run seed matters


def test_blocks_come_from_no_split_modules_and_the_vocab_from_the_data():
    from hydratrain.models.hf import causal_lm
    from hydratrain.parallel.blocks import find_blocks
    from hydratrain.parallel.init import PER_PARAMETER, protocol_of_class

    with torch.device("meta"):
        model = causal_lm(LLAMA, vocab_size=320)
    blocks = find_blocks(model)
    assert (blocks.describe(), blocks.source) == ("2 LlamaDecoderLayer", "_no_split_modules")
    assert model.config.vocab_size == 320 and model.config.use_cache is False
    assert protocol_of_class(causal_lm) == PER_PARAMETER  # so init_device=auto builds it on meta under FSDP
    with torch.device("meta"):
        fixed = causal_lm({**LLAMA, "vocab_size": 512}, vocab_size=320)
    assert fixed.config.vocab_size == 512  # a config's own vocab_size wins over the data's


def test_pretrained_weights_are_read_exactly_on_a_meta_build(tmp_path):
    """model.pretrained read by the init protocol into a meta-built model gives transformers' from_pretrained
    weights and logits (tied lm_head absent from the file, filled through the tie)."""
    from transformers import AutoModelForCausalLM

    src = pretrained_dir(tmp_path / "pre")
    ours = built(None, "meta", pretrained=str(src), vocab_size=320)
    ref = AutoModelForCausalLM.from_pretrained(str(src))
    assert_same_tensors(ref.state_dict(), ours.state_dict(), "from_pretrained and model.pretrained weights")
    ids = torch.randint(0, 320, (2, 16))
    assert torch.equal(ref(ids).logits, ours(ids).logits)


# ------------------------------------------------------------------------------------------------ the data
def test_hf_dataset_cache_is_reused_and_rebuilt_when_the_files_or_tokenizer_change(compose, tmp_path):
    from hydratrain.data import hf_dataset
    from hydratrain.data.tokenizer import train_bpe

    data = write_jsonl(tmp_path / "d.jsonl")
    cfg = compose([*BASE, "data=hf_dataset", f"data.paths=[{data}]", "data.text_field=content",
                   f"data.tokenizer={tmp_path / 'tok.json'}"])
    tok = train_bpe(texts(), 300, tmp_path / "tok.json")
    first = hf_dataset.build_cache(cfg.data, tmp_path, tmp_path / "cache", tok, False)
    meta = json.loads((first / "meta.json").read_text())
    assert meta["splits"]["val"]["records"] == 2 and meta["splits"]["train"]["records"] == 38  # 5% of 40, ceil
    stamp = (first / "train.bin").stat().st_mtime_ns
    assert hf_dataset.build_cache(cfg.data, tmp_path, tmp_path / "cache", tok, False) == first
    assert (first / "train.bin").stat().st_mtime_ns == stamp  # reused, not rewritten
    tok2 = train_bpe(texts(), 290, tmp_path / "tok2.json")
    assert hf_dataset.build_cache(cfg.data, tmp_path, tmp_path / "cache", tok2, False) != first
    write_jsonl(data, n=41)
    assert hf_dataset.build_cache(cfg.data, tmp_path, tmp_path / "cache", tok, False) != first
    tokens = hf_dataset.load_token_splits(cfg.data, tok, tmp_path, tmp_path / "cache", False)["train"]
    assert tokens.dtype == "uint16" and int(tokens.max()) < tok.vocab_size


# ------------------------------------------------------------------------------------- runs in this process
def test_pretrained_dir_fine_tunes_from_its_weights_and_exports_back(cli, compose, tmp_path):
    """A save_pretrained dir fine-tuned on a JSON-lines dataset tokenized by its own tokenizer.json: step 1's loss is
    the loss transformers computes for the loaded model on the first batch; the run's export/ loads with
    from_pretrained (model and tokenizer) and gives the trained model's logits, bit for bit; python -m
    hydratrain.export writes the same dir from the checkpoint; a resume from step 2 ends bit-identical."""
    import torch.nn.functional as F
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hydratrain.data.build import build_data, data_vocabulary
    from hydratrain.dist.env import DistInfo
    from hydratrain.export import main as export_main
    from hydratrain.models.hf import causal_lm

    src = pretrained_dir(tmp_path / "pre")
    data = write_jsonl(tmp_path / "d.jsonl")
    args = [*BASE, "strategy=single", f"model.pretrained={src}", "~model.config", "data=hf_dataset",
            f"data.paths=[{data}]", "data.text_field=content", "checkpoint.every_n_steps=2",
            "checkpoint.save_last=true", "trainer.save_weights=true", "optim.lr=1e-2"]
    run_a = tmp_path / "a"
    cli(args, run_a, fast=False).ok()
    log0 = log_of(run_a)
    assert "blocks: 2 LlamaDecoderLayer (from _no_split_modules)" in log0 and "mfu" in log0

    cfg = compose(args)
    info = DistInfo(device=torch.device("cpu"))
    tokenizer, vocab = data_vocabulary(cfg, info, tmp_path, False, cache_dir=Path(os.environ["HYDRATRAIN_CACHE"]))
    assert tokenizer.path == src / "tokenizer.json"
    x, y = next(iter(build_data(cfg, info, tmp_path, False, vocab,
                                cache_dir=Path(os.environ["HYDRATRAIN_CACHE"]))[0]))
    ref = AutoModelForCausalLM.from_pretrained(str(src))
    expected = F.cross_entropy(ref(x).logits.float().flatten(0, 1), y.flatten()).item()
    assert abs(results(run_a)["first_loss"] - expected) < 1e-5, (results(run_a)["first_loss"], expected)

    exported = AutoModelForCausalLM.from_pretrained(str(run_a / "export"))
    trained = causal_lm(None, pretrained=str(src))
    trained.load_state_dict(load_file(str(run_a / "model.safetensors")))
    assert torch.equal(exported(x).logits, trained(x).logits)
    assert not torch.equal(exported(x).logits, ref(x).logits)  # it trained
    hf_tok = AutoTokenizer.from_pretrained(str(run_a / "export"))
    assert hf_tok("def f(x):\n")["input_ids"] == tokenizer.encode("def f(x):\n")

    assert export_main([str(ckpt_of(run_a, 4)), str(tmp_path / "again")]) == 0
    assert_same_tensors(load_file(str(run_a / "export" / "model.safetensors")),
                        load_file(str(tmp_path / "again" / "model.safetensors")), "export/ and hydratrain.export")

    run_b = tmp_path / "b"
    cli([*args, f"checkpoint.resume_from={ckpt_of(run_a, 2)}"], run_b, fast=False).ok()
    assert f"resumed from {ckpt_of(run_a, 2)}" in log_of(run_b)
    assert_same_tensors(load_weights(run_a / "model.safetensors"), load_weights(run_b / "model.safetensors"),
                        "final weights of a run and of its resume from step 2")


# ------------------------------------------------------------------------------------------------ bad input
def _bad_inputs(tmp_path: Path) -> list:
    data = write_jsonl(tmp_path / "d.jsonl")
    src = pretrained_dir(tmp_path / "pre")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text((src / "config.json").read_text())
    big = tmp_path / "big.json"
    from hydratrain.data.tokenizer import train_bpe

    train_bpe(texts(), 400, big)
    return [
        (["model.config.model_type=lama"], "model.config.model_type='lama': unknown to transformers"),
        (["+model.config.hiden_size=64"], "model.config.hiden_size=64: not a key of LlamaConfig"),
        ([f"model.pretrained={tmp_path / 'empty'}", "~model.config"],
         f"model.pretrained='{tmp_path / 'empty'}': holds no weights"),
        ([f"model.pretrained={src}", "model.config={hidden_size: 96}"],
         "model.pretrained=" + repr(str(src)) + ": model.embed_tokens.weight has shape [320, 64] in its weights, "
         "the model.config gives [320, 96]"),
        (["data=hf_dataset", f"data.paths=[{data}]", "data.text_field=body"],
         "data.text_field='body': not a column of the json files of data.paths (its columns: content, id)"),
        ([f"model.pretrained={src}", "~model.config", "data=hf_dataset", f"data.paths=[{data}]",
          "data.text_field=content", f"data.tokenizer={big}"],
         f"data.tokenizer='{big}': the tokenizer {big} has 400 tokens, more than the model's vocabulary of 320"),
        (["~model.config", "+model.config={model_type: gpt2, n_embd: 32, n_layer: 1, n_head: 2, n_positions: 16}",
          "data.seq_len=32"],
         "data.seq_len=32: longer than the 16 positions the model has"),
    ]


def test_each_bad_input_is_one_line_naming_its_key_before_any_process_group(cli, tmp_path):
    for overrides, line in _bad_inputs(tmp_path):
        r = cli([*BASE, "strategy=fsdp", *overrides], tmp_path / "run", fast=False)
        assert r.returncode == 2, (overrides, r.output[-3000:])
        errors = [ln for ln in r.output.splitlines() if ln.startswith("hydratrain: config error:")]
        assert len(errors) == 1 and line in errors[0], (overrides, r.output[-3000:])
        assert "process group" not in r.output and "Traceback" not in r.output
