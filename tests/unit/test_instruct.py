"""data=instruct (extra [hf]; skipped without it): the loss counts response tokens only (a hand computation), a
packed batch gives the padded batch's loss, truncation cuts or drops with counts, the token cache is built once, the
data position resumes exactly on another world size, and a packed fine-tune resumes bit-identically."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from helpers import assert_same_tensors, ckpt_of, load_weights, log_of, requires

pytestmark = requires("hf")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

SMALL = dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True, vocab_size=320)


@pytest.fixture(scope="module")
def arith(tmp_path_factory) -> Path:
    """A dir with arith.jsonl (200 records), chat.jsonl (the same as ``messages``) and tiny/ (a random Llama of
    :data:`SMALL` with a BPE and a chat template)."""
    from hydratrain.examples.arith import arith_records, tiny_llama, write_records

    root = tmp_path_factory.mktemp("arith")
    records = arith_records(200)
    write_records(root / "arith.jsonl", records)
    write_records(root / "chat.jsonl", [{"messages": [{"role": "user", "content": r["prompt"]},
                                                      {"role": "assistant", "content": r["completion"]}]}
                                        for r in records])
    tiny_llama(root / "tiny", [f"{r['prompt']} {r['completion']}" for r in records], SMALL)
    return root


def datasets_of(arith: Path, cache: Path, file: str = "arith.jsonl", **kwargs):
    from hydratrain.data.instruct import instruct_datasets

    return instruct_datasets([file], tokenizer="tiny", data_dir=str(arith), cache_dir=str(cache), **kwargs)


def model_of(arith: Path):
    from transformers import AutoModelForCausalLM

    # fp32, sdpa, no KV cache: as a run builds it (transformers reads packed positions only without a cache)
    return AutoModelForCausalLM.from_pretrained(str(arith / "tiny"), use_cache=False, dtype=torch.float32).eval()


def test_the_loss_counts_the_response_tokens_only(arith, tmp_path):
    """Each example's labels are its ids on the completion and the end-of-text token, -100 on the prompt and the
    padding; the model's own loss of a padded batch equals the mean of -log p over exactly those tokens."""
    import torch.nn.functional as F
    from transformers import AutoTokenizer

    from hydratrain.data.instruct import collate
    from hydratrain.examples.arith import arith_records

    ds = datasets_of(arith, tmp_path)
    tok = AutoTokenizer.from_pretrained(str(arith / "tiny"))
    records = arith_records(200)
    # (the loader splits the one dataset; here every record is an example, in file order)
    for i in range(3):
        answer = tok(records[i]["completion"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        sample = ds[i]
        assert sample["input_ids"].tolist() == tok(records[i]["prompt"])["input_ids"] + answer
        assert sample["labels"].tolist() == [-100] * (len(sample["labels"]) - len(answer)) + answer
    batch = collate([ds[i] for i in range(4)])
    model = model_of(arith)
    with torch.no_grad():
        out = model(**batch)
    logp = F.log_softmax(out.logits.double(), -1)
    total, count = 0.0, 0
    for row in range(4):
        for t in range(batch["labels"].shape[1] - 1):
            target = int(batch["labels"][row, t + 1])
            if target != -100:
                total -= float(logp[row, t, target])
                count += 1
    assert count == sum(int((ds[i]["labels"] != -100).sum()) for i in range(4))
    assert abs(out.loss.item() - total / count) < 1e-5, (out.loss.item(), total / count)


@pytest.mark.parametrize("file", ["arith.jsonl", "chat.jsonl"], ids=["prompt-completion", "messages"])
def test_a_packed_batch_gives_the_padded_batchs_loss(arith, tmp_path, file):
    """The examples of two packed windows, padded one per row instead: the same loss in fp32 (within 1e-5), and the
    same logits on each example (attention never crosses into another example; positions restart)."""
    from hydratrain.data.instruct import collate

    padded = datasets_of(arith, tmp_path, file, seq_len=64)
    packed = datasets_of(arith, tmp_path, file, seq_len=64, packing=True)
    assert len(packed) <= len(padded) / 2
    n = len(packed.windows[0]) + len(packed.windows[1])
    assert packed.windows[0][0] == padded.spans[0] and packed.windows[1][-1] == padded.spans[n - 1]
    model = model_of(arith)
    with torch.no_grad():
        a = model(**collate([packed[0], packed[1]]))
        b = model(**collate([padded[i] for i in range(n)]))
    assert abs(a.loss.item() - b.loss.item()) < 1e-5, (a.loss.item(), b.loss.item())
    at = 0
    for i in range(len(packed.windows[0])):
        length = padded.spans[i][1] - padded.spans[i][0]
        torch.testing.assert_close(a.logits[0, at:at + length], b.logits[i, :length], atol=1e-5, rtol=0)
        at += length
    assert packed[0]["position_ids"][:at].tolist() == \
        [p for i in range(len(packed.windows[0])) for p in range(padded.spans[i][1] - padded.spans[i][0])]


def test_truncation_cuts_the_end_of_the_response_or_drops_with_counts(arith, tmp_path, caplog):
    """Examples longer than seq_len lose the end of their response (cut) or are dropped (drop), and the log counts
    them; an example whose prompt alone fills seq_len is dropped either way."""
    import logging

    from transformers import AutoTokenizer

    from hydratrain.data.instruct import encode

    tok = AutoTokenizer.from_pretrained(str(arith / "tiny"))
    records = [{"prompt": "What is 1 + 1?", "completion": "2"}, {"prompt": "What is 1 + 1?", "completion": "2 " * 30},
               {"prompt": "What is 1 + 1? " * 20, "completion": "2"}, {"prompt": "What is 2 + 2?", "completion": "4"}]
    (arith / "long.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    lengths = [len(encode(r, tok)[0]) for r in records]
    prompt = len(encode(records[2], tok)[0]) - 2
    seq_len = 24
    assert lengths[0] < seq_len < lengths[1] and prompt >= seq_len and lengths[3] < seq_len
    with caplog.at_level(logging.INFO, logger="hydratrain.data.instruct"):
        cut = datasets_of(arith, tmp_path, "long.jsonl", seq_len=seq_len)
        drop = datasets_of(arith, tmp_path, "long.jsonl", seq_len=seq_len, truncation="drop")
    assert (len(cut), cut.cut, cut.dropped) == (3, 1, 1)  # record 2 cut is all prompt: nothing left to learn
    assert (len(drop), drop.cut, drop.dropped) == (2, 0, 2)
    assert cut[1]["input_ids"].tolist() == encode(records[1], tok)[0][:seq_len]
    assert "4 records -> 3 examples" in caplog.text and "1 cut, 1 dropped" in caplog.text
    assert "4 records -> 2 examples" in caplog.text and "0 cut, 2 dropped" in caplog.text


def test_the_token_cache_is_built_once_and_read_for_any_length_or_packing(arith, tmp_path, monkeypatch):
    """A second call with another seq_len, truncation or packing reads the same cache (no record is tokenized
    again); a changed file builds a new one."""
    from hydratrain.data import instruct

    datasets_of(arith, tmp_path)
    built = list(tmp_path.glob("instruct-*"))

    def refused(*args, **kwargs):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(instruct, "encode", refused)
    again = datasets_of(arith, tmp_path, seq_len=32, truncation="drop", packing=True)
    assert len(again) > 0 and list(tmp_path.glob("instruct-*")) == built
    monkeypatch.undo()
    (arith / "copy.jsonl").write_text((arith / "arith.jsonl").read_text())
    datasets_of(arith, tmp_path, "copy.jsonl")
    assert len(list(tmp_path.glob("instruct-*"))) == 2


def test_the_data_position_resumes_exactly_on_another_world_size(arith, tmp_path):
    """Packed windows drawn by the loader's global order: 3 micro-batches on each of 2 ranks, then the position
    continued on 1 rank with another batch size, cover the epoch's windows once each, none repeated or skipped."""
    from omegaconf import OmegaConf

    from hydratrain.data.loader import loader_fetch
    from hydratrain.data.streams import ShardedBatches

    ds = datasets_of(arith, tmp_path, seq_len=64, packing=True)
    node = OmegaConf.create({"_target_": "x", "collate_fn": {"_target_": "hydratrain.data.instruct.collate"}})
    windows = {tuple(ds[i]["input_ids"].tolist()): i for i in range(len(ds))}
    assert len(windows) == len(ds)

    def batches(rank, world, batch, state=None):
        b = ShardedBatches(ds, batch, rank, world, seed=3, fetch=loader_fetch(ds, node, torch.device("cpu")))
        if state is not None:
            b.load_state_dict(state)
        return b

    def taken(it, n):
        return [windows[tuple(row.tolist())] for _ in range(n) for row in next(it)["input_ids"]]

    ranks = [batches(r, 2, 2) for r in range(2)]
    seen = [i for b in ranks for i in taken(iter(b), 3)]
    state = ranks[0].state_dict()
    assert state["samples_in_epoch"] == 12 and len(set(seen)) == 12
    rest = batches(0, 1, 3, state)
    left = (len(ds) - 12) // 3
    later = taken(iter(rest), left)
    rest.order.set_epoch(0)  # (iterating ran one batch ahead, into epoch 1)
    order = list(rest.order)  # epoch 0's global order, the same on any world size
    assert sorted(seen) == sorted(order[:12]) and later == order[12:12 + 3 * left]


def test_a_packed_fine_tune_resumes_bit_identically(cli, arith, tmp_path):
    """A run of data=instruct with packing on the tiny Llama dir, and its resume from step 2: the same final weights;
    the log counts the records, windows and response tokens. The pretrained dir's tokenizer (its special tokens and
    chat template) travels with the checkpoints into export/ and python -m hydratrain.export's dir, as it was."""
    args = ["model=hf_causal_lm", "model.config=null", f"model.pretrained={arith / 'tiny'}", "model.vocab_size=320",
            "data=instruct", f"data.paths=[{arith / 'arith.jsonl'}]", "data.seq_len=64", "data.packing=true",
            "data.batch_size=2", "device=cpu", "precision=fp32", "strategy=single", "logger.peak_flops=1e11",
            "trainer.max_steps=4", "trainer.eval_every_n_steps=0", "trainer.eval_samples=4",
            "trainer.log_every_n_steps=1", "trainer.sample_tokens=0", "trainer.progress_bar=false",
            "scheduler.warmup_steps=1", "checkpoint.every_n_steps=2", "checkpoint.save_last=true",
            "trainer.save_weights=true"]
    run_a, run_b = tmp_path / "a", tmp_path / "b"
    cli(args, run_a, fast=False).ok()
    assert "data=instruct train: 200 records -> " in log_of(run_a)
    from transformers import AutoTokenizer

    from hydratrain.export import main as export_main

    assert export_main([str(ckpt_of(run_a, 4)), str(tmp_path / "again")]) == 0
    source = AutoTokenizer.from_pretrained(str(arith / "tiny"))
    for where in (ckpt_of(run_a, 4), run_a / "export", tmp_path / "again"):
        for name in ("tokenizer.json", "tokenizer_config.json"):
            assert (where / name).read_bytes() == (arith / "tiny" / name).read_bytes(), (where, name)
        tok = AutoTokenizer.from_pretrained(str(where))
        chat = [{"role": "user", "content": "1+2"}, {"role": "assistant", "content": "3"}]
        assert tok.apply_chat_template(chat) == source.apply_chat_template(chat) and tok.eos_token == source.eos_token
    cli([*args, f"checkpoint.resume_from={ckpt_of(run_a, 2)}"], run_b, fast=False).ok()
    assert_same_tensors(load_weights(run_a / "model.safetensors"), load_weights(run_b / "model.safetensors"),
                        "final weights of a packed fine-tune and of its resume from step 2")
