"""optim=adamw8bit on 2 gloo ranks under FSDP2 (torchao's AdamW8bit on DTensor shards): it trains like adamw, its
8-bit state goes through a DCP checkpoint and a resume continues with bit-identical losses, and a checkpoint of
either optimizer resumes under the other (in process, both ways: tests/unit/test_adamw8bit.py)."""
from __future__ import annotations

import pytest

from helpers import Sweep, ckpt_of, log_of, requires, sweep_runs, tb_scalars

pytestmark = requires("lowbit")

COMMON = ["strategy=fsdp", "precision=fp32", "optim.lr=1e-2", "scheduler.warmup_steps=2",
          "trainer.eval_every_n_steps=0"]
# d_model 128 (gpt_tiny's width): each rank's matrix shards hold >= 4096 values, so torchao quantises them
LONG = ["trainer.max_steps=40", "trainer.log_every_n_steps=10", "model.d_model=128", "model.n_head=4"]
CKPT = ["trainer.max_steps=6", "checkpoint.every_n_steps=3", "checkpoint.keep_last=0"]


@pytest.fixture(scope="module")
def first_runs(tmp_path_factory, cache_dir) -> Sweep:
    """The runs that start from nothing, as the jobs of one 2-rank sweep: 40 steps under each optimizer, and 6 steps
    under each with checkpoints at steps 3 and 6 (``full``: adamw8bit, ``plain``: adamw)."""
    runs = {"adamw": [*COMMON, *LONG, "optim=adamw"], "adamw8bit": [*COMMON, *LONG, "optim=adamw8bit"],
            "full": [*COMMON, *CKPT, "optim=adamw8bit"], "plain": [*COMMON, *CKPT, "optim=adamw"]}
    return sweep_runs(runs, tmp_path_factory.mktemp("adamw8bit"), env={"HYDRATRAIN_CACHE": str(cache_dir)})


@pytest.mark.slow
def test_adamw8bit_trains_like_adamw(first_runs):
    full, low = tb_scalars(first_runs.job("adamw")), tb_scalars(first_runs.job("adamw8bit"))
    assert low[40] < low[10] - 0.5
    assert low[40] == pytest.approx(full[40], rel=0.02), (low, full)
    state = {n: float(log_of(first_runs.job(n)).split("optimizer state: ")[1].split(" MB")[0])
             for n in ("adamw", "adamw8bit")}
    assert 0.2 < state["adamw8bit"] / state["adamw"] < 0.35, state


@pytest.mark.slow
def test_adamw8bit_state_resumes_bit_identically_and_to_and_from_adamw(first_runs, tmp_path, cache_dir):
    """From step 3 of the 6-step runs, as the jobs of a second sweep: adamw8bit from its own checkpoint (``resumed``:
    the same losses, bit for bit), adamw8bit from adamw's (``cross``) and adamw from adamw8bit's (``back``)."""
    full, plain = first_runs.job("full"), first_runs.job("plain")
    runs = {"resumed": [*COMMON, *CKPT, "optim=adamw8bit", f"checkpoint.resume_from={ckpt_of(full, 3)}"],
            "cross": [*COMMON, *CKPT, "optim=adamw8bit", f"checkpoint.resume_from={ckpt_of(plain, 3)}"],
            # and back: torchao stores lr as a 0-d tensor, which DCP refused to read into torch's float lr
            "back": [*COMMON, *CKPT, "optim=adamw", f"checkpoint.resume_from={ckpt_of(full, 3)}"]}
    second = sweep_runs(runs, tmp_path, env={"HYDRATRAIN_CACHE": str(cache_dir)})
    a, b = tb_scalars(full), tb_scalars(second.job("resumed"))
    assert sorted(b) == [4, 5, 6] and all(b[s] == a[s] for s in (4, 5, 6)), (a, b)
    cross = second.job("cross")
    assert "resumed from" in log_of(cross) and sorted(tb_scalars(cross)) == [4, 5, 6], log_of(cross)[-2000:]
    back = second.job("back")
    losses, adamw = tb_scalars(back), tb_scalars(plain)
    assert "resumed from" in log_of(back) and sorted(losses) == [4, 5, 6], log_of(back)[-2000:]
    assert losses[6] == pytest.approx(a[6], rel=0.02) and losses[6] == pytest.approx(adamw[6], rel=0.02), (losses, a)
