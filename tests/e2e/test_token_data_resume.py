"""The subword data formats keep what the byte corpora guarantee: exact resume after SIGKILL, and a data position
that continues at the same sample on another world size."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from helpers import FAULTY, ckpt_of, log_of, run, tb_scalars
from hydratrain.data.corpora import synthetic_stream

KILL_AFTER_5 = {"HT_FAULT": "kill", "HT_FAULT_STEP": "5", "HT_FAULT_AT": "after_step", "HT_FAULT_RANK": "all"}


@pytest.fixture
def token_files(tmp_path):
    """train.bin / val.bin: uint16 ids < 1000, as nanoGPT's prepare scripts write them."""
    stream = synthetic_stream(120_000, 1000).astype(np.uint16)
    stream[:100_000].tofile(tmp_path / "train.bin")
    stream[100_000:].tofile(tmp_path / "val.bin")
    return ["data=token_bin", f"data.train_path={tmp_path / 'train.bin'}", f"data.val_path={tmp_path / 'val.bin'}",
            "model.vocab_size=1024", "data.seq_len=64", "data.batch_size=4"]


@pytest.mark.slow
def test_token_bin_resumes_bit_identically_after_sigkill(tmp_path, token_files):
    common = [*token_files, "strategy=fsdp", "trainer.max_steps=8", "checkpoint.every_n_steps=5",
              "trainer.eval_every_n_steps=0"]
    run(common, tmp_path / "a", nproc=2).ok()
    killed = run(common, tmp_path / "b", nproc=2, script=FAULTY, env=KILL_AFTER_5)
    assert killed.returncode != 0 and ckpt_of(tmp_path / "b", 5).is_dir()
    run(common, tmp_path / "b", nproc=2).ok()
    a, b = tb_scalars(tmp_path / "a"), tb_scalars(tmp_path / "b")
    assert [b[s] for s in range(6, 9)] == [a[s] for s in range(6, 9)]


@pytest.mark.slow
def test_tokenized_text_position_continues_on_another_world_size(tmp_path):
    (tmp_path / "docs").mkdir()
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    rng = np.random.default_rng(0)
    for i in range(6):
        (tmp_path / "docs" / f"d{i}.txt").write_text(" ".join(rng.choice(words, 6000)) + "\n")
    data = ["data=tokenized_text", "data.paths=[docs/*.txt]", "data.vocab_size=300", "data.val_fraction=0.3",
            "data.seq_len=32", "data.batch_size=4", f"data.cache_dir={tmp_path / 'cache'}",
            "trainer.eval_every_n_steps=0"]
    run([*data, "strategy=ddp", "trainer.max_steps=3", "checkpoint.save_last=true", "trainer.save_weights=true",
         "trainer.sample_tokens=12"], tmp_path / "a", nproc=2, cwd=tmp_path).ok()
    # the sample is text decoded by the tokenizer (3 steps make no words yet: the decoded prompt, then bytes), and
    # the tokenizer sits next to the weights
    sample = log_of(tmp_path / "a").split("sample:\n", 1)[1].split("\n[20", 1)[0]
    assert sample.startswith("\n") and len(sample) > 1 and "token ids" not in sample, sample
    assert (tmp_path / "a" / "tokenizer.json").is_file() and (tmp_path / "a" / "model.safetensors").is_file()
    run([*data, "strategy=single", "trainer.max_steps=5", f"checkpoint.resume_from={tmp_path / 'a'}"],
        tmp_path / "b", cwd=tmp_path).ok()
    log = log_of(tmp_path / "b")
    assert "data position remapped: 2 ranks x batch 4 -> 1 ranks x batch 4; epoch 0 continues at sample 24" in log
    saved = ckpt_of(tmp_path / "a", 3)  # a checkpoint carries the tokenizer and the resolved model config
    assert (saved / "tokenizer.json").is_file()
    assert json.loads((saved / "model.json").read_text())["vocab_size"] == 320  # 300 tokens padded to 64
    # an export carries both: usable without the training config
    r = subprocess.run([sys.executable, "-m", "hydratrain.export", str(saved), str(tmp_path / "w.safetensors")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and (tmp_path / "w.tokenizer.json").is_file(), r.stderr
    from safetensors import safe_open

    with safe_open(str(tmp_path / "w.safetensors"), "pt") as f:
        meta = f.metadata()
    assert json.loads(meta["model_config"])["vocab_size"] == 320 and meta["tokenizer"] == "w.tokenizer.json"
