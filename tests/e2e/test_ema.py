"""EMA weights across processes (``trainer.ema``): sharded under FSDP on 2 gloo ranks, the EMA is the one-process
run's; checkpointed as DTensor shards, it loads into one process exactly and a resumed run's is the uninterrupted
run's bit for bit.

The 2-rank runs are the jobs of one sweep inside 2 torchrun ranks: ``straight`` (20 steps) and ``first_half`` (the
same run to step 10, with its checkpoint there), which the resume test then relaunches in its own dir to step 20. The
tiny GPT has an SwiGLU width of 37 (``model.d_ff``), so its w1/w3 weights' first dimension does not divide the world
size (shards of 19 and 18 rows). SGD, not AdamW: AdamW's normalised update turns the reduction order's 1e-8 into 1e-6
differences of the weights themselves, SGD keeps them at rounding level, so the EMAs compare at 1e-6.
"""
from __future__ import annotations

import shutil

import pytest

from helpers import DEBUG, assert_same_tensors, ckpt_of, load_weights, log_of, run, sweep_runs, tb_all

SGD = "_target_: torch.optim.SGD\nlr: 0.05\nmomentum: 0.9\n"
# with DEBUG (tiny GPT, synthetic data); the global batch is 4 samples: 2 ranks x 2, or 1 rank x 2 micro-batches of 2
EMA = ["precision=fp32", "optim=sgd", "scheduler=constant", "model.d_ff=37", "trainer.max_steps=20",
       "trainer.eval_every_n_steps=10", "trainer.log_every_n_steps=10", "trainer.eval_samples=8",
       "trainer.ema.decay=0.9", "trainer.ema.warmup_steps=5", "trainer.save_weights=true",
       "checkpoint.every_n_steps=10", "data.batch_size=2"]
FSDP = [*EMA, "strategy=fsdp"]


@pytest.fixture(scope="module")
def ema_runs(tmp_path_factory, cache_dir):
    base = tmp_path_factory.mktemp("ema")
    (base / "conf" / "optim").mkdir(parents=True)
    (base / "conf" / "optim" / "sgd.yaml").write_text(SGD)
    sweep = sweep_runs({"straight": FSDP, "first_half": [*FSDP, "trainer.max_steps=10"]}, base,
                       sweep_dir=base / "sweep", env={"HYDRATRAIN_CACHE": str(cache_dir)})
    half = sweep.job("first_half")  # kept as they are at step 10 (the resume test goes on in that dir)
    shutil.copytree(ckpt_of(half, 10), base / "step10")
    shutil.copyfile(half / "model_ema.safetensors", base / "ema10.safetensors")
    return base, sweep


@pytest.mark.slow  # 80-100 s here: a 2-rank sweep of 2 jobs (shared), then two one-process runs
def test_the_ema_of_a_2_rank_fsdp_run_is_the_one_process_runs(ema_runs, cli):
    base, sweep = ema_runs
    fsdp = sweep.job("straight")
    one = cli([*DEBUG, f"hydra.searchpath=[file://{base / 'conf'}]", *EMA, "strategy=single",
               "trainer.grad_accum_steps=2"], base / "one", fast=False)
    assert one.returncode == 0, one.output[-3000:]
    a, b = load_weights(fsdp / "model_ema.safetensors"), load_weights(base / "one" / "model_ema.safetensors")
    raw = load_weights(fsdp / "model.safetensors")
    assert sorted(a) == sorted(b) == sorted(raw)
    assert a["blocks.0.mlp.w1.weight"].shape == (37, 64)  # (a first dimension 2 ranks shard unevenly)
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst < 1e-6, worst
    assert max((a[k] - raw[k]).abs().max().item() for k in a) > 1e-3  # an average, not the weights
    # each rank saved its own shard of the EMA (a DTensor), nothing gathered
    from hydratrain.checkpoint.io import verify

    md = verify(ckpt_of(fsdp, 20)).state_dict_metadata
    assert len(md["callbacks.ema.weights.blocks.0.mlp.w1.weight"].chunks) == 2
    tb = tb_all(fsdp)
    assert sorted(tb["eval_ema/loss"]) == [10, 20] and tb["eval_ema/loss"][20] != tb["eval/loss"][20]
    assert tb["eval_ema/loss"][20] == pytest.approx(tb_all(base / "one")["eval_ema/loss"][20], abs=1e-5)
    # the 2 ranks' EMA shards of step 10 resharded into one process (DCP): the same tensors, bit for bit
    again = cli([*DEBUG, f"hydra.searchpath=[file://{base / 'conf'}]", *EMA, "strategy=single", "trainer.max_steps=10",
                 f"checkpoint.resume_from={base / 'step10'}"], base / "resharded", fast=False)
    assert again.returncode == 0, again.output[-3000:]
    assert_same_tensors(load_weights(base / "ema10.safetensors"),
                        load_weights(base / "resharded" / "model_ema.safetensors"), "the EMA of step 10, 2 ranks / 1")


@pytest.mark.slow  # 30-55 s here after the shared sweep: a 2-rank relaunch
def test_a_resumed_run_has_the_uninterrupted_runs_ema_bit_for_bit(ema_runs, cache_dir):
    base, sweep = ema_runs
    straight, half = sweep.job("straight"), sweep.job("first_half")
    assert (half / "model_ema.safetensors").exists()  # (its own end, at step 10)
    run([*DEBUG, f"hydra.searchpath=[file://{base / 'conf'}]", *FSDP], half, nproc=2, fast=False,
        env={"HYDRATRAIN_CACHE": str(cache_dir)}).ok()
    assert f"resumed from {ckpt_of(half, 10)}: step 10" in log_of(half)
    assert_same_tensors(load_weights(straight / "model_ema.safetensors"), load_weights(half / "model_ema.safetensors"),
                        "the EMA of the straight run and of the one resumed at step 10")
    assert tb_all(half)["eval_ema/loss"][20] == tb_all(straight)["eval_ema/loss"][20]
