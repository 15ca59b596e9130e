"""optim=adamw8bit on 2 gloo ranks under FSDP2 (torchao's AdamW8bit on DTensor shards): it trains like adamw, its
8-bit state goes through a DCP checkpoint and a resume continues with bit-identical losses, and a checkpoint of
either optimizer resumes under the other (in process, both ways: tests/unit/test_adamw8bit.py)."""
from __future__ import annotations

import pytest

from helpers import ckpt_of, log_of, run, tb_scalars

pytest.importorskip("torchao")

COMMON = ["strategy=fsdp", "optim.lr=1e-2", "scheduler.warmup_steps=2", "trainer.eval_every_n_steps=0"]


@pytest.mark.slow
def test_adamw8bit_trains_like_adamw(tmp_path):
    # d_model 128 (gpt_tiny's width): each rank's matrix shards hold >= 4096 values, so torchao quantises them
    steps = ["trainer.max_steps=40", "trainer.log_every_n_steps=10", "model.d_model=128", "model.n_head=4"]
    for name in ("adamw", "adamw8bit"):
        run([*COMMON, *steps, f"optim={name}"], tmp_path / name, nproc=2).ok()
    full, low = tb_scalars(tmp_path / "adamw"), tb_scalars(tmp_path / "adamw8bit")
    assert low[40] < low[10] - 0.5
    assert low[40] == pytest.approx(full[40], rel=0.02), (low, full)
    state = {n: float(log_of(tmp_path / n).split("optimizer state: ")[1].split(" MB")[0]) for n in ("adamw",
                                                                                                   "adamw8bit")}
    assert 0.2 < state["adamw8bit"] / state["adamw"] < 0.35, state


@pytest.mark.slow
def test_adamw8bit_state_resumes_bit_identically_and_to_and_from_adamw(tmp_path):
    ckpt = ["trainer.max_steps=6", "checkpoint.every_n_steps=3", "checkpoint.keep_last=0"]
    full, resumed, cross = tmp_path / "full", tmp_path / "resumed", tmp_path / "cross"
    run([*COMMON, *ckpt, "optim=adamw8bit"], full, nproc=2).ok()
    run([*COMMON, *ckpt, "optim=adamw8bit", f"checkpoint.resume_from={ckpt_of(full, 3)}"], resumed, nproc=2).ok()
    a, b = tb_scalars(full), tb_scalars(resumed)
    assert sorted(b) == [4, 5, 6] and all(b[s] == a[s] for s in (4, 5, 6)), (a, b)
    run([*COMMON, *ckpt, "optim=adamw"], tmp_path / "adamw", nproc=2).ok()
    r = run([*COMMON, *ckpt, "optim=adamw8bit", f"checkpoint.resume_from={ckpt_of(tmp_path / 'adamw', 3)}"], cross,
            nproc=2).ok()
    assert "resumed from" in log_of(cross) and sorted(tb_scalars(cross)) == [4, 5, 6], r.output[-2000:]
    # and back: torchao stores lr as a 0-d tensor, which DCP refused to read into torch's float lr
    back = tmp_path / "back"
    r = run([*COMMON, *ckpt, "optim=adamw", f"checkpoint.resume_from={ckpt_of(full, 3)}"], back, nproc=2).ok()
    losses, plain = tb_scalars(back), tb_scalars(tmp_path / "adamw")
    assert "resumed from" in log_of(back) and sorted(losses) == [4, 5, 6], r.output[-2000:]
    assert losses[6] == pytest.approx(a[6], rel=0.02) and losses[6] == pytest.approx(plain[6], rel=0.02), (losses, a)
